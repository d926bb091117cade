"""Plan contract v3 (search/settings/moe_plan.py): each stage's expert shape (etp x ep x edp folded over the stage's
tp x cp x dp GPUs) and the plan's MoE settings, checked against megatron-core 0.16.1's rules with one line each;
dense plans are written as before."""

import json

import pytest

from search.io.errors import AcesoError
from search.settings.moe_plan import MoEPlanSettings, expert_dp, expert_tp
from search.spec.plan import SCHEMA_VERSION, parse_plan
from search.spec.presets import load_model


def moe_model(**moe):
    """Mixtral's layer cut to 4 layers (8 experts, top-2, no biases)."""
    m = load_model("mixtral-8x7b")
    return m.model_copy(update={"num_layers": 4, "moe": m.moe.model_copy(update=moe)} if moe else
                        {"num_layers": 4})


def plan_dict(model, stages, **extra):
    return dict(schema_version=3, model=model.model_dump(), micro_batch_size=16, global_batch_size=64,
                stages=stages, **extra)


def stage(units, tp=1, dp=8, cp=1, **kw):
    return dict(num_gpus=tp * cp * dp, tp=tp, cp=cp, dp=dp, sequence_parallel=tp > 1,
                chunks=[dict(start_unit=units[0], end_unit=units[1], recompute=["none"] * (units[1] - units[0]))],
                **kw)


def test_expert_shape_folds_over_the_stage():
    m = moe_model()
    plan = parse_plan(plan_dict(m, [stage((0, 4), tp=2, dp=4, ep=4, etp=1), stage((4, 8), tp=1, dp=4, ep=2)]))
    s0, s1 = plan.stages
    # etp x ep x edp = tp x cp x dp (megatron-core's parallel_state: edp = world / (etp * ep * pp))
    assert (expert_tp(s0), s0.ep, expert_dp(s0)) == (1, 4, 2)
    assert (expert_tp(s1), s1.ep, expert_dp(s1)) == (1, 2, 2)   # etp None = the stage's tp
    assert s0.shape_text == "tp2 dp4 sp ep4 etp1"
    back = parse_plan(json.loads(plan.to_json()))
    assert back == plan and back.schema_version == SCHEMA_VERSION


def test_dense_stages_are_written_without_expert_keys():
    m = load_model("gpt-350m")
    n = m.num_units
    plan = parse_plan(dict(schema_version=2, model=m.model_dump(), micro_batch_size=2, global_batch_size=8,
                           stages=[stage((0, n), dp=2)]))
    raw = json.loads(plan.to_json())
    assert plan.schema_version == SCHEMA_VERSION and "ep" not in raw["stages"][0] and "etp" not in raw["stages"][0]
    assert "moe" not in raw and "moe" not in raw["settings"]


@pytest.mark.parametrize("stages,extra,needle", [
    ([stage((0, 8), dp=6, ep=4)], {}, "etp (1) x ep (4) must divide the stage's num_gpus (6)"),
    ([stage((0, 8), dp=8, ep=8, etp=2)], {}, "etp (2) x ep (8) must divide"),
    ([stage((0, 8), dp=16, ep=16)], {}, "stages[0].ep (16) must divide num_experts (8)"),
    ([stage((0, 8), dp=8, ep=2)], {"moe": {"token_dispatcher": "allgather", "shared_expert_overlap": True}},
     "works with the alltoall dispatcher in megatron-core 0.17 (it is allgather)"),
    ([stage((0, 8), dp=8, ep=1)], {"moe": {"overlap_ep_comm": True}}, "needs ep > 1"),
    ([stage((0, 8), dp=8, ep=2)], {"moe": {"overlap_ep_comm": True, "token_dispatcher": "allgather"}},
     "alltoall or flex"),
    ([stage((0, 4), dp=4, ep=2), stage((4, 8), dp=4, ep=2)], {"moe": {"overlap_ep_comm": True}},
     "needs virtual chunks"),
])
def test_folding_rules_are_one_line_each(stages, extra, needle):
    raw = plan_dict(moe_model(), stages, **extra)
    with pytest.raises(AcesoError) as e:
        parse_plan(raw)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_tp_without_sp_is_refused():
    raw = plan_dict(moe_model(), [stage((0, 8), tp=2, dp=4, ep=2)])
    raw["stages"][0]["sequence_parallel"] = False
    with pytest.raises(AcesoError, match="tp \\(2\\) on an MoE model needs sequence_parallel"):
        parse_plan(raw)


def test_etp_must_split_the_expert_width_and_biases_need_etp_1():
    m = moe_model(moe_ffn_hidden_size=14336 + 4)     # 14340 = 4 * 3585: etp 8 does not divide it
    with pytest.raises(AcesoError, match="etp \\(8\\) must divide moe_ffn_hidden_size \\(14340\\)"):
        parse_plan(plan_dict(m, [stage((0, 8), dp=8, ep=1, etp=8)]))
    biased = moe_model().model_copy(update={"add_bias_linear": True})
    with pytest.raises(AcesoError, match="biases only with etp 1"):
        parse_plan(plan_dict(biased, [stage((0, 8), dp=8, ep=2, etp=2)]))


def test_dense_model_refuses_expert_fields():
    m = load_model("gpt-350m")
    n = m.num_units
    with pytest.raises(AcesoError, match="has no experts; use ep 1 and no etp"):
        parse_plan(plan_dict(m, [stage((0, n), dp=2, ep=2)]))
    with pytest.raises(AcesoError, match="remove the plan's moe block"):
        parse_plan(plan_dict(m, [stage((0, n), dp=2)], moe={"token_dispatcher": "alltoall"}))


def test_settings_default():
    s = MoEPlanSettings()
    assert (s.token_dispatcher, s.grouped_gemm, s.shared_expert_overlap, s.overlap_ep_comm) == \
        ("alltoall", True, False, False)


@pytest.mark.parametrize("release, flex_ok", [(None, False), ("26.02.01", False), ("26.04.01", False),
                                              ("core_v0.17.1", False), ("0.18", True), ("0.19", True),
                                              ("core_v0.19.0", True)])
def test_shared_expert_overlap_with_flex_follows_the_release(release, flex_ok):
    """megatron-core's ``TransformerConfig.__post_init__``: core_v0.16.1 and core_v0.17.1 raise
    "moe_shared_expert_overlap only works with alltoall token dispatcher", core_v0.18.2 and core_v0.19.0 take
    alltoall or flex (the checkouts' transformer_config.py). A container runs the megatron-core it ships (26.04.01:
    0.17.0; None: the newest container). Before, flex was refused whatever the release."""
    m = moe_model(moe_shared_expert_intermediate_size=1024)
    st = [stage((0, 8), dp=8, ep=2)]
    flex = {"token_dispatcher": "flex", "shared_expert_overlap": True}
    raw = plan_dict(m, st, settings={"release": release, "moe": flex})
    if flex_ok:
        assert parse_plan(raw).moe.shared_expert_overlap
    else:
        with pytest.raises(AcesoError, match="works with the alltoall dispatcher in megatron-core 0.1[67]"):
            parse_plan(raw)
    # alltoall runs it everywhere; allgather nowhere; never beside the EP overlap
    assert parse_plan(plan_dict(m, st, settings={"release": release, "moe": {**flex, "token_dispatcher":
                                                                              "alltoall"}})).moe.shared_expert_overlap
    for bad, needle in (({"token_dispatcher": "allgather"}, "(it is allgather)"),
                        ({"overlap_ep_comm": True, "token_dispatcher": "alltoall"}, "with moe.overlap_ep_comm")):
        with pytest.raises(AcesoError) as e:
            parse_plan(plan_dict(m, st, settings={"release": release, "moe": {**flex, **bad}}))
        assert needle in str(e.value) and "\n" not in str(e.value)


def test_a_flex_shared_overlap_refused_at_an_older_core_names_the_release_to_state(capsys):
    """A Megatron-LM line with the shared-expert overlap on flex, read without --megatron-version, is priced as the
    newest container (megatron-core 0.17: alltoall only, TransformerConfig of core_v0.17.1); the refusal says how to
    state a release that runs it, and that release then prices it."""
    from search.cli import main
    line = ("--num-layers 4 --hidden-size 512 --num-attention-heads 8 --seq-length 1024 --max-position-embeddings 1024 "
            "--micro-batch-size 1 --global-batch-size 8 --num-experts 8 --moe-router-topk 2 "
            "--moe-shared-expert-intermediate-size 512 --moe-shared-expert-overlap --moe-token-dispatcher-type flex "
            "--moe-flex-dispatcher-backend deepep --expert-model-parallel-size 2 --bf16 --swiglu "
            "--ffn-hidden-size 1024 --moe-ffn-hidden-size 256 --moe-grouped-gemm")
    base = ["explain", "--megatron-args", line, "--vocab-size", "32000", "--cluster", "1x8-h100",
            "--search-budget-evals", "0"]
    assert main(base) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "moe.shared_expert_overlap" in err[0] and "--megatron-version 0.19" in err[0]
    assert main(base + ["--megatron-version", "0.19"]) == 0
