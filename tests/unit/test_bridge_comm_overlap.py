"""A Bridge YAML runs the p2p and TP overlaps its plan was priced with, whichever recipe it starts from.

Megatron-Bridge v0.3.1 sets the model's overlaps in ``runtime_config_update`` (training/config.py:1870), after the
YAML is merged, and only for a recipe with a ``comm_overlap`` section: ``CommOverlapConfig._get_model_comm_overlap_cfgs``
(training/comm_overlap.py:425-452) starts from TP overlap off and, with pp > 1, ``overlap_p2p_comm`` on /
``batch_p2p_comm`` off for virtual stages (on / off the other way without), then applies every field the section
states (``_override_user_cfgs``; TP overlap dropped for tp < 2 or no SP, comm_overlap.py:440-447); ``setup`` writes
the result onto the model. A recipe without the section runs the model's own fields, merged from the YAML over
megatron-core 0.16.1's ``ModelParallelConfig`` defaults (model_parallel_config.py:297 ``overlap_p2p_comm`` False,
:302 ``batch_p2p_comm`` True; ``tp_comm_overlap`` False).

The recipes' sections (hand-copied from v0.3.1): ``llama3_8b_pretrain_config`` and ``qwen3_30b_a3b_pretrain_config``
none (recipes/common.py ``comm_overlap=None``; qwen3_moe.py:107 leaves it commented out); ``llama2_7b``
``CommOverlapConfig(tp_comm_overlap=False)`` (recipes/llama/llama2.py:118); ``llama3_70b`` TP overlap on with the
h8192 tp4 userbuffers (recipes/llama/llama3.py:737); ``gpt3_175b`` on with the h12288 tp4 ones (recipes/gpt/
gpt3_175b.py:104); ``deepseek_v3`` off (recipes/deepseek/deepseek_v3.py:168).

Before, a Llama 3 8B plan with virtual stages was priced with the async p2p (Megatron-LM's default) while its YAML ran
it off, and a Llama 3 70B plan without TP overlap ran the recipe's TP overlap."""

from __future__ import annotations

import dataclasses

import pytest

from search.costmodel.plan_view import run_settings
from search.megatron.bridge import overrides
from search.spec.presets import load_model
from tests.megatron_plans import CASES, case_config

SECTIONS = {"llama3_8b_pretrain_config": None, "qwen3_30b_a3b_pretrain_config": None,
            "llama2_7b_pretrain_config": {"tp_comm_overlap": False},
            "llama3_70b_pretrain_config": {"tp_comm_overlap": True, "tp_comm_overlap_cfg": "h8192_tp4"},
            "gpt3_175b_pretrain_config": {"tp_comm_overlap": True, "tp_comm_overlap_cfg": "h12288_tp4"},
            "deepseek_v3_pretrain_config": {"tp_comm_overlap": False}}
CORE_DEFAULTS = {"overlap_p2p_comm": False, "batch_p2p_comm": True, "tp_comm_overlap": False}


def bridge_runs(recipe: str, ov: dict) -> dict:
    """The model's overlap fields after Bridge v0.3.1 merges the YAML ``ov`` over ``recipe`` (module docstring)."""
    model = {**CORE_DEFAULTS, **{k: v for k, v in ov["model"].items() if k in CORE_DEFAULTS}}
    section = SECTIONS[recipe]
    if section is None:
        assert "comm_overlap" not in ov, "a YAML section over a recipe without one"
        return model
    user = {**section, **ov.get("comm_overlap", {})}
    if user.get("tp_comm_overlap") and (model_tp(ov) < 2 or not ov["model"]["sequence_parallel"]):
        user["tp_comm_overlap"] = False
    pp, vpp = ov["model"]["pipeline_model_parallel_size"], ov["model"]["virtual_pipeline_model_parallel_size"] or 1
    rule = {"tp_comm_overlap": False, "overlap_p2p_comm": pp > 1 and vpp > 1, "batch_p2p_comm": pp > 1 and vpp == 1}
    return {**model, **rule, **{k: v for k, v in user.items() if k in rule and v is not None}}


def model_tp(ov: dict) -> int:
    return ov["model"]["tensor_model_parallel_size"]


def _with_model(c, name: str):
    m = load_model(name, num_layers=sum(c.chunk_layers))
    return dataclasses.replace(c, model=m)


VPP = [n for n in CASES if CASES[n][3] > 1 and not n.startswith("t5")]


@pytest.mark.parametrize("model", [None, "llama3-70b", "llama2-7b", "qwen3-30b-a3b"])
@pytest.mark.parametrize("name", VPP + ["llama-pp2-layout-embedding-only", "tiny-llama-gqa-selective"])
def test_the_yaml_runs_the_p2p_and_tp_overlap_priced(name, model):
    c = case_config(name)
    if model is not None:
        if c.model.activation != "swiglu":
            pytest.skip("a GELU model runs from the GPT recipe")
        c = _with_model(c, model)
    recipe, ov = overrides(c)
    runs = bridge_runs(recipe, ov)
    priced = run_settings(c.settings, c.precision)
    interleaved = c.vpp > 1
    assert runs["overlap_p2p_comm"] == (interleaved and priced.overlap_p2p_comm), (recipe, runs)
    # megatron-core's interleaved schedule refuses both (schedules.py:921); 1F1B batches each send with a receive
    assert not (runs["overlap_p2p_comm"] and runs["batch_p2p_comm"])
    if c.pp > 1 and not interleaved:
        assert runs["batch_p2p_comm"] == priced.batched_p2p
    assert runs["tp_comm_overlap"] is c.settings.tp_comm_overlap is False, recipe


def test_the_interleaved_llama_yaml_states_the_async_p2p():
    """The case the fix is about, stated directly: llama3_8b has no comm_overlap section, so the YAML's model fields
    are what runs."""
    recipe, ov = overrides(case_config("llama-pp4-vpp2-first-last"))
    assert recipe == "llama3_8b_pretrain_config" and "comm_overlap" not in ov
    assert (ov["model"]["overlap_p2p_comm"], ov["model"]["batch_p2p_comm"]) == (True, False)


def test_tp_overlap_on_a_llama_recipe_with_a_section_is_written():
    """llama2_7b and llama3_70b hold a comm_overlap section, so the plan's TP overlap is written there (the
    transformer-engine default userbuffers: the recipe's are for one shape); llama3_8b still has none: refused."""
    c = case_config("llama-pp4-tp-comm-overlap")
    assert c.settings.tp_comm_overlap
    for name in ("llama2-7b", "llama3-70b"):
        recipe, ov = overrides(_with_model(c, name))
        assert {k: ov["comm_overlap"][k] for k in ("tp_comm_overlap", "tp_comm_overlap_cfg")} == \
            {"tp_comm_overlap": True, "tp_comm_overlap_cfg": None}, recipe
        assert bridge_runs(recipe, ov)["tp_comm_overlap"] is True
    from search.io.errors import AcesoError
    with pytest.raises(AcesoError, match="llama3_8b_pretrain_config does not have"):
        overrides(c)


def test_search_header_and_explain_agree_on_an_interleaved_bridge_plan(tmp_path, capsys):
    """search -> export -> explain --framework megatron-bridge on a Llama 3 8B plan with virtual stages: one price
    (async p2p, as the YAML now runs it: llama3_8b has no comm_overlap section)."""
    import json
    import re

    from search.cli import main
    plan, yaml = tmp_path / "p.json", tmp_path / "b.yaml"
    assert main(["search", "--model", "llama3-8b", "--cluster", "1x8-h100", "--global-batch-size", "64", "--target",
                 "megatron-bridge", "--pp", "4", "--vpp", "2", "--budget-evals", "40", "--workers", "1",
                 "-o", str(plan)]) == 0
    searched = json.loads(plan.read_text())
    assert all(len(st["chunks"]) == 2 for st in searched["stages"])
    ms = "%.1f" % searched["predicted"]["iteration_time_ms"]
    assert main(["export", str(plan), "--to", "megatron-bridge", "-o", str(yaml)]) == 0
    text = yaml.read_text()
    assert re.search(r"^# predicted .*?: ([\d.]+) ms per iteration", text, re.M).group(1) == ms
    assert "llama3_8b_pretrain_config" in text and "\ncomm_overlap:" not in text
    assert "  overlap_p2p_comm: true\n" in text and "  batch_p2p_comm: false\n" in text
    capsys.readouterr()
    assert main(["explain", str(plan), "--framework", "megatron-bridge"]) == 0
    assert f"iteration {ms} ms" in capsys.readouterr().out


# megatron-core 0.16.1's DistributedDataParallelConfig defaults (distributed_data_parallel_config.py) and
# DistributedDataParallel's bucket size when none is given (distributed_data_parallel.py: max(40M, 1M x the DP group))
DDP_DEFAULTS = {"overlap_grad_reduce": False, "overlap_param_gather": False, "align_param_gather": False,
                "bucket_size": None}


def bridge_ddp(recipe: str, ov: dict, dp: int) -> dict:
    """The DDP overlap fields after Bridge v0.3.1 / v0.6.0 merges the YAML over ``recipe``: the YAML's ``ddp``
    (the recipes' own ddp fields are all in it), then, with a comm_overlap section, the distributed optimizer and
    dp > 1, ``_get_optimizer_overlap_cfgs`` (comm_overlap.py:527-548): both overlaps on, bucket 128 Mi, the
    parameter all-gather aligned with virtual stages, each replaced by what the section states."""
    ddp = {**DDP_DEFAULTS, **{k: v for k, v in ov["ddp"].items() if k in DDP_DEFAULTS}}
    if SECTIONS.get(recipe, {"hybrid": True}) is None or not ov["ddp"]["use_distributed_optimizer"] or dp == 1:
        return ddp
    vpp = ov["model"].get("virtual_pipeline_model_parallel_size") or 1
    rule = {"bucket_size": 128 * 1024 * 1024, "overlap_grad_reduce": True, "overlap_param_gather": True,
            "align_param_gather": ov["model"]["pipeline_model_parallel_size"] > 1 and vpp > 1}
    user = {**(SECTIONS.get(recipe) or {}), **ov.get("comm_overlap", {})}
    return {**ddp, **rule, **{k: v for k, v in user.items() if k in rule and v is not None}}


@pytest.mark.parametrize("model", [None, "llama3-70b", "llama2-7b"])
@pytest.mark.parametrize("name", ["gpt-pp4-vpp2-sp", "llama-pp4-vpp2-first-last", "tiny-llama-gqa-selective",
                                  "gpt-cp2-sp-distopt", "llama-pp2-layout-embedding-only"])
def test_a_comm_overlap_section_keeps_the_dp_overlaps_priced(name, model):
    """The GPT, llama2_7b and llama3_70b recipes (and every Nemotron-H one) have a comm_overlap section, whose DP
    defaults Bridge writes over the YAML's ddp fields with the distributed optimizer: the section states the plan's
    overlaps, the alignment and the bucket size priced (the export header's settings, names.written_settings)."""
    from search.megatron.bridge_hybrid import BRIDGE_CORE
    from search.megatron.names import written_settings
    c = case_config(name)
    if model is not None:
        if c.model.activation != "swiglu":
            pytest.skip("a GELU model runs from the GPT recipe")
        c = _with_model(c, model)
    for dist_opt, overlap in ((True, True), (True, False), (False, False)):
        c2 = dataclasses.replace(c, settings=c.settings.model_copy(update={
            "distributed_optimizer": dist_opt, "overlap_grad_reduce": overlap, "overlap_param_gather": overlap}))
        recipe, ov = overrides(c2)
        runs = bridge_ddp(recipe, ov, c2.dp)
        priced = run_settings(written_settings(c2, "megatron-bridge", BRIDGE_CORE), c2.precision)
        assert (runs["overlap_grad_reduce"], runs["overlap_param_gather"]) == (overlap, overlap), (recipe, runs)
        assert runs["align_param_gather"] == priced.align_param_gather, (recipe, runs)
        if overlap and c2.dp > 1:    # without the overlap megatron-core keeps one bucket whatever is given
            assert runs["bucket_size"] in (None, max(priced.bucket_params, 1_000_000 * c2.dp)), (recipe, runs)
            if SECTIONS[recipe] is not None:
                assert runs["bucket_size"] == max(priced.bucket_params, 1_000_000 * c2.dp)


def test_a_hybrid_recipes_section_states_the_dp_overlaps():
    """Nemotron-H recipes hold a comm_overlap section (v0.3.1 nemotronh.py; v0.6.0's too): the YAML of a plan
    without overlapped gradient reduction runs without it."""
    from search.megatron.bridge_hybrid import overrides as hybrid_overrides
    from search.settings.plan_settings import PlanSettings
    from tests.hybrid_plans import MAMBA8, cut_plan
    plan = cut_plan(MAMBA8, [0, MAMBA8.num_units], 1, dp=4, gbs=16,
                    settings=PlanSettings(framework="megatron-bridge", release="0.16", distributed_optimizer=True))
    assert not plan.settings.overlap_grad_reduce
    recipe, c, ov = hybrid_overrides(plan)
    runs = bridge_ddp(recipe, ov, 4)
    assert (runs["overlap_grad_reduce"], runs["overlap_param_gather"], runs["align_param_gather"]) == \
        (False, False, False)
