"""The v2 cost model: every new formula against a hand-computed case, the v1 numbers kept, and its properties.

References: megatron's per-layer activation formulas (Korthikanti et al. 2023, Table 2), the ring formulas of
comm.py, the interleaved schedule's textbook bubble (SC'21 2.2.2) and an independent event simulation written here,
and the golden per-stage numbers of the v1 model captured at commit d4a2738 (tests/unit/data).
"""

from __future__ import annotations

import json
import random
from math import ceil
from pathlib import Path

import numpy as np
import pytest

from search.spec.cluster import parse_cluster
from search.costmodel import LEGACY_V1, RunSettings
from search.pricing import make_cost_model
from search.costmodel.comm import ALPHA_INTER_MS, ALPHA_INTRA_MS, LINK_EFFICIENCY, NCCL_CTAS, overlapped
from search.costmodel.kernels import ARCH, LAUNCH_MS, MEM_EFF, ShapeKernels
from search.costmodel.memory import MB
from search.costmodel.pipeline import interleaved_one_f_one_b, one_f_one_b
from search.costmodel.types import Features
from search.costmodel.plan_view import run_settings
from search.settings.plan_settings import target_settings
from search.spec.model import ModelSpec
from search.spec.plan import SCHEMA_VERSION, parse_plan, uniform_plan
from search.spec.presets import load_model
from search.spec.training import TrainingSpec
from tests.unit.search_helpers import simulate_1f1b

GOLDEN = Path(__file__).parent / "data" / "costmodel_v1_golden.json"
TINY = ModelSpec(name="tiny", family="gpt", num_layers=2, hidden_size=1024, num_attention_heads=16,
                 ffn_hidden_size=4096, seq_length=2048, vocab_size=1024, params_dtype="bf16",
                 attention_dropout=0.1, hidden_dropout=0.1)


def _cm(model, cluster, gbs=64, settings=None, kernels="shape", **kw):
    return make_cost_model(model, cluster, TrainingSpec(global_batch_size=gbs, **kw), settings=settings,
                           kernels=kernels)


# ----- v1 plans: loaded, and priced exactly as before with the v2 refinements off --------------------------------
def _golden_cases():
    return json.loads(GOLDEN.read_text())["cases"]


def _v1_plan(case):
    raw = {"schema_version": 1, "model": load_model(case["model"]).model_dump(),
           "cluster": parse_cluster(case["cluster"]).model_dump(), "micro_batch_size": case["micro_batch_size"],
           "global_batch_size": case["global_batch_size"], "stages": case["stages"]}
    return parse_plan(json.loads(json.dumps(raw)))


def _v1_replicated_params_fixed(plan, i, want, cm):
    """The v1 numbers with one correction: v1 split the learned position embedding and the final norm(s) over TP;
    megatron-core keeps both whole on every TP rank (tests/runtime/test_param_counts.py builds them), so a stage
    holding them at tp t has ``(1 - 1/t)`` of them more, at the v1 state bytes per parameter."""
    m, st = plan.model, plan.stages[i]
    extra = 0.0
    if i == 0:
        extra += (m.embedding_params() - m.padded_vocab_size * m.hidden_size) * (1 - 1 / st.tp)
    if i == len(plan.stages) - 1:
        extra += m.hidden_size * (2 if m.normalization == "layernorm" else 1) * (2 if m.is_t5 else 1) * (1 - 1 / st.tp)
    if not extra:
        return want
    w, g, o = cm._w, cm._g, cm._opt / (st.dp if plan.distributed_optimizer else 1)
    mem = dict(want["memory_breakdown"])
    for k, b in (("params", w), ("grads", g), ("optimizer", o)):
        mem[k] += extra * b / MB
    return {**want, "memory_mb": want["memory_mb"] + extra * (w + g + o) / MB, "memory_breakdown": mem}


def _v1_loss_transient_fixed(plan, i, want, cm):
    """The v1 numbers with the loss transient corrected: v1 priced it (dt + 4) s b V / t on top of the fp32
    softmax the loss keeps; megatron-core's vocab-parallel cross-entropy peaks at dt s b V / t beside it (measured:
    tests/runtime/test_loss_memory.py). Where the last stage's recompute peak was v1's loss transient it is now the
    larger of dt s b V / t and the stage's largest unit peak (from the cost model's own unit table)."""
    if i != len(plan.stages) - 1:
        return want
    m, st = plan.model, plan.stages[i]
    dt, b = cm._w, plan.micro_batch_size // st.dp
    s = m.decoder_seq_length if m.is_t5 else m.seq_length
    sbv = s * b * m.padded_vocab_size / st.tp / MB
    old, new = (dt + 4) * sbv, (dt if dt < 4 else 0.0) * sbv
    peak = want["memory_breakdown"]["recompute_peak"]
    if peak != pytest.approx(old, rel=1e-12):
        return want
    from search.costmodel.types import RC_CODE
    t = cm.unit_table(b, st.tp)
    ch = st.chunks[0]
    units = max((t.peak_mb[ch.start_unit + k, RC_CODE[c]] for k, c in enumerate(ch.recompute)), default=0.0)
    fixed = max(units, new)
    mem = {**want["memory_breakdown"], "recompute_peak": fixed}
    return {**want, "memory_mb": want["memory_mb"] - peak + fixed, "memory_breakdown": mem}


@pytest.mark.parametrize("name", sorted(_golden_cases()))
def test_v1_plans_give_the_v1_numbers(name):
    """LEGACY_V1 + the flat kernels reproduce every per-stage number of the v1 model; the iteration is now the
    exact 1F1B schedule of those numbers (v1's closed form was a lower bound for unequal stages)."""
    case = _golden_cases()[name]
    plan = _v1_plan(case)
    assert plan.schema_version == SCHEMA_VERSION and plan.num_virtual_stages == 1 and not plan.tp_comm_overlap
    tr = dict(case["training"])
    if tr.get("distributed_optimizer"):      # v1 read it from the training spec; a v2 plan states it
        plan = plan.model_copy(update={"distributed_optimizer": True})
    cm = _cm(plan.model, plan.cluster, case["global_batch_size"], LEGACY_V1, "flat",
             micro_batch_sizes=[case["micro_batch_size"]], precision=case["precision"], **tr)
    cost = cm.evaluate(plan)
    for i, (want, got) in enumerate(zip(case["stages_expected"], cost.stages)):
        want = _v1_loss_transient_fixed(plan, i, _v1_replicated_params_fixed(plan, i, want, cm), cm)
        for f in ("fwd_ms", "bwd_ms", "recompute_ms", "p2p_ms", "memory_mb", "tp_comm_ms", "ideal_ms"):
            assert getattr(got, f) == pytest.approx(want[f], rel=1e-12, abs=1e-12), f
        # the distributed optimizer's all-gather moved from the sync into the step, where megatron runs it
        # (where the correction added parameters, sync and step are affine in them: between v1 and v1 x the ratio)
        v1, now = want["dp_sync_ms"] + want["optimizer_ms"], got.dp_sync_ms + got.optimizer_ms
        ratio = want["memory_breakdown"]["params"] / case["stages_expected"][i]["memory_breakdown"]["params"]
        assert v1 * (1 - 1e-12) <= now <= v1 * ratio * (1 + 1e-12)
        for k, v in want["memory_breakdown"].items():
            assert got.memory_breakdown[k] == pytest.approx(v, rel=1e-12)
    fwd = [s.fwd_ms + s.p2p_ms / 2 for s in cost.stages]
    bwd = [s.bwd_ms + s.recompute_ms + s.p2p_ms / 2 for s in cost.stages]
    sync = [s.dp_sync_ms + s.optimizer_ms for s in cost.stages]
    assert cost.iteration_ms == pytest.approx(simulate_1f1b(fwd, bwd, plan.num_micro_batches, sync), rel=1e-12)
    if len({(round(f, 9), round(b, 9)) for f, b in zip(fwd, bwd)}) == 1 or plan.num_micro_batches < plan.num_stages:
        v1_sync = sum(w["dp_sync_ms"] + w["optimizer_ms"] for w in case["stages_expected"])
        # where v1 was exact (the step of the parameters the correction added aside)
        assert cost.iteration_ms - sum(sync) == pytest.approx(case["v1_iteration_ms"] - v1_sync, rel=1e-9)


# ----- sequence parallelism: one layer's memory by hand --------------------------------------------------------------
@pytest.mark.parametrize("sp", [False, True])
def test_one_layer_activations_with_and_without_sp(sp):
    """Korthikanti et al. Table 2, per layer at 2 bytes: sbh (10 + 24/t) without SP, sbh 34/t with SP; with flash
    attention the 5as^2b/t term is the fp32 log-sum-exp, 4 a s b / t."""
    c = parse_cluster("1x8-h100")
    cm = _cm(TINY, c)
    t, s, b, h, a = 4, 2048, 2, 1024, 16
    table = cm.unit_table(b, t, sp=sp)
    layer = (table.act_mb[0, 0] + table.act_mb[1, 0]) * MB
    sbh = s * b * h
    want = (34 * sbh / t if sp else (10 + 24 / t) * sbh) + 4 * a * s * b / t
    assert layer == pytest.approx(want, rel=1e-12)
    # full recompute keeps only the unit inputs, sharded with SP
    assert (table.act_mb[0, 2] + table.act_mb[1, 2]) * MB == pytest.approx(2 * 2 * sbh / (t if sp else 1))
    # the boundary p2p carries the sequence-sharded activation
    assert table.boundary_mb[1] * MB == pytest.approx(2 * sbh / (t if sp else 1))


def test_sp_collectives_and_megatron_core_overlap_by_hand():
    """Per MLP half with SP: forward all-gather + reduce-scatter exposed; backward the row all-gather exposed, the
    re-gather behind the input-gradient GEMM and the reduce-scatter behind the weight-gradient GEMM (megatron-core),
    each hidden ms charging NCCL_CTAS/SMs to the GEMM."""
    c = parse_cluster("1x8-h100")
    cm = _cm(TINY, c)
    src, t, s, b, h, f = cm.source, 4, 2048, 2, 1024, 4096
    x = 2 * s * b * h
    bw = 450 * LINK_EFFICIENCY * 1e6
    ag = rs = (t - 1) * ALPHA_INTRA_MS + (t - 1) / t * x / bw
    _, dg, wg = src.kern.gemm_parts(s * b, f / t, h)           # fc1's input- and weight-gradient GEMMs
    tax = NCCL_CTAS / ARCH["h100"].sms
    mlp = src.mlp(b, s, t, sp=True)
    fwd_exp = ag + rs
    bwd_exp = ag + max(0.0, ag - dg) + max(0.0, rs - wg) + tax * (min(ag, dg) + min(rs, wg))
    assert mlp.tp_comm == pytest.approx(fwd_exp + bwd_exp, rel=1e-12)
    legacy = _cm(TINY, c, settings=RunSettings(overlap_tp_dgrad=False)).source.mlp(b, s, t, sp=True)
    assert legacy.tp_comm == pytest.approx(2 * ag + rs + ag + rs, rel=1e-12)   # all five exposed
    assert mlp.bwd - legacy.bwd == pytest.approx(bwd_exp - (2 * ag + rs), rel=1e-9)


# ----- context parallelism: one ring step by hand --------------------------------------------------------------------
def test_ring_attention_step_by_hand():
    """cp = 2 on one node: one exchange of this rank's K/V chunk (s/cp tokens) behind half the attention core;
    backward moves K, V, dK, dV. Across nodes (tp 8 x cp 2 > 8 GPUs) the exchange runs on the network."""
    m = load_model("llama3-8b")
    c = parse_cluster("2x8-h100")
    cm = _cm(m, c)
    src = cm.source
    b, t, cp, s = 1, 2, 2, m.seq_length // 2
    core_f, core_b, _ = src._core(b, s, s * cp, t, True, cp)
    chunk = 2 * 2 * s * b * m.groups * m.head_dim / t
    bw = 450 * LINK_EFFICIENCY * 1e6
    step_f, step_b = ALPHA_INTRA_MS + chunk / bw, ALPHA_INTRA_MS + 2 * chunk / bw
    tax = NCCL_CTAS / ARCH["h100"].sms
    ef, eb, hid = src._cp_ring(b, s, t, cp, core_f, core_b)
    assert ef == pytest.approx(max(0.0, step_f - core_f / cp) + tax * min(step_f, core_f / cp), rel=1e-12)
    assert eb == pytest.approx(max(0.0, step_b - core_b / cp) + tax * min(step_b, core_b / cp), rel=1e-12)
    assert hid == pytest.approx(min(step_f, core_f / cp) + min(step_b, core_b / cp), rel=1e-12)
    # the core: s/cp queries against all s keys, causal (half), in cp blocks
    flops = 4.0 * s * (s * cp) * b * m.num_attention_heads * m.head_dim / t / 2
    assert core_f == pytest.approx(src.kern.flash(flops, s, m.head_dim, True) + (cp - 1) * LAUNCH_MS, rel=1e-12)
    inter = src._cp_ring(b, s, 8, cp, core_f, core_b)            # tp 8 x cp 2 spans the two nodes
    bw_ib = 50 * LINK_EFFICIENCY * 1e6
    step_f_ib = ALPHA_INTER_MS + 2 * 2 * s * b * m.groups * m.head_dim / 8 / bw_ib
    assert inter[0] == pytest.approx(max(0.0, step_f_ib - core_f / cp) + tax * min(step_f_ib, core_f / cp))
    # a cp 2 stage's gradients are reduced over dp x cp
    st = cm.stage_cost(0, 1, 0, 0, m.num_units, 2, 2, np.zeros(m.num_units, np.int8), 2, cp=2)
    assert st.comm["dp"][0] > 0 and cm.stage_cost(0, 1, 0, 0, m.num_units, 2, 4, np.zeros(m.num_units, np.int8),
                                                    4).comm["dp"][0] == pytest.approx(st.comm["dp"][0], rel=0.05)


def test_batched_p2p_in_the_1f1b_steady_state():
    """A boundary's activation and gradient move together in the steady state (megatron-core's
    send_forward_recv_backward): per micro-batch, (p2p + unpaired) / 2 with the upstream stage's warm-up ops
    unpaired; LEGACY_V1 keeps every transfer blocking."""
    m = load_model("gpt-1.3b")
    c = parse_cluster("1x8-a100")
    rc = np.zeros(24, dtype=np.int8)
    M, S = 16, 4
    new = _cm(m, c).stage_cost(1, S, 2, 24, 48, 1, 2, rc, 4, num_micro_batches=M)
    old = _cm(m, c, settings=RunSettings(batched_p2p=False)).stage_cost(1, S, 2, 24, 48, 1, 2, rc, 4,
                                                                         num_micro_batches=M)
    one_way = old.p2p_ms / 4                  # both boundaries carry the same activation, both ways
    unpaired = 2 * one_way * (min(S - 1, M) + min(S - 2, M)) / M
    assert new.p2p_ms == pytest.approx((old.p2p_ms + unpaired) / 2, rel=1e-12)
    assert new.comm["p2p"][0] + new.comm["p2p"][1] == pytest.approx(M * old.p2p_ms, rel=1e-12)


# ----- kernels ------------------------------------------------------------------------------------------------------
def test_shape_gemm_by_hand():
    """One H100 GEMM: 128x256 tiles over 132 SMs, the MAMF ceiling times the sustained factor, launch cost."""
    k = ShapeKernels("h100", 989e9, 3350e6, 2.0)
    a = ARCH["h100"]
    m, n, kk = 4096, 2688, 7168
    tiles = ceil(m / 128) * ceil(n / 256)                         # 32 x 11 = 352
    eff = a.gemm_max * a.sustained * (m * n / (tiles * 128 * 256)) * tiles / (ceil(tiles / 132) * 132)
    want = 2 * m * n * kk / (989e9 * eff) + LAUNCH_MS
    assert k.gemm([(m, n, kk)]) == pytest.approx(want, rel=1e-12)
    # a tiny GEMM is memory bound (and split over k: 1 tile < 132 SMs)
    small = k.gemm([(64, 64, 4096)])
    split = min(132 // 1, 4096 // 256)
    nbytes = 2.0 * (64 * 4096 + 4096 * 64 + 64 * 64) + 4.0 * 64 * 64 * split
    eff_small = a.gemm_max * a.sustained * (64 * 64 / (128 * 256)) * split / 132
    assert small == pytest.approx(max(2 * 64 * 64 * 4096 / (989e9 * eff_small), nbytes / (3350e6 * MEM_EFF))
                                  + LAUNCH_MS, rel=1e-12)
    # backward: input- and weight-gradient GEMMs
    assert k.gemm([(m, n, kk)], backward=True) == pytest.approx(sum(k.gemm_parts(m, n, kk)[1:]), rel=1e-12)


def test_attention_efficiency_grows_with_sequence_and_head_dim():
    k = ShapeKernels("h100", 989e9, 3350e6, 2.0)
    a = ARCH["h100"]
    flops = 1e12
    for s in (512, 4096):
        want = flops / (989e9 * a.attn_fwd * a.sustained * s / (s + 390.0)) + LAUNCH_MS
        assert k.flash(flops, s, 128, True) == pytest.approx(want, rel=1e-12)
    assert k.flash(flops, 512, 128, True) > k.flash(flops, 8192, 128, True)
    assert k.flash(flops, 4096, 64, True) > k.flash(flops, 4096, 128, True) == k.flash(flops, 4096, 256, True)
    assert k.flash(flops, 4096, 128, False) < k.flash(flops, 4096, 128, True)


# ----- overlap ------------------------------------------------------------------------------------------------------
def test_bucket_overlap_by_hand():
    # 4 buckets of 10 ms behind a 60 ms backward: each ready every 15 ms, only the last one exposed
    assert overlapped(40.0, 39.0, 4, 60.0) == (10.0, 30.0)
    # behind a 20 ms backward the collectives queue up: 40 - 20 * 3 / 4 = 25 exposed
    assert overlapped(40.0, 39.0, 4, 20.0) == (25.0, 15.0)
    # never more than the unbucketed collective
    assert overlapped(40.0, 39.0, 4, 0.0) == (39.0, 1.0)


def _random_plans(rng, n):
    m = load_model("gpt-1.3b")
    c = parse_cluster("2x8-h100")
    out = []
    for _ in range(n):
        pp = int(rng.choice([1, 2, 4]))
        tp = int(rng.choice([1, 2, 4, 8]))
        dp = 16 // (pp * tp)
        if dp < 1:
            continue
        v = int(rng.choice([1, 2])) if pp > 1 else 1
        mbs = dp * int(rng.choice([1, 2]))
        gbs = mbs * pp * int(rng.choice([2, 4]))
        out.append(dict(model=m, num_stages=pp, tp=tp, dp=dp, micro_batch_size=mbs, global_batch_size=gbs,
                        cluster=c, sequence_parallel=tp > 1 and bool(rng.integers(0, 2)), num_virtual_stages=v,
                        recompute=str(rng.choice(["none", "selective", "full"]))))
    return out


def test_overlap_never_makes_a_plan_slower():
    """DP gradient reduction, the parameter all-gather, interleaved p2p and megatron-core's TP input-gradient
    overlap only hide time (each exposed part is at most the collective it hides)."""
    rng = np.random.default_rng(3)
    for kw in _random_plans(rng, 40):
        model, c = kw["model"], kw["cluster"]
        tr = TrainingSpec(global_batch_size=kw["global_batch_size"], precision="bf16")
        plain = uniform_plan(**kw, distributed_optimizer=True)
        over = uniform_plan(**kw, distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True)
        on = make_cost_model(model, c, tr).evaluate(over).iteration_ms
        off = make_cost_model(model, c, tr, settings=RunSettings(overlap_tp_dgrad=False, overlap_p2p_comm=False)
                              ).evaluate(plain).iteration_ms
        assert on <= off + 1e-9, kw


def test_tp_comm_overlap_hides_most_of_a_heavy_tp_collective():
    m = load_model("gpt-13b")
    c = parse_cluster("1x8-h100")
    cm = _cm(m, c)
    plain, te = cm.unit_table(4, 8, sp=True), cm.unit_table(4, 8, sp=True, tp_overlap=True)
    assert (te.tp_comm_ms < 0.5 * plain.tp_comm_ms).all()
    assert (te.fwd_ms + te.bwd_ms < plain.fwd_ms + plain.bwd_ms).all()


# ----- interleaved pipeline -----------------------------------------------------------------------------------------
def _interleaved_reference(fwd, bwd, m):
    """Independent interleaved 1F1B: megatron-core's op order (forward k: chunk (k // p) % v, micro-batch
    (k // (p v)) p + k % p; warm-up 2 (p - s - 1) + (v - 1) p) run event by event."""
    p, v = len(fwd), len(fwd[0])
    total = m * v
    orders = []
    for s in range(p):
        w = min(2 * (p - s - 1) + (v - 1) * p, total)
        op = lambda k, f: (f, (k // p) % v if f else v - 1 - (k // p) % v, (k // (p * v)) * p + k % p)  # noqa: E731
        ops = [op(k, True) for k in range(w)]
        for k in range(total - w):
            ops += [op(w + k, True), op(k, False)]
        ops += [op(k, False) for k in range(total - w, total)]
        orders.append(ops)
    done, clock, pos = {}, [0.0] * p, [0] * p
    while any(pos[s] < len(orders[s]) for s in range(p)):
        for s in range(p):
            while pos[s] < len(orders[s]):
                f, c, i = orders[s][pos[s]]
                k = c * p + s
                dep = (0.0 if k == 0 else done.get((True, k - 1, i))) if f else \
                    (done.get((True, k, i)) if k == p * v - 1 else done.get((False, k + 1, i)))
                if dep is None:
                    break
                clock[s] = max(clock[s], dep) + (fwd[s][c] if f else bwd[s][c])
                done[(f, k, i)] = clock[s]
                pos[s] += 1
    return max(clock)


def test_interleaved_uneven_chunks_match_the_reference_simulation():
    """Short schedules (simulated op by op) and long ones (the periodic jump after a probe of a few groups)."""
    rnd = random.Random(11)
    for trial in range(60):
        p, v = rnd.randint(2, 5), rnd.randint(2, 3)
        m = p * (rnd.randint(1, 4) if trial % 2 else rnd.randint(12, 16))
        fwd = [[rnd.uniform(0.5, 3) for _ in range(v)] for _ in range(p)]
        bwd = [[rnd.uniform(0.5, 6) for _ in range(v)] for _ in range(p)]
        got = interleaved_one_f_one_b(fwd, bwd, [0.0] * p, m).iteration_ms
        assert got == pytest.approx(_interleaved_reference(fwd, bwd, m), rel=1e-12)


def test_interleaved_plan_bubble_is_the_1f1b_bubble_over_v():
    """Identical chunks through the whole cost model: (M v + p - 1)(f + b) plus the end of the iteration."""
    m = TINY.model_copy(update={"num_layers": 8, "hidden_dropout": 0.0})
    c = parse_cluster("1x4-h100")
    cm = _cm(m, c, gbs=8)
    plan = uniform_plan(m, 2, 2, 1, 1, 8, cluster=c, num_virtual_stages=2)
    # the embedding and head make the end chunks unequal: compare the schedule with the same per-chunk times
    cost = cm.evaluate(plan)
    f = [list(s.chunk_fwd_ms) for s in cost.stages]
    b = [list(s.chunk_bwd_ms) for s in cost.stages]
    assert cost.pipeline.num_chunks == 2
    assert cost.iteration_ms - max(s.optimizer_ms for s in cost.stages) == pytest.approx(
        _interleaved_reference(f, b, 8) + max(s.dp_sync_ms for s in cost.stages), rel=1e-9)
    same = interleaved_one_f_one_b([[1.0, 1.0]] * 2, [[2.0, 2.0]] * 2, [0.0, 0.0], 8)
    plain = one_f_one_b([2.0] * 2, [4.0] * 2, [0.0, 0.0], 8)
    assert same.bubble_ms == pytest.approx(plain.bubble_ms / 2)


def test_interleaving_holds_more_micro_batches_on_the_first_stage():
    m = load_model("gpt-1.3b")
    c = parse_cluster("1x8-h100")
    cm = _cm(m, c, gbs=64)
    one = cm.evaluate(uniform_plan(m, 4, 2, 1, 1, 16, cluster=c))
    two = cm.evaluate(uniform_plan(m, 4, 2, 1, 1, 16, cluster=c, num_virtual_stages=2))
    assert two.stages[0].memory_breakdown["activations"] > one.stages[0].memory_breakdown["activations"]
    assert two.pipeline.bubble_ms < one.pipeline.bubble_ms


# ----- the timeline ---------------------------------------------------------------------------------------------------
_LANE = ("forward", "backward", "recompute", "tp_comm", "cp_comm", "p2p", "dp_comm", "param_gather", "optimizer")


@pytest.mark.parametrize("v", [1, 2])
@pytest.mark.parametrize("stages", [2, 4])
def test_events_reproduce_iteration_and_busy_time(stages, v):
    m = load_model("gpt-1.3b")
    c = parse_cluster("1x8-h100")
    cm = _cm(m, c, gbs=32)
    tp = 2 if stages == 2 else 1
    dp = 8 // (tp * stages)
    plan = uniform_plan(m, stages, tp, dp, dp, 32, cluster=c, num_virtual_stages=v,
                        recompute="selective", distributed_optimizer=True, overlap_grad_reduce=True,
                        overlap_param_gather=True)
    # make the stages uneven: move one layer from the last stage to the first
    data = plan.model_dump()
    last, first = data["stages"][-1]["chunks"][-1], data["stages"][0]["chunks"][0]
    if v == 1:
        first["end_unit"] += 2
        first["recompute"] += ["full", "full"]
        data["stages"][1]["chunks"][0]["start_unit"] += 2
        data["stages"][1]["chunks"][0]["recompute"] = data["stages"][1]["chunks"][0]["recompute"][2:]
    else:
        last["recompute"] = ["full"] * len(last["recompute"])
    plan = parse_plan(data)
    costs = cm.stage_costs(plan)
    pipe = cm.pipeline(costs, plan.num_micro_batches)
    events = cm.pipeline_events(costs, plan.num_micro_batches)
    assert max(e.end_ms for e in events) == pytest.approx(pipe.iteration_ms, rel=1e-12)
    for k in range(stages):
        busy = sum(e.end_ms - e.start_ms for e in events if e.stage == k and e.kind in _LANE)
        assert busy == pytest.approx(pipe.stage_busy_ms[k], rel=1e-12)
        lane = sorted((e.start_ms, e.end_ms) for e in events if e.stage == k and e.kind in _LANE)
        assert all(a[1] <= b[0] + 1e-9 for a, b in zip(lane, lane[1:]))      # one compute lane per stage
    assert {"recompute", "p2p", "param_gather", "optimizer"} <= {e.kind for e in events}


@pytest.mark.parametrize("v", [1, 2])
def test_timeline_tp_and_cp_pieces(v):
    """The timeline's TP / CP pieces: without SP each half's forward is one blocking all-reduce of its activation
    (Shoeybi et al. 2019, fig. 3), so a forward op's ``tp_comm`` is (units in the chunk) x that all-reduce; per
    stage the exposed pieces add up to the iteration's exposed TP / CP time, the hidden ones to the hidden time."""
    m = load_model("gpt-1.3b")
    c = parse_cluster("1x8-h100")
    cm = _cm(m, c, gbs=32)
    plan = uniform_plan(m, 2, 2, 1, 2, 32, cluster=c, cp=2, num_virtual_stages=v)
    costs = cm.stage_costs(plan)
    events = cm.pipeline_events(costs, plan.num_micro_batches)
    b, s = plan.micro_batch_size, m.seq_length // 2                # per rank: dp 1, the sequence over cp 2
    all_reduce = cm.comm.all_reduce(2.0 * s * b * m.hidden_size, 2)
    for k, st in enumerate(costs):
        for j, chunk in enumerate(plan.stages[k].chunks):
            units = chunk.end_unit - chunk.start_unit
            fwd = [e for e in events if e.stage == k and e.chunk == j and e.kind == "tp_comm" and e.micro_batch == 0]
            assert fwd[0].end_ms - fwd[0].start_ms == pytest.approx(units * all_reduce, rel=1e-9)
        for kind in ("tp", "cp"):
            exposed = sum(e.end_ms - e.start_ms for e in events if e.stage == k and e.kind == f"{kind}_comm")
            hid = sum(e.end_ms - e.start_ms for e in events if e.stage == k and e.kind == f"{kind}_comm_hidden")
            assert exposed == pytest.approx(st.comm[kind][0], rel=1e-9) and exposed > 0
            assert hid == pytest.approx(st.comm[kind][1], rel=1e-9)


# ----- memory and settings ----------------------------------------------------------------------------------------
def test_fp32_gradients_follow_megatrons_table():
    """docs/distrib_optimizer.md: bf16 weights with fp32 gradients: 18 bytes per parameter, 6 + 12/d with the
    distributed optimizer; without fp32 gradients the step's fp32 copy of the gradient (4/d) outlives nothing."""
    m = load_model("gpt-1.3b")
    c = parse_cluster("1x8-h100")
    rc = np.zeros(m.num_units, np.int8)
    feats = Features(distributed_optimizer=True)
    cm = _cm(m, c, settings=run_settings(target_settings("megatron-lm", precision="bf16"), "bf16"))
    st = cm.stage_cost(0, 1, 0, 0, m.num_units, 1, 8, rc, 8, features=feats)
    b = st.memory_breakdown
    params = b["params"] / 2
    assert b["grads"] == pytest.approx(4 * params) and b["optimizer"] == pytest.approx(12 * params / 8)
    assert "grad_copy" not in b
    plain = _cm(m, c).stage_cost(0, 1, 0, 0, m.num_units, 1, 8, rc, 8, features=feats)
    assert plain.memory_breakdown["grads"] == pytest.approx(2 * params)
    assert plain.memory_breakdown["grad_copy"] == 0.0      # the activations dwarf the 4/8 B copy


def test_optimizer_barrier():
    """The step starts when the slowest stage has its gradients: T = max(end + sync) + max(step)."""
    f, b = [1.0, 2.0], [2.0, 4.0]
    got = one_f_one_b(f, b, [5.0, 0.0], 4, step=[1.0, 3.0])
    free = one_f_one_b(f, b, [5.0, 0.0], 4)
    assert got.iteration_ms == pytest.approx(free.iteration_ms + 3.0)


def test_presets_b200_gb200():
    b200, gb200 = parse_cluster("1x8-b200"), parse_cluster("1x72-gb200")
    assert b200.gpu.peak_tflops("bf16") == 2250 and b200.gpu.hbm_gbps == 8000 and b200.intra_node_gbps == 900
    assert gb200.gpu.peak_tflops("bf16") == 2500 and gb200.num_gpus == 72 and gb200.gpu.memory_gib == 186.0   # the datasheet's 186 GB, binary (7g.186gb)
    m = load_model("llama3-8b")
    fast = _cm(m, b200).evaluate(uniform_plan(m, 1, 2, 4, 4, 64, cluster=b200, sequence_parallel=True))
    h = parse_cluster("1x8-h100")
    slow = _cm(m, h).evaluate(uniform_plan(m, 1, 2, 4, 4, 64, cluster=h, sequence_parallel=True))
    assert 1.5 < slow.iteration_ms / fast.iteration_ms < 2.3      # bf16 2.28x, HBM 2.4x, NVLink 2x


def test_sources_refuse_what_they_cannot_price(tmp_path):
    from search.io.errors import AcesoError
    m = load_model("gpt-1.3b")
    c = parse_cluster("1x8-h100")
    cm = _cm(m, c, kernels="flat")
    assert {"sequence_parallel", "context_parallel", "tp_comm_overlap", "interleaved"} <= cm.features
    cm.features = cm.features - {"sequence_parallel"}
    with pytest.raises(AcesoError, match="cannot price sequence parallelism"):
        cm.stage_cost(0, 1, 0, 0, 4, 2, 1, np.zeros(4, np.int8), 1, sp=True)
