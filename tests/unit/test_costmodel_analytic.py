"""Analytic cost model: hand-computed cases and properties that must hold for any plan.

The hand-computed cases of the v1 roofline use the v1 kernel model (``kernels="flat"``) and ``LEGACY_V1`` settings,
which the v2 model keeps selectable; the shape-aware kernels and the v2 refinements have their own hand-computed
cases in test_costmodel_v2.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from search.spec.cluster import parse_cluster
from search.costmodel import LEGACY_V1, RC_CODE
from search.pricing import make_cost_model
from search.io.errors import AcesoError
from search.spec.model import ModelSpec
from search.spec.plan import ParallelPlan, StageSpec
from search.spec.presets import load_model
from search.spec.training import TrainingSpec

MB = 2.0**20
TINY = ModelSpec(name="tiny", family="gpt", num_layers=1, hidden_size=1024, num_attention_heads=16,
                 ffn_hidden_size=4096, seq_length=512, vocab_size=1024, params_dtype="fp16",
                 attention_dropout=0.1, hidden_dropout=0.1)   # Korthikanti et al. count dropout masks


def _plan(model, cluster, stages, mbs, gbs, **kw):
    specs = [StageSpec(num_gpus=tp * dp, tp=tp, dp=dp, start_unit=a, end_unit=b,
                       recompute=[rc] * (b - a) if isinstance(rc, str) else rc)
             for (a, b, tp, dp, rc) in stages]
    return ParallelPlan(model=model, cluster=cluster, micro_batch_size=mbs, global_batch_size=gbs, stages=specs, **kw)


def _cm(model, cluster, gbs=4, v1=False, **kw):
    extra = {"settings": LEGACY_V1, "kernels": "flat"} if v1 else {}
    return make_cost_model(model, cluster, TrainingSpec(global_batch_size=gbs, precision="fp16", **kw), **extra)


# ----- hand-computed -------------------------------------------------------------------------------------------------
def test_mlp_unit_forward_by_hand():
    """V100, fp16, b=1, s=512, h=1024, f=4096, tp=1: three kernels of the v1 roofline, by hand."""
    cm = _cm(TINY, parse_cluster("1x1-v100"), v1=True)
    t = cm.unit_table(1, 1)
    flops_rate = 125e12 * 0.65 / 1e3            # FLOP per ms at the V100 GEMM efficiency
    bytes_rate = 900e9 * 0.80 / 1e3             # bytes per ms at the memory efficiency
    gemm = 2 * 512 * 1024 * (4096 + 4096) / flops_rate
    elementwise = (2 * 2 + 3 * 2 + 1) * 512 * 1024 / bytes_rate   # layernorm + bias-dropout-add
    gelu = 2 * 2 * 512 * 4096 / bytes_rate
    assert t.fwd_ms[1] == pytest.approx(gemm + elementwise + gelu + 3 * 0.005, rel=1e-9)
    # backward: GEMMs twice the FLOPs, element-wise 1.5x the bytes
    bwd = 2 * gemm + 1.5 * (elementwise + gelu) + 2 * 0.005
    assert t.bwd_ms[1] == pytest.approx(bwd, rel=1e-9)


def test_one_layer_one_stage_memory_by_hand():
    """Korthikanti et al. 34sbh + 5as^2b per layer, with megatron-core's fp32 softmax output (+2as^2b: unfused, the
    softmax keeps 4 bytes per score, not 2), 16 B/param, embedding mask and fp32 logits, reserve."""
    c = parse_cluster("1x1-v100")
    cm = _cm(TINY, c)
    cost = cm.evaluate(_plan(TINY, c, [(0, 2, 1, 1, "none")], mbs=1, gbs=4))
    s, b, h, a, v = 512, 1, 1024, 16, 1024
    layer = 34 * s * b * h + (5 + 2) * a * s * s * b
    embed = s * b * h                                  # dropout mask
    head = 2 * 2 * s * b * h + 4 * s * b * v           # final-norm + logits inputs, fp32 softmax
    acts = (layer + embed + head) / MB * 1.05
    mem = cost.stages[0].memory_breakdown
    assert mem["activations"] == pytest.approx(acts, rel=1e-9)
    n = TINY.num_parameters
    assert mem["params"] + mem["grads"] + mem["optimizer"] == pytest.approx(16 * n / MB, rel=1e-9)
    # the loss's peak beyond the fp32 softmax it keeps (in ``head``): the fp16 logits beside it in forward, their
    # gradient's fp16 cast in backward (measured: tests/runtime/test_loss_memory.py)
    loss_transient = 2 * s * b * v / MB
    assert mem["recompute_peak"] == pytest.approx(loss_transient, rel=1e-9)
    # the optimizer step's fp32 copy of the fp16 gradients (4 B / param) lives after the activations are freed:
    # here it is the larger of the two (54.1 MiB against 53.0)
    copy = 4 * n / MB
    assert copy > acts + loss_transient
    assert mem["grad_copy"] == pytest.approx(copy - acts - loss_transient, rel=1e-9)
    assert cost.stages[0].memory_mb == pytest.approx(16 * n / MB + max(acts + loss_transient, copy) + 1024.0,
                                                     rel=1e-9)


def test_two_stage_plan_follows_1f1b_by_hand():
    """Iteration = the 1F1B critical path over the stages' own numbers (formula in pipeline.py)."""
    m = load_model("gpt-350m")
    c = parse_cluster("1x2-a100")
    cm = _cm(m, c, gbs=8)
    half = m.num_units // 2
    cost = cm.evaluate(_plan(m, c, [(0, half, 1, 1, "none"), (half, m.num_units, 1, 1, "full")], mbs=2, gbs=8))
    s0, s1 = cost.stages
    f0, f1 = s0.fwd_ms + s0.p2p_ms / 2, s1.fwd_ms + s1.p2p_ms / 2
    b0, b1 = s0.bwd_ms + s0.recompute_ms + s0.p2p_ms / 2, s1.bwd_ms + s1.recompute_ms + s1.p2p_ms / 2
    m_ = 4
    end0 = m_ * (f0 + b0) + max(0, f1 + b1 - f0) + max(0, f1 + b1 - b0)
    end1 = f0 + m_ * (f1 + b1)
    sync0, sync1 = s0.dp_sync_ms + s0.optimizer_ms, s1.dp_sync_ms + s1.optimizer_ms
    expected = max(end0 + sync0, end1 + b0 + sync1, max(end0, end1 + b0) + sync0)
    assert cost.iteration_ms == pytest.approx(expected, rel=1e-12)
    assert s1.recompute_ms == pytest.approx(s1.fwd_ms - cm.unit_table(2, 1).head_fwd_ms, rel=1e-9)
    # the boundary: 2 bytes x s x b x h each way, counted by both stages
    assert s0.p2p_ms == s1.p2p_ms > 0


# ----- properties ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("gpu", ["v100", "a100", "h100"])
def test_more_recompute_never_raises_memory_nor_lowers_time(gpu):
    m = load_model("gpt-1.3b")
    cm = _cm(m, parse_cluster(f"1x8-{gpu}"), gbs=64)
    rng = np.random.default_rng(0)
    for _ in range(30):
        k, n = int(rng.integers(0, 4)), int(rng.integers(1, 4)) * 2
        a = int(rng.integers(0, m.num_units - n))
        tp, dp = [(1, 2), (2, 1), (2, 2), (4, 1)][int(rng.integers(0, 4))]
        rc = rng.integers(0, 3, size=n).astype(np.int8)
        u = int(rng.integers(0, n))
        if rc[u] == 2:
            continue
        more = rc.copy()
        more[u] += 1
        args = (k, 4, 0, a, a + n, tp, dp)
        lo, hi = cm.stage_cost(*args, rc, 4), cm.stage_cost(*args, more, 4)
        assert hi.memory_mb <= lo.memory_mb + 1e-9
        assert hi.time_per_microbatch_ms >= lo.time_per_microbatch_ms - 1e-12


def test_doubling_dp_halves_per_rank_compute_and_adds_all_reduce():
    m = load_model("gpt-1.3b")
    c = parse_cluster("1x8-a100")
    cm = _cm(m, c, gbs=64)
    rc = np.zeros(8, dtype=np.int8)
    one = cm.stage_cost(1, 3, 0, 8, 16, 2, 1, rc, 8)
    two = cm.stage_cost(1, 3, 0, 8, 16, 2, 2, rc, 8)
    # half the tokens per rank: half the time up to the GEMMs' shape efficiency and the fixed launch costs
    assert one.fwd_ms / 2 < two.fwd_ms < 1.05 * one.fwd_ms / 2
    assert one.bwd_ms / 2 < two.bwd_ms < 1.05 * one.bwd_ms / 2
    assert one.dp_sync_ms == 0.0
    params = sum(m.unit_params(u.kind) for u in m.units[8:16])
    replicated = 8 * 3 * m.hidden_size          # per unit: layernorm (2h) + the row-parallel output bias (h)
    per_rank_bytes = 2 * ((params - replicated) / 2 + replicated)
    ring = 2 * 1 * 0.003 + 2 * (2 - 1) / 2 * per_rank_bytes / (300 * 0.8 * 1e6)
    assert two.dp_sync_ms == pytest.approx(ring, rel=1e-6)


def test_plan_that_does_not_fit_names_the_stage_and_shortfall():
    m = load_model("gpt-2.6b")
    c = parse_cluster("1x4-v100")
    cm = _cm(m, c, gbs=64)
    q = m.num_units // 4
    plan = _plan(m, c, [(i * q, (i + 1) * q, 1, 1, "none") for i in range(4)], mbs=8, gbs=64)
    cost = cm.evaluate(plan)
    assert not cost.fits
    assert cost.bottleneck_resource == "memory"
    worst = max(range(4), key=lambda i: cost.stages[i].memory_mb)
    assert cost.bottleneck_stage == worst == 0      # the first stage holds the most in-flight micro-batches
    short = cost.stages[0].memory_mb - cm.memory_limit_mb
    assert short > 0
    assert any(w.startswith("stage 0 needs") and f"{short:.0f} MiB over" in w for w in cost.warnings)
    cheap = cm.evaluate(_plan(m, c, [(i * q, (i + 1) * q, 1, 1, "full") for i in range(4)], mbs=1, gbs=64))
    assert cheap.fits and cheap.bottleneck_resource != "memory"


def test_ideal_time_is_the_single_gpu_work_per_gpu():
    m = load_model("gpt-1.3b")
    cm = _cm(m, parse_cluster("1x8-a100"), gbs=64)
    rc = np.zeros(10, dtype=np.int8)
    solo = cm.stage_cost(1, 3, 0, 10, 20, 1, 1, rc, 4)
    assert solo.ideal_ms == pytest.approx(solo.fwd_ms + solo.bwd_ms)
    wide = cm.stage_cost(1, 3, 0, 10, 20, 2, 2, rc, 4)
    assert wide.ideal_ms == pytest.approx(solo.ideal_ms / 4)
    assert wide.fwd_ms + wide.bwd_ms > wide.ideal_ms        # TP collectives and replicated kernels cost extra


def test_tp_splits_compute_and_adds_collectives():
    m = load_model("gpt-13b")
    cm = _cm(m, parse_cluster("1x8-h100"), gbs=64)
    t1, t4 = cm.unit_table(2, 1), cm.unit_table(2, 4)
    assert (t4.tp_comm_ms > 0).all() and (t1.tp_comm_ms == 0).all()
    ar = cm.comm.all_reduce(2 * 2048 * 2 * m.hidden_size, 4)          # the forward's one all-reduce per unit
    compute4 = t4.fwd_ms - ar
    # GEMMs and attention split 4 ways; norms and bias-dropout-add stay replicated (no sequence parallelism)
    assert (compute4 > t1.fwd_ms / 4).all() and (compute4 < 1.3 * t1.fwd_ms / 4).all()
    assert t4.weight_params.sum() == pytest.approx(t1.weight_params.sum() / 4, rel=0.01)


def test_resharding_and_inter_node_boundaries_cost_more():
    """The v1 boundary formula (every transfer blocking; v2's batched steady state: test_costmodel_v2.py)."""
    m = load_model("gpt-1.3b")
    c = parse_cluster("2x4-a100")
    cm = _cm(m, c, gbs=64, v1=True)
    rc = np.zeros(24, dtype=np.int8)
    same = cm.stage_cost(1, 2, 4, 24, 48, 2, 2, rc, 4, prev=(2, 2))
    fan_in = cm.stage_cost(1, 2, 4, 24, 48, 2, 2, rc, 4, prev=(4, 1))
    assert fan_in.p2p_ms == same.p2p_ms      # tp 4 -> tp 2: each receiver still needs the same bytes
    fan_out = cm.stage_cost(0, 2, 0, 0, 24, 1, 4, rc, 4, next=(4, 1))
    plain = cm.stage_cost(0, 2, 0, 0, 24, 1, 4, rc, 4)
    # dp 4 -> tp 4: each of the 4 receivers needs the whole micro-batch, each sender holds a quarter of it
    # (the next stage's ranks 4-7 sit on the second node: the network link)
    quarter = 2 * 2048 * 1 * 2048
    assert plain.p2p_ms == pytest.approx(2 * (0.010 + quarter / (25 * 0.8 * 1e6)))
    assert fan_out.p2p_ms == pytest.approx(2 * (0.010 + 4 * quarter / (25 * 0.8 * 1e6)))
    intra = cm.stage_cost(1, 2, 2, 24, 48, 1, 2, rc, 4, prev=(1, 2))  # last stage: ranks 0-1 -> 2-3, one node
    inter = cm.stage_cost(1, 2, 4, 24, 48, 1, 2, rc, 4, prev=(1, 2))  # ranks 2-3 -> 4-5 span two nodes
    x = 2 * 2048 * 2 * 2048                                            # bytes per rank: dt * s * (4/2) * h
    assert intra.p2p_ms == pytest.approx(2 * (0.003 + x / (300 * 0.8 * 1e6)))
    assert inter.p2p_ms == pytest.approx(2 * (0.010 + x / (25 * 0.8 * 1e6)))


def test_distributed_optimizer_shards_optimizer_states():
    m = load_model("gpt-1.3b")
    c = parse_cluster("1x8-a100")
    rc = np.zeros(48, dtype=np.int8)
    plain = _cm(m, c, gbs=64).stage_cost(0, 1, 0, 0, 48, 1, 8, rc, 8)
    dist = _cm(m, c, gbs=64, distributed_optimizer=True).stage_cost(0, 1, 0, 0, 48, 1, 8, rc, 8)
    assert dist.memory_breakdown["optimizer"] == pytest.approx(plain.memory_breakdown["optimizer"] / 8)
    assert dist.memory_breakdown["params"] == plain.memory_breakdown["params"]
    # the step: Adam on a 1/8 shard, then the parameter all-gather (megatron runs it after the step)
    params = sum(m.unit_params(u.kind) for u in m.units) + m.embedding_params() + m.output_params()
    ag = cm_gather = _cm(m, c, gbs=64).comm.all_gather(2 * params, 8)
    assert dist.optimizer_ms == pytest.approx(plain.optimizer_ms / 8 + ag, rel=1e-3)
    assert dist.comm["param_gather"] == (pytest.approx(ag, rel=1e-3), 0.0) and cm_gather > 0


def test_stage_cost_matches_evaluate_and_is_deterministic():
    m = load_model("llama3-8b")
    c = parse_cluster("2x8-h100")
    cm = make_cost_model(m, c, TrainingSpec(global_batch_size=128))
    n = m.num_units // 2
    plan = _plan(m, c, [(0, n, 2, 4, "selective"), (n, m.num_units, 4, 2, "none")], mbs=4, gbs=128)
    cost = cm.evaluate(plan)
    rc = [np.full(n, RC_CODE["selective"], np.int8), np.zeros(n, np.int8)]
    manual = [cm.stage_cost(0, 2, 0, 0, n, 2, 4, rc[0], 4, next=(4, 2)),
              cm.stage_cost(1, 2, 8, n, 2 * n, 4, 2, rc[1], 4, prev=(2, 4))]
    pipe = cm.pipeline(manual, 32)
    assert pipe.iteration_ms == cost.iteration_ms == cm.evaluate(plan).iteration_ms
    assert 0 < cost.mfu < 1 and cost.tflops_per_gpu > 0
    assert cost.samples_per_s == pytest.approx(128 / (cost.iteration_ms / 1e3))


def test_t5_units_and_unknown_kind():
    m = load_model("t5-770m")
    cm = _cm(m, parse_cluster("1x4-v100"), gbs=16)
    t = cm.unit_table(1, 1)
    enc = m.num_encoder_units
    assert t.boundary_mb[enc + 1] > t.boundary_mb[enc]     # decoder boundaries also carry the encoder output
    assert t.fwd_ms.shape == (m.num_units,)
    with pytest.raises(AcesoError, match="choose one of"):
        make_cost_model(m, parse_cluster("1x4-v100"), TrainingSpec(global_batch_size=16), kind="magic")
