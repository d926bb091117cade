"""Every export writes the softmax router the model has: pre-softmax (megatron-core's ``moe_router_pre_softmax``:
softmax over all experts, then the top-k, weights not renormalized) or not (top-k, then a softmax over them).

Before, the model spec had no such field: an imported ``--moe-router-pre-softmax`` (top-k > 1) was dropped, so
compare's best plan (``explain --megatron-args --save-best``) and the import's re-export trained a renormalizing
router; and the Bridge YAML left the recipe's value (the DeepSeek-V3 recipe's true) in place. References:
- Qwen2-57B-A14B's config.json ``norm_topk_prob: false`` (model_specs/presets/SOURCES-moe.md), HF Qwen2MoE's router
  ``softmax(logits)`` over all experts then ``topk`` without renormalization: megatron-core's pre-softmax;
- Qwen3-30B-A3B (``norm_topk_prob: true``), Mixtral (softmax over the top-k logits) and GPT-OSS (top-k, then softmax
  over them) renormalize: megatron-core's default;
- megatron-core 0.16 ``moe_utils.topk_routing_with_score_function``: ``use_pre_softmax`` acts in the softmax branch
  only (a sigmoid router normalizes its top-k whatever it says), and top-1 softmax needs it;
- Megatron-Bridge v0.3.1 ``models/deepseek/deepseek_v3_bridge.py`` sets ``moe_router_pre_softmax = True``,
  ``qwen3_moe_bridge.py`` False."""

from __future__ import annotations

import json
import shlex

import pytest

from search.cli import main
from search.megatron import megatron_config
from search.megatron.bridge import overrides
from search.megatron.importer import read_megatron
from search.megatron.script import args_line
from search.megatron.versions import release
from search.spec.plan import uniform_plan
from search.spec.presets import load_model

PRE = "--moe-router-pre-softmax"
# preset -> pre-softmax (the HF routers above)
ROUTERS = {"qwen2-57b-a14b": True, "qwen3-30b-a3b": False, "qwen3-235b-a22b": False, "mixtral-8x7b": False,
           "mixtral-8x22b": False, "gpt-oss-20b": False, "gpt-oss-120b": False}


def _plan(name: str, **kw):
    return uniform_plan(load_model(name, num_layers=4), 1, 1, 8, 8, 64, **kw)


@pytest.mark.parametrize("name", sorted(ROUTERS))
def test_both_exports_write_the_presets_router(name):
    c = megatron_config(_plan(name))
    assert (PRE in args_line(c, release()).split()) is ROUTERS[name]
    assert overrides(c)[1]["model"]["moe_router_pre_softmax"] is ROUTERS[name]


def test_the_bridge_yaml_states_a_sigmoid_routers_value_over_the_recipes():
    """DeepSeek-V3 runs from the DeepSeek-V3 recipe (pre-softmax true): the YAML says the model's (a sigmoid router
    ignores it, so the run is the same), never the recipe's by omission."""
    recipe, ov = overrides(megatron_config(_plan("deepseek-v3")))
    assert recipe == "deepseek_v3_pretrain_config" and ov["model"]["moe_router_pre_softmax"] is False


def test_an_imported_pre_softmax_router_is_exported_again():
    line = args_line(megatron_config(_plan("qwen2-57b-a14b")), release())
    imp = read_megatron(line, "run.sh", world_size=8)
    assert imp.plan.model.moe.moe_router_pre_softmax is True
    assert PRE in args_line(megatron_config(imp.plan), release()).split()
    # the same line without the flag is the renormalizing router
    plain = read_megatron(" ".join(w for w in shlex.split(line) if w != PRE), "run.sh", world_size=8)
    assert plain.plan.model.moe.moe_router_pre_softmax is False
    # a sigmoid router ignores the flag: not a different model
    ds = args_line(megatron_config(_plan("deepseek-v3")), release()) + " " + PRE
    assert read_megatron(ds, "run.sh", world_size=8).plan.model.moe.moe_router_pre_softmax is False


def test_compares_best_plan_keeps_the_router(tmp_path, capsys):
    """``explain --megatron-args`` (compare) of a pre-softmax Qwen2-57B line: its best plan's export writes the flag."""
    line = args_line(megatron_config(_plan("qwen2-57b-a14b")), release())
    best, script = tmp_path / "best.json", tmp_path / "best.sh"
    rc = main(["explain", "--megatron-args", line, "--cluster", "1x8-h100", "--search-budget-evals", "40",
               "--save-best", str(best)])
    err = capsys.readouterr().err
    assert rc == 0, err
    assert json.loads(best.read_text())["model"]["moe"]["moe_router_pre_softmax"] is True
    assert main(["export", str(best), "-o", str(script)]) == 0, capsys.readouterr().err
    assert PRE in script.read_text()


# ----- the HF import: norm_topk_prob false is the pre-softmax router -------------------------------------------------
def _hf(name: str, **edit):
    from pathlib import Path

    from search.cli.import_hf import hf_to_spec

    cfg = json.loads((Path(__file__).parent / "data" / "hf" / name / "config.json").read_text())
    cfg = {k: v for k, v in {**cfg, **edit}.items() if v is not None}
    return hf_to_spec(cfg, source=name)


@pytest.mark.parametrize("norm, pre", [(True, False), (False, True), (None, True)])
def test_qwen3_moe_norm_topk_prob_is_the_router(norm, pre):
    """HF Qwen3-MoE's router: softmax over all experts, top-k, renormalized only when ``norm_topk_prob`` (default
    false in Qwen3MoeConfig). Without renormalization it is Qwen2-57B-A14B's router, the preset's pre-softmax one
    (its config.json: norm_topk_prob false); megatron-core's ``use_pre_softmax`` runs the same sum (checked on numbers
    in tests/runtime/test_router_pre_softmax_numerics.py). Before, false and absent were refused."""
    moe = _hf("qwen3-30b-a3b", norm_topk_prob=norm).moe
    assert moe.moe_router_pre_softmax is pre
    assert moe.moe_router_pre_softmax is (load_model("qwen2-57b-a14b").moe.moe_router_pre_softmax if pre else False)


def test_imported_pre_softmax_router_round_trips_through_the_export():
    m = _hf("qwen3-30b-a3b", norm_topk_prob=False).model_copy(update={"num_layers": 4})
    line = args_line(megatron_config(uniform_plan(m, 1, 1, 8, 8, 64)), release())
    assert PRE in line.split()
    assert read_megatron(line, "run.sh", world_size=8).plan.model.moe.moe_router_pre_softmax is True
    assert overrides(megatron_config(uniform_plan(m, 1, 1, 8, 8, 64)))[1]["model"]["moe_router_pre_softmax"] is True


def test_deepseek_softmax_scoring_without_renormalization_is_pre_softmax():
    """DeepSeek's softmax scoring (``scoring_func: softmax``, greedy top-k): softmax over all, top-k, renormalized
    only when ``norm_topk_prob``; the sigmoid router (the model's own) without it is refused: megatron-core
    renormalizes a sigmoid top-k above top-1 whatever ``moe_router_pre_softmax`` says."""
    soft = dict(scoring_func="softmax", topk_method="greedy")
    assert _hf("deepseek-v3", norm_topk_prob=False, **soft).moe.moe_router_pre_softmax is True
    assert _hf("deepseek-v3", norm_topk_prob=True, **soft).moe.moe_router_pre_softmax is False
    from search.io.errors import AcesoError
    with pytest.raises(AcesoError, match="norm_topk_prob false: HF keeps the sigmoid router's top-k weights "
                                         "unnormalized; megatron-core's sigmoid router renormalizes them"):
        _hf("deepseek-v3", norm_topk_prob=False)

