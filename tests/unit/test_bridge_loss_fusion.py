"""A Megatron-Bridge plan is priced with the loss its YAML runs: every recipe ``aceso export --to megatron-bridge``
writes sets ``cross_entropy_loss_fusion = True`` (and a Bridge user keeps it), so a ``--target megatron-bridge``
search prices the recipe's fused loss and impl, the plan records it (``settings.stack.cross_entropy_fusion``), the
YAML states it, and the export header, ``explain --framework megatron-bridge`` and the (hybrid) YAML's import give
the same number. A plan without the fusion states ``cross_entropy_loss_fusion: false``. Before, the search priced
the unfused loss (fp32 logits, slower) and the YAML wrote no fusion field, so Bridge ran the recipe's fused one.

The reference, hand-copied from Megatron-Bridge's recipes (``cfg.model.cross_entropy_loss_fusion = True`` and
``cfg.model.cross_entropy_fusion_impl``), the same at both tags the export writes for: v0.3.1
recipes/llama/llama3.py:269-270 (8B) / 702-703 (70B), llama/llama2.py:77-78, gpt/gpt3_175b.py:80-81,
qwen/qwen3_moe.py:79-80, deepseek/deepseek_v3.py:134-135, nemotronh/nemotronh.py:89-90 / 190-191 / 293-294 /
396-397, nemotronh/nemotron_3_nano.py:89-90; v0.6.0 (the names alias the ``*_h100_bf16`` recipes)
recipes/llama/h100/llama3.py:279-280 / 761-762, llama/h100/llama2.py:78-79, gpt/h100/gpt3_175b.py:91-92,
qwen/h100/qwen3_moe.py:88-89, deepseek/h100/deepseek_v3.py:173-174, nemotronh/h100/nemotronh.py:124-125 /
261-262 / 402-403 / 544-545, nemotronh/h100/nemotron_3_nano.py:166-167; GPT-OSS: v0.3.1
recipes/gpt_oss/gpt_oss.py:94-95 (20B) / 212-213 (120B), v0.6.0 recipes/gpt_oss/h100/gpt_oss.py:109 / 233."""

from __future__ import annotations

import json
import re

import pytest

from search.cli import main
from search.pricing import price
from search.spec.presets import load_model

# recipe -> (v0.3.1's impl, v0.6.0's impl), hand-copied (module docstring)
RECIPES = {"llama3_8b_pretrain_config": ("te", "te"), "llama3_70b_pretrain_config": ("te", "te"),
           "llama2_7b_pretrain_config": ("native", "native"), "gpt3_175b_pretrain_config": ("native", "native"),
           "qwen3_30b_a3b_pretrain_config": ("te", "te"), "deepseek_v3_pretrain_config": ("te", "te"),
           "nemotronh_4b_pretrain_config": ("native", "native"), "nemotronh_8b_pretrain_config": ("native", "native"),
           "nemotronh_47b_pretrain_config": ("native", "native"),
           "nemotronh_56b_pretrain_config": ("native", "native"),
           "nemotron_3_nano_pretrain_config": ("native", "native"),
           "gpt_oss_20b_pretrain_config": ("native", "native"), "gpt_oss_120b_pretrain_config": ("native", "native")}


def _run(capsys, *argv) -> str:
    rc = main(list(argv))
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    return cap.out


def _header_ms(text: str) -> str:
    return re.search(r"^# predicted .*?: ([\d.]+) ms per iteration", text, re.M).group(1)


def _explain_ms(capsys, *argv) -> str:
    return re.search(r"^iteration ([\d.]+) ms", _run(capsys, "explain", *argv), re.M).group(1)


def test_the_recipes_fusion_is_the_tags():
    from search.megatron.bridge import RECIPE_CE_FUSION
    assert set(RECIPE_CE_FUSION) == set(RECIPES)
    for name, impls in RECIPES.items():
        assert impls[0] == impls[1] == RECIPE_CE_FUSION[name], name


@pytest.mark.parametrize("model, impl", [("llama3-8b", "te"), ("llama2-7b", "native"), ("gpt-1.3b", "native"),
                                         ("nemotron-h-8b", "native"), ("nemotron-3-nano", "native"),
                                         ("gpt-oss-20b", "native")])
def test_each_model_takes_its_exported_recipes_fusion(model, impl):
    """The impl follows the recipe the export writes the model's YAML for (``recipe_for``)."""
    from search.megatron.bridge import recipe_ce_fusion
    assert recipe_ce_fusion(load_model(model)) == impl


@pytest.mark.parametrize("model, cluster, impl, hybrid", [("llama3-8b", "1x8-h100", "te", False),   # dense GPT
                                                          ("nemotron-h-8b", "1x8-h100", "native", True),   # hybrid
                                                          ("nemotron-3-nano", "1x8-gb200", "native", True)])  # + MoE
def test_search_export_explain_import_price_the_recipes_fused_loss(tmp_path, capsys, model, cluster, impl, hybrid):
    plan_path, yaml, back = tmp_path / "p.json", tmp_path / "b.yaml", tmp_path / "back.json"
    _run(capsys, "search", "--model", model, "--cluster", cluster, "--global-batch-size", "64", "--target",
         "megatron-bridge", "--budget-evals", "40", "--workers", "1", "-o", str(plan_path))
    searched = json.loads(plan_path.read_text())
    # the plan records what it priced (and the fine-grained offload or CUDA graphs where the search chose them:
    # fine_offload.py, dispatchers.py)
    assert searched["settings"]["stack"]["cross_entropy_fusion"] == impl
    assert set(searched["settings"]["stack"]) <= {"cross_entropy_fusion", "offload", "cuda_graphs"}
    ms = "%.1f" % searched["predicted"]["iteration_time_ms"]
    from search.spec.plan import ParallelPlan
    plan = ParallelPlan.model_validate(searched)
    assert "%.1f" % price(plan).iteration_ms == ms
    rest = plan.settings.stack.model_copy(update={"cross_entropy_fusion": None})
    unfused = plan.model_copy(update={"settings": plan.settings.model_copy(update={"stack": None if rest.empty
                                                                                   else rest})})
    assert "%.1f" % price(unfused).iteration_ms != ms                          # the fusion changes the price
    _run(capsys, "export", str(plan_path), "--to", "megatron-bridge", "-o", str(yaml))
    text = yaml.read_text()
    assert "  cross_entropy_loss_fusion: true\n" in text and f"  cross_entropy_fusion_impl: {impl}\n" in text, text
    assert _header_ms(text) == ms
    assert _explain_ms(capsys, str(plan_path), "--framework", "megatron-bridge") == ms
    assert _explain_ms(capsys, str(plan_path)) == ms
    if hybrid:
        _run(capsys, "import", str(yaml), "--from", "megatron-bridge", "--cluster", cluster, "-o", str(back))
        imported = json.loads(back.read_text())
        assert imported["settings"]["stack"] == searched["settings"]["stack"]
        assert "%.1f" % imported["predicted"]["iteration_time_ms"] == ms


def _bridge_plan(model: str, bounds, pp: int, dp: int, stack=None):
    from search.cli.import_cmd import predict
    from search.settings.plan_settings import PlanSettings
    from search.spec.cluster import parse_cluster
    from tests.hybrid_plans import cut_plan
    plan = cut_plan(load_model(model), bounds, pp, dp=dp, gbs=64, cluster=parse_cluster("1x8-h100"),
                    settings=PlanSettings(framework="megatron-bridge", release="0.16", grad_reduce_in_fp32=True,
                                          stack=stack))
    return plan.model_copy(update={"predicted": predict(plan, None)})


def test_a_plan_without_the_fusion_states_it_off(tmp_path, capsys):
    """A Bridge plan priced with the unfused loss (one searched before, or imported from a YAML that turns it off)
    writes ``cross_entropy_loss_fusion: false``, else Bridge would run the recipe's fused loss; its import reads
    the unfused loss back at the header's price."""
    plan = _bridge_plan("nemotron-h-8b", [0, 26, 52], 2, 4)
    path, yaml, back = tmp_path / "p.json", tmp_path / "b.yaml", tmp_path / "back.json"
    path.write_text(plan.to_json())
    _run(capsys, "export", str(path), "--to", "megatron-bridge", "-o", str(yaml))
    text = yaml.read_text()
    assert "  cross_entropy_loss_fusion: false\n" in text and "cross_entropy_fusion_impl" not in text, text
    ms = "%.1f" % plan.predicted.iteration_time_ms
    assert _header_ms(text) == ms
    _run(capsys, "import", str(yaml), "--from", "megatron-bridge", "--cluster", "1x8-h100", "-o", str(back))
    imported = json.loads(back.read_text())
    assert imported["settings"].get("stack") is None
    assert "%.1f" % imported["predicted"]["iteration_time_ms"] == ms
    assert _explain_ms(capsys, str(path), "--framework", "megatron-bridge") == ms


def test_explain_framework_bridge_of_another_plan_prices_bridges_default_loss(tmp_path, capsys):
    """``explain --framework megatron-bridge`` of a Megatron-LM plan prices it with Bridge's defaults, the recipe's
    fused loss among them (as ``search --target megatron-bridge`` does): the price of the same plan stated as a
    Bridge plan with that fusion. A loss fusion the plan states is kept."""
    from search.settings.stack import StackSettings
    fused = _bridge_plan("llama3-8b", [0, 32, 64], 2, 4, StackSettings(cross_entropy_fusion="te"))
    lm = fused.model_copy(update={"settings": fused.settings.model_copy(
        update={"framework": "megatron-lm", "release": "0.16", "stack": None})})
    path = tmp_path / "lm.json"
    path.write_text(lm.to_json())
    assert _explain_ms(capsys, str(path), "--framework", "megatron-bridge") == "%.1f" % price(fused).iteration_ms
    assert _explain_ms(capsys, str(path), "--framework", "megatron-lm") == "%.1f" % price(lm).iteration_ms
    assert price(lm).iteration_ms > price(fused).iteration_ms          # the unfused loss is the slower
    native = lm.model_copy(update={"settings": lm.settings.model_copy(
        update={"stack": StackSettings(cross_entropy_fusion="native")})})
    path.write_text(native.to_json())
    stated = fused.model_copy(update={"settings": fused.settings.model_copy(update={"stack": native.settings.stack})})
    assert _explain_ms(capsys, str(path), "--framework", "megatron-bridge") == "%.1f" % price(stated).iteration_ms
