"""The router's top-k scaling factor (megatron-core ``TransformerConfig.moe_router_topk_scaling_factor``, HF
``routed_scaling_factor``: the routed experts' weights are multiplied by it). It changes the numerics, not the cost,
so nothing prices it; what must hold is that every preset carries its model's published value and every way out
(Megatron-LM flags, Megatron-Bridge overrides) and back (their imports) keeps it, whatever the recipe's own factor.

The references are the models' own Hugging Face config.json files, quoted below with their repositories."""

from __future__ import annotations

import json
import os

import pytest

from search.cli import main
from search.megatron import megatron_config
from search.megatron.bridge import overrides as gpt_overrides
from search.megatron.bridge_hybrid import overrides as hybrid_overrides
from search.megatron.hybrid_pattern import args_line, hybrid_form, write_script
from search.megatron.importer import read_megatron
from search.megatron.script import args_line as gpt_args_line
from search.megatron.versions import release
from search.spec.cluster import parse_cluster
from search.spec.plan import load_plan, uniform_plan
from search.spec.presets import load_model
from tests.hybrid_plans import cut_plan

HF = os.path.join(os.path.dirname(__file__), "data", "hf")

# routed_scaling_factor of each preset's published config.json (https://huggingface.co/REPO/blob/main/config.json);
# 1.0: the config has no such field (transformers' default: no scaling)
PUBLISHED = {
    "nemotron-3-nano": 2.5,      # nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16 ("routed_scaling_factor": 2.5)
    "nemotron-3-super": 5.0,     # nvidia/NVIDIA-Nemotron-3-Super-120B-A12B-BF16 ("routed_scaling_factor": 5.0)
    "nemotron-3-ultra": 5.0,     # Megatron-LM examples/post_training/modelopt/conf/nvidia/
    #                              NVIDIA-Nemotron-3-Ultra-550B-A55B-BF16.sh (--moe-router-topk-scaling-factor 5.0)
    "deepseek-v3": 2.5,          # deepseek-ai/DeepSeek-V3 (tests/unit/data/hf/deepseek-v3/config.json)
    "deepseek-v3-no-mtp": 2.5,   # the same model without its MTP layer
    "kimi-k2": 2.827,            # moonshotai/Kimi-K2-Base ("routed_scaling_factor": 2.827)
    "qwen3-30b-a3b": 1.0, "qwen3-235b-a22b": 1.0,     # Qwen/Qwen3-*: no routed_scaling_factor
    "mixtral-8x7b": 1.0, "mixtral-8x22b": 1.0,        # mistralai/Mixtral-*: none
    "gpt-oss-120b": 1.0, "gpt-oss-20b": 1.0,          # openai/gpt-oss-*: none
    "qwen2-57b-a14b": 1.0,                            # Qwen/Qwen2-57B-A14B: none
}


def _factor(m) -> float:
    return (m.megatron or {}).get("moe_router_topk_scaling_factor", 1.0)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_every_moe_preset_carries_its_published_factor(name):
    assert _factor(load_model(name)) == PUBLISHED[name]


def test_deepseek_v3_is_its_transcribed_config():
    """The factor of the transcribed config.json, read as a user's import reads it, is the preset's."""
    cfg = json.load(open(os.path.join(HF, "deepseek-v3", "config.json")))
    assert cfg["routed_scaling_factor"] == _factor(load_model("deepseek-v3"))


def test_every_moe_preset_is_listed():
    from model_specs import preset_names
    moe = {n for n in preset_names() if load_model(n).moe is not None}
    assert moe == set(PUBLISHED)


# ----- Megatron-LM: --moe-router-topk-scaling-factor, written and read back ----------------------------------------
@pytest.mark.parametrize("name", ["nemotron-3-nano", "nemotron-3-super"])
def test_the_hybrid_script_states_the_factor_and_imports_it_back(name):
    m = load_model(name)
    plan = cut_plan(m, [0, 5, 30, m.num_units], 3, tp=2, sp=True, gbs=12)
    form = hybrid_form(plan, release("0.19"))
    flags = args_line(form).split()
    assert flags[flags.index("--moe-router-topk-scaling-factor") + 1] == repr(PUBLISHED[name])
    imp = read_megatron(write_script(plan, form, "p.json"), version="0.19")
    assert _factor(imp.plan.model) == PUBLISHED[name] and imp.plan.model == m


def _gpt_plan(name: str, **kw):
    m = load_model(name).model_copy(update={"num_layers": 8, "mtp_num_layers": None, **kw})
    return uniform_plan(m, 2, 2, 1, 1, 8, cluster=parse_cluster("1x4-h100"), sequence_parallel=True)


@pytest.mark.parametrize("name", ["kimi-k2", "qwen3-30b-a3b"])
def test_the_gpt_line_states_the_factor_and_imports_it_back(name):
    plan = _gpt_plan(name)
    flags = gpt_args_line(megatron_config(plan)).split()
    stated = "--moe-router-topk-scaling-factor" in flags
    assert stated == (PUBLISHED[name] != 1.0)
    if stated:
        assert float(flags[flags.index("--moe-router-topk-scaling-factor") + 1]) == PUBLISHED[name]
    imp = read_megatron(gpt_args_line(megatron_config(plan)), world_size=plan.world_size, cluster=plan.cluster)
    assert _factor(imp.plan.model) == PUBLISHED[name]


# ----- Megatron-Bridge: the model's factor over the recipe's --------------------------------------------------------
def test_super_under_the_nano_recipe_runs_its_own_factor(tmp_path, capsys):
    """Bridge runs Nemotron-3 Super from nemotron_3_nano_pretrain_config, whose Nemotron3NanoProvider sets 2.5: the
    overrides must state Super's 5.0, and the YAML imports back with it."""
    sup = load_model("nemotron-3-super")
    plan = cut_plan(sup, [0, 40, sup.num_units], 2, gbs=16)
    recipe, _, ov = hybrid_overrides(plan, pipes=True)
    assert recipe == "nemotron_3_nano_pretrain_config"
    assert ov["model"]["moe_router_topk_scaling_factor"] == 5.0
    path, yaml, back = tmp_path / "plan.json", tmp_path / "o.yaml", tmp_path / "back.json"
    path.write_text(plan.to_json())
    assert main(["export", str(path), "--to", "megatron-bridge", "-o", str(yaml)]) == 0
    assert "  moe_router_topk_scaling_factor: 5.0\n" in yaml.read_text()
    assert main(["import", str(yaml), "--from", "megatron-bridge", "-o", str(back)]) == 0, capsys.readouterr().err
    assert _factor(load_plan(str(back)).model) == 5.0 and load_plan(str(back)).model == plan.model


def test_a_hybrid_without_a_factor_writes_null_not_the_recipes(tmp_path, capsys):
    nano = load_model("nemotron-3-nano")
    plain = nano.model_copy(update={"name": "custom", "aceso_db_key": None, "megatron": None})
    plan = cut_plan(plain, [0, 52], 1, tp=2, dp=4, sp=True, gbs=32)
    _, _, ov = hybrid_overrides(plan)
    assert "moe_router_topk_scaling_factor" in ov["model"] and ov["model"]["moe_router_topk_scaling_factor"] is None
    path, yaml, back = tmp_path / "plan.json", tmp_path / "o.yaml", tmp_path / "back.json"
    path.write_text(plan.to_json())
    assert main(["export", str(path), "--to", "megatron-bridge", "-o", str(yaml)]) == 0
    assert "  moe_router_topk_scaling_factor: null\n" in yaml.read_text()
    assert main(["import", str(yaml), "--from", "megatron-bridge", "-o", str(back)]) == 0, capsys.readouterr().err
    got = load_plan(str(back)).model
    assert _factor(got) == 1.0 and got == plan.model.model_copy(update={"name": got.name})


@pytest.mark.parametrize("name", ["kimi-k2", "qwen3-30b-a3b"])
def test_a_gpt_moe_writes_its_factor_over_the_recipes(name, tmp_path, capsys):
    """Kimi-K2 runs from deepseek_v3_pretrain_config (DeepSeek-V3's 2.5): its 2.827 is written; Qwen3 writes null
    (none). (aceso reads back the hybrid recipes' overrides only.)"""
    plan = _gpt_plan(name)
    recipe, ov = gpt_overrides(megatron_config(plan))
    want = None if PUBLISHED[name] == 1.0 else PUBLISHED[name]
    assert recipe == ("deepseek_v3_pretrain_config" if name == "kimi-k2" else "qwen3_30b_a3b_pretrain_config")
    assert ov["model"]["moe_router_topk_scaling_factor"] == want
    path, yaml = tmp_path / "plan.json", tmp_path / "o.yaml"
    path.write_text(plan.to_json())
    assert main(["export", str(path), "--to", "megatron-bridge", "-o", str(yaml)]) == 0, capsys.readouterr().err
    assert f"  moe_router_topk_scaling_factor: {'null' if want is None else repr(want)}\n" in yaml.read_text()
