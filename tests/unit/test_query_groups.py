"""tp above the query groups (megatron-core's rule: groups a multiple or a divisor of tp): plans validate, the
search offers such tp, and the analytic model prices the QKV output's all-gather, one K/V group per rank and the
attention core of heads / tp queries, each against a hand computation."""

import json

import pytest

from search.cli import main
from search.costmodel.analytic import AnalyticSource
from search.costmodel.comm import ALPHA_INTRA_MS, CommModel
from search.costmodel.memory import attention_act_bytes
from search.costmodel.types import RunSettings
from search.planner.space import Space
from search.spec.cluster import parse_cluster
from search.spec.plan import parse_plan
from search.spec.presets import load_model
from search.spec.training import TrainingSpec

CLUSTER = parse_cluster("1x8-h100")
S, B = 2048, 1


def gqa(groups: int, **update):
    """GPT-350M (16 heads of 64, hidden 1024) with ``groups`` query groups."""
    return load_model("gpt-350m").model_copy(update={"num_query_groups": groups, "params_dtype": "bf16", **update})


def plan_dict(model, tps: list[int]) -> dict:
    n = model.num_units // len(tps)
    stages = [dict(num_gpus=8 // len(tps), tp=t, dp=8 // len(tps) // t, start_unit=i * n, end_unit=(i + 1) * n,
                   recompute=["none"] * n) for i, t in enumerate(tps)]
    return dict(model=model.model_dump(), cluster=CLUSTER.model_dump(), micro_batch_size=1, global_batch_size=16,
                stages=stages)


def test_tp_above_groups_validates(tmp_path, capsys):
    """Megatron-Bridge's Nemotron-3 Nano shape: tp 4 with 2 query groups (and tp 8 with 2) is a valid plan."""
    plan = parse_plan(plan_dict(gqa(2), [4, 4]))
    assert [s.tp for s in plan.stages] == [4, 4]
    path = tmp_path / "p.json"
    path.write_text(json.dumps(plan_dict(gqa(2), [8])))
    assert main(["validate", str(path)]) == 0, capsys.readouterr().err


def test_tp_neither_multiple_nor_divisor_refused(tmp_path, capsys):
    """tp 3 with 2 groups (6 heads, FFN 3072: both split by 3): one line naming the field and megatron-core's
    rule, exit 2."""
    model = gqa(2, num_attention_heads=6, kv_channels=64, ffn_hidden_size=3072)
    d = plan_dict(model, [1])
    d["stages"] = [dict(num_gpus=3, tp=3, dp=1, start_unit=0, end_unit=24, recompute=["none"] * 24),
                   dict(num_gpus=5, tp=1, dp=5, start_unit=24, end_unit=48, recompute=["none"] * 24)]
    d["global_batch_size"] = 15
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(d))
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert ("stages[0].tp (3) and num_query_groups (2): megatron-core needs num_query_groups to be a multiple or a "
            "divisor of tensor_model_parallel_size") in err, err


def test_search_offers_tp_above_groups():
    """The search space's tp: powers of two within the node dividing the heads and FFN and dividing the groups
    or a multiple of them: 1 query group (MQA) allows 1 2 4 8, like 16 groups."""
    training = TrainingSpec(global_batch_size=16, micro_batch_sizes=[1])
    assert list(Space.of(gqa(1), CLUSTER, training).tps) == [1, 2, 4, 8]
    assert list(Space.of(gqa(2), CLUSTER, training).tps) == [1, 2, 4, 8]


def _source(model, settings=None):
    return AnalyticSource(model, CLUSTER, TrainingSpec(global_batch_size=16, micro_batch_sizes=[1]),
                          CommModel(CLUSTER), settings=settings or RunSettings(overlap_tp_dgrad=False))


def test_qkv_all_gather_priced():
    """tp 4, 2 groups: the QKV output (16 + 2*2 heads of 64, s b tokens, 2 bytes) all-gathered over 4 ranks
    forward and reduce-scattered backward, each a ring of 3 steps: 3 alpha + 3/4 X / NVLink bandwidth, on top of
    the TP collectives the same unit has with 4 groups (one per rank: the same GEMM input, no gather)."""
    x = 2.0 * S * B * (16 + 2 * 2) * 64
    ring = 3 * ALPHA_INTRA_MS + 0.75 * x / (CommModel(CLUSTER).intra_gbps * 1e6)
    two, four = _source(gqa(2)).attention(B, S, 4), _source(gqa(4)).attention(B, S, 4)
    assert two.tp_comm - four.tp_comm == pytest.approx(2 * ring)
    assert two.comm_fwd[0] - four.comm_fwd[0] == pytest.approx(ring)
    # tp 2 with 2 groups (one per rank, no gather) prices no gather
    assert _source(gqa(2))._qkv_gather(B, S, 2) == (0.0, 0.0)


def test_one_kv_group_per_rank_memory():
    """Bytes kept by one attention unit at tp 4 with 2 groups, flash, no SP (Korthikanti's split): norm + QKV
    input 2*2 sbh and the 1-byte dropout mask sbh, replicated; Q of heads/tp, K and V of one group (not 2/4 of
    one), the projection input; the fp32 log-sum-exp 4 (heads/tp) s b."""
    m, t, dt, q, hd = gqa(2), 4, 2.0, 16 * 64, 64
    sbh = S * B * 1024
    hand = (2 * dt * sbh + sbh) + dt * B * (S * q / t + 2 * S * hd) + dt * S * B * q / t + 4.0 * 16 * S * B / t
    assert attention_act_bytes(m, B, S, t, flash=True, dt=dt)[0] == pytest.approx(hand)


def test_core_flops_heads_over_tp():
    """The attention core at tp 4 with 2 groups: heads/tp = 4 queries per rank, each against its group's K/V,
    causal half of 4 s^2 b (heads/tp) d FLOPs, the same as with 16 groups."""
    src = _source(gqa(2))
    f = 0.5 * 4.0 * S * S * B * (16 / 4) * 64
    want = src.kern.flash(f, S, 64, True)
    assert src._core(B, S, S, 4, True)[0] == pytest.approx(want)
    assert src._core(B, S, S, 4, True)[0] == pytest.approx(_source(gqa(16))._core(B, S, S, 4, True)[0])
