"""The MoE cost model (search/costmodel/moe_cost.py, mla_mtp.py) against hand-written formulas.

Every expected number below is computed from the formula as written in the module docstrings and
docs/costmodel.md ("MoE, MLA and MTP"), with the datasheet constants (H100: 989 TFLOP/s bf16, 3350 GB/s HBM,
NVLink 450 GB/s, 50 GB/s NIC, 80% link efficiency) and the flat kernel model's efficiencies, never by calling the
code under test.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from search.spec.cluster import parse_cluster
from search.pricing import make_cost_model
from search.costmodel.analytic import AnalyticSource
from search.costmodel.comm import CommModel
from search.costmodel.kernels import GPU_EFFICIENCY, LAUNCH_MS
from search.costmodel.moe_cost import moe_unit
from search.costmodel.release_constants import value as release_value
from search.layers.moe_params import counts, mlp_params
from search.settings.moe_plan import MoEPlanSettings
from search.spec.model import ModelSpec
from search.spec.presets import load_model
from search.spec.training import TrainingSpec

MB = 2.0 ** 20
PEAK = 989e9            # FLOP per ms, bf16
HBM = 3350e6            # bytes per ms
NVLINK = 450e6 * 0.8    # bytes per ms
NIC = 50e6 * 0.8


def tiny_moe(**moe) -> ModelSpec:
    return ModelSpec(name="tiny-moe", family="llama", num_layers=2, hidden_size=1024, num_attention_heads=8,
                     ffn_hidden_size=2048, seq_length=1024, vocab_size=32000, activation="gelu",
                     normalization="rmsnorm", position_embedding="rope", add_bias_linear=False,
                     tied_embeddings=False, params_dtype="bf16",
                     moe={"num_experts": 8, "moe_router_topk": 2, "moe_ffn_hidden_size": 512, **moe})


def test_moe_unit_forward_by_hand():
    """b 1, s 1024, tp 1, ep 4 (one 8-GPU node), etp 1, gelu, no shared expert, flat kernels, grouped GEMM."""
    m = tiny_moe()
    cl = parse_cluster("1x8-h100")
    src = AnalyticSource(m, cl, TrainingSpec(global_batch_size=8), CommModel(cl), kernels="flat")
    e = GPU_EFFICIENCY["h100"]

    def gemm(flops):
        return flops / (PEAK * e.gemm) + LAUNCH_MS

    def grouped(flops):
        return flops / (PEAK * e.bmm) + LAUNCH_MS

    def mem(nbytes):
        return nbytes / (HBM * e.mem) + LAUNCH_MS
    T, h, E, k, f, dt = 1024, 1024, 8, 2, 512, 2
    m_e = T * k * 4 / E                       # etp T k ep / E tokens per local expert: 1024
    router = gemm(2 * T * E * h)
    elementwise = mem(2 * dt * T * h + (3 * dt + 1) * T * h      # norm + bias-dropout-add
                      + T * E * (dt + 12 + 1)                    # scores, top-k, probs, routing map
                      + dt * T * h + T * k * (dt * h + 4))       # fused permute and unpermute
    experts = grouped(2 * 2 * m_e * f * h) + grouped(2 * 2 * m_e * h * f)   # 2 local experts, fc1 and fc2
    act = mem(2 * dt * m_e * 2 * f)
    dispatch = 0.003 + (T * k * h * dt + 4 * T * k) * 3 / 4 / NVLINK        # 3 of 4 EP peers in the node
    combine = 0.003 + T * k * h * dt * 3 / 4 / NVLINK
    cost, act_bytes, params, experts_params = moe_unit(src, 1.0, 1024, 1, False, 4, 1, MoEPlanSettings())
    # (the host-bound wait is added per layer on the unit table: test_moe_time.py)
    assert cost.fwd == pytest.approx(router + elementwise + experts + act + dispatch + combine, rel=1e-9)
    assert cost.ep_comm == pytest.approx(2 * (dispatch + combine), rel=1e-9)     # forward + backward
    assert cost.rec_sel == pytest.approx(act, rel=1e-9)
    assert experts_params == 2 * mlp_params(m, 512)                          # E / ep = 2 local experts
    assert params == experts_params + 1024 + 8 * 1024                        # + norm + router
    # moe_act frees the experts' activation output twice over for gelu (the fc2 input, and the copy the unfused
    # probs multiply saves: tests/runtime/test_moe_act_memory.py): 2 dt m_e f per local expert
    assert act_bytes[0] - act_bytes[1] == pytest.approx(2 * dt * m_e * 2 * f)
    assert act_bytes[2] == dt * T * h


def test_quantized_experts_run_at_the_fp8_peak_plus_their_input_casts():
    """fp8-delayed on H100 (flat kernels): the grouped GEMMs at the 1979 TFLOP/s FP8 peak, plus one cast per GEMM
    input (forward: x of fc1 (m h) and fc2 (m f); delayed scaling: read dt + write the row- and column-wise fp8
    copies, dt + 2 bytes per element, one launch); each quantized GEMM x (1 + K0 / its inner k), K0 the release's GROUPED_K0_LP."""
    m = tiny_moe()
    cl = parse_cluster("1x8-h100")
    src = AnalyticSource(m, cl, TrainingSpec(global_batch_size=8, precision="fp8-delayed"), CommModel(cl),
                         kernels="flat")
    e = GPU_EFFICIENCY["h100"]
    T, h, k, f, dt = 1024, 1024, 2, 512, 2
    m_e = T * k * 4 / 8
    flops = 2 * 2 * m_e * f * h                                   # one linear over the 2 local experts
    bf16 = 2 * (flops / (PEAK * e.bmm) + LAUNCH_MS)
    one = flops / (1979e9 * e.bmm) + LAUNCH_MS
    k0 = release_value("GROUPED_K0_LP", "")                         # the newest release's fit
    fp8 = one * (1 + k0 / h) + one * (1 + k0 / f)                   # fc1 inner h, fc2 inner f
    casts = sum((dt + 2) * 2 * m_e * n / (HBM * e.mem) + LAUNCH_MS for n in (h, f))
    plain, *_ = moe_unit(src, 1.0, 1024, 1, False, 4, 1, MoEPlanSettings())
    quant, *_ = moe_unit(src, 1.0, 1024, 1, False, 4, 1, MoEPlanSettings(), lp=True)
    assert quant.fwd - plain.fwd == pytest.approx(fp8 + casts - bf16, rel=1e-9)


def test_quantized_experts_keep_their_inputs_in_fp8():
    """A quantized moe unit keeps the experts' fc1 input (m h) and fc2 input (m f) as fp8 (1 byte, not dt 2):
    m = etp T k = 2048 token copies, h 1024, f 512; selective (moe_act) frees the fc2 input anyway."""
    m = tiny_moe()
    cl = parse_cluster("1x8-h100")
    src = AnalyticSource(m, cl, TrainingSpec(global_batch_size=8, precision="fp8-delayed"), CommModel(cl),
                         kernels="flat")
    _, plain, *_ = moe_unit(src, 1.0, 1024, 1, False, 4, 1, MoEPlanSettings())
    _, quant, *_ = moe_unit(src, 1.0, 1024, 1, False, 4, 1, MoEPlanSettings(), lp=True)
    assert plain[0] - quant[0] == pytest.approx((2 - 1) * 2048 * (1024 + 512))
    assert plain[1] - quant[1] == pytest.approx((2 - 1) * 2048 * 1024)


def test_imbalance_and_sequential_experts_scale_the_busiest_rank():
    m = tiny_moe(moe_router_force_load_balancing=False, moe_imbalance_factor=2.0)
    cl = parse_cluster("1x8-h100")
    src = AnalyticSource(m, cl, TrainingSpec(global_batch_size=8), CommModel(cl), kernels="flat")
    e = GPU_EFFICIENCY["h100"]
    T, h, k, dt = 1024, 1024, 2, 2
    cost, *_ = moe_unit(src, 1.0, 1024, 1, False, 4, 1, MoEPlanSettings(grouped_gemm=False))
    # the dispatch waits on the busiest rank: f x the bytes term
    dispatch = 0.003 + 2.0 * (T * k * h * dt + 4 * T * k) * 3 / 4 / NVLINK
    combine = 0.003 + 2.0 * T * k * h * dt * 3 / 4 / NVLINK
    assert cost.ep_comm == pytest.approx(2 * (dispatch + combine), rel=1e-9)
    # SequentialMLP: one GEMM call per local expert (2), each of f_i x 1024 = 2048 tokens; grouped: one call per
    # linear over both experts (the flat model's batched efficiency)
    m_e = 2.0 * 1024
    one = 2 * m_e * 512 * h + 2 * m_e * h * 512
    sequential = 2 * (one / (PEAK * e.gemm) + LAUNCH_MS)
    grouped = 2 * (2 * one / 2 / (PEAK * e.bmm) + LAUNCH_MS)
    group, *_ = moe_unit(src, 1.0, 1024, 1, False, 4, 1, MoEPlanSettings())
    assert cost.fwd - group.fwd == pytest.approx(sequential - grouped, rel=1e-9)


def test_shared_expert_overlap_hides_it_behind_the_dispatch():
    m = tiny_moe(num_experts=16, moe_shared_expert_intermediate_size=1024)
    cl = parse_cluster("2x8-h100")
    src = AnalyticSource(m, cl, TrainingSpec(global_batch_size=8), CommModel(cl))
    plain, *_ = moe_unit(src, 1.0, 1024, 1, False, 16, 1, MoEPlanSettings())
    over, *_ = moe_unit(src, 1.0, 1024, 1, False, 16, 1, MoEPlanSettings(shared_expert_overlap=True))
    assert over.ep_hidden > 0
    assert over.fwd + over.bwd == pytest.approx(plain.fwd + plain.bwd - over.ep_hidden, rel=1e-9)
    # ep 16 over two nodes: 8 members per node, half the copies on the NIC (0.010 ms alpha)
    d = 0.010 + max((1024 * 2 * 1024 * 2 + 4 * 1024 * 2) * 7 / 16 / NVLINK,
                    (1024 * 2 * 1024 * 2 + 4 * 1024 * 2) * 8 / 16 / NIC)
    c = 0.010 + max(1024 * 2 * 1024 * 2 * 7 / 16 / NVLINK, 1024 * 2 * 1024 * 2 * 8 / 16 / NIC)
    assert plain.ep_comm == pytest.approx(2 * (d + c), rel=1e-9)


def _stage(name, cluster, tp, dp, ep, etp, start, end, **plan):
    m = load_model(name)
    cm = make_cost_model(m, parse_cluster(cluster), TrainingSpec(global_batch_size=64))
    rc = np.zeros(end - start, np.int8)
    from search.costmodel.types import Features
    return m, cm.stage_cost(1, 4, 0, start, end, tp, dp, rc, dp, sp=tp > 1, ep=ep, etp=etp,
                            features=Features(**plan))


def test_mixtral_stage_memory_by_hand():
    """Mixtral 8x7B, layers 2-3 on 8 GPUs: tp 2 (SP), dp 4, ep 4, etp 1 -> edp 2, distributed optimizer."""
    m, c = _stage("mixtral-8x7b", "1x8-h100", 2, 4, 4, 1, 4, 8, distributed_optimizer=True)
    h, f, E, q, kv = 4096, 14336, 8, 4096, 8 * 128
    expert = 3 * h * f                                    # SwiGLU: h x 2f + f x h, no bias
    att = (h * (q + 2 * kv) + q * h) / 2 + h              # QKV and output split over tp 2, norm whole
    moe_dense = h + E * h                                 # pre-MLP norm + router (whole)
    moe_experts = (E // 4) * expert / 1                   # E / ep experts, etp 1
    per_layer = att + moe_dense + moe_experts
    assert c.memory_breakdown["params"] == pytest.approx(2 * per_layer * 2 / MB, rel=1e-12)
    dense, experts = 2 * (att + moe_dense), 2 * moe_experts
    # Adam states: dense over dp x cp = 4, experts over edp = 8 / (1 x 4) = 2
    assert c.memory_breakdown["optimizer"] == pytest.approx((dense * 12 / 4 + experts * 12 / 2) / MB, rel=1e-12)
    # summed over the ep x etp ranks of one expert group, one layer's experts are the model's
    assert 4 * moe_experts == counts(m).experts_per_layer


def test_deepseek_v3_stage_memory_by_hand():
    """DeepSeek-V3 layers 3-4 (MoE, MLA) on 64 GPUs: tp 1, dp 64, ep 64 -> edp 1, plain optimizer."""
    m, c = _stage("deepseek-v3", "8x8-h100", 1, 64, 64, 1, 6, 10)
    h, n, a = 7168, 128, m.mla
    mla = (h * a.q_lora_rank + a.q_lora_rank * n * (128 + 64) + h * (512 + 64) + 512 * n * (128 + 128)
           + n * 128 * h + h + a.q_lora_rank + 512)       # projections + input norm + q / kv latent norms
    moe = h + 256 * h + 3 * h * 2048 + 4 * 3 * h * 2048   # norm, router, shared expert, 256 / 64 experts
    assert c.memory_breakdown["params"] == pytest.approx(2 * (mla + moe) * 2 / MB, rel=1e-12)
    assert c.memory_breakdown["optimizer"] == pytest.approx(2 * (mla + moe) * 12 / MB, rel=1e-12)
    assert 64 * 4 * 3 * h * 2048 == counts(m).experts_per_layer


def test_expert_gradient_sync_over_the_edp_group():
    """Mixtral layers 0-1 on 16 GPUs over two nodes: tp 1, dp 16, ep 8 -> edp 2, strided by 8: one rank per node,
    the expert gradients all-reduced over the network; the dense ones over dp 16 with 8 NICs per node."""
    m, c = _stage("mixtral-8x7b", "2x8-h100", 1, 16, 8, 1, 0, 4)
    h, f = 4096, 14336
    experts = 2 * 1 * 3 * h * f                           # 2 layers x 8 / 8 experts
    dense = 2 * (h * (4096 + 2 * 1024) + 4096 * h + h + h + 8 * h)
    edp = 2 * 1 * 0.010 + 2 * (1 / 2) * experts * 2 / NIC
    # NCCL's ring latency (tuning.cc): of the all-reduce's 2 x 15 steps only 2 x (2 - 1) cross the two nodes
    dp = (2 * 15 - 2) * 0.003 + 2 * 0.010 + 2 * (15 / 16) * dense * 2 / min(8 * NIC, NVLINK)
    assert c.comm["edp"][0] == pytest.approx(edp, rel=1e-9)
    assert c.comm["dp"][0] == pytest.approx(dp, rel=1e-9)
    assert c.dp_sync_ms == pytest.approx(edp + dp, rel=1e-9)


def test_mla_and_mtp_flops_by_hand():
    m = load_model("deepseek-v3")
    s, h, n, V = 4096, 7168, 128, m.padded_vocab_size
    mla = (2 * s * (h * 1536 + 1536 * n * 192) + 2 * s * (h * 576 + 512 * n * 256) + 2 * s * n * 128 * h
           + 2 * s * s * n * 192 + 2 * s * s * n * 128)
    assert m.unit_forward_flops("attention", s) == pytest.approx(mla, rel=1e-12)
    moe = 2 * s * h * 256 + 8 * 2 * s * 3 * h * 2048 + 2 * s * 3 * h * 2048
    assert m.unit_forward_flops("moe", s) == pytest.approx(moe, rel=1e-12)
    mtp = 2 * s * 2 * h * h + mla + moe + 2 * s * h * V
    assert m.unit_forward_flops("mtp", s) == pytest.approx(mtp, rel=1e-12)
    assert [u.kind for u in m.units[-3:]] == ["attention", "moe", "mtp"]
    assert m.layer_starts[-1] == m.num_units and m.layer_starts[-2] == m.num_units - 3


def test_gpt_oss_moe_flops_count_the_gated_fc1_by_hand():
    """GPT-OSS's quick-GEGLU is gated like SwiGLU: fc1 is h x 2f (megatron-core's gated_linear_unit), so a token's
    expert costs 2 s (h 2f + f h), not 2 s (h f + f h)."""
    m = load_model("gpt-oss-120b")
    s, h, f = 4096, 2880, 2880
    moe = 2 * s * h * 128 + 4 * 2 * s * (h * 2 * f + f * h)
    assert m.unit_forward_flops("moe", s) == pytest.approx(moe, rel=1e-12)


def test_qwen3_plan_through_explain_prints_the_all_to_all(tmp_path, capsys):
    from search.cli import main
    from search.spec.plan import ChunkSpec, ParallelPlan, StageSpec
    m = load_model("qwen3-30b-a3b")
    half = m.layer_starts[24]
    stages = [StageSpec(num_gpus=8, tp=1, dp=8, ep=8, chunks=[ChunkSpec(start_unit=a, end_unit=b,
                                                                        recompute=["selective"] * (b - a))])
              for a, b in ((0, half), (half, m.num_units))]
    plan = ParallelPlan(model=m, micro_batch_size=8, global_batch_size=64, stages=stages,
                        distributed_optimizer=True)
    path = tmp_path / "plan.json"
    path.write_text(plan.to_json())
    assert main(["explain", str(path), "--cluster", "2x8-h100", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    ep = out["stages"][0]["comm"]["ep"]
    assert ep["exposed_ms"] > 0
    assert main(["explain", str(path), "--cluster", "2x8-h100"]) == 0
    text = capsys.readouterr().out
    header = next(line for line in text.splitlines() if line.split()[:2] == ["stage", "ep"])
    assert "ep" in header.split()


def test_etp_gather_and_allgather_dispatcher_by_hand():
    """tp 2 (SP), ep 2, etp 2 in one node: the ETP all-gather / reduce-scatter of the dispatched tokens; the
    allgather dispatcher instead gathers tokens, probs and routing map over the etp x ep = 4 ranks."""
    m = tiny_moe()
    cl = parse_cluster("1x8-h100")
    src = AnalyticSource(m, cl, TrainingSpec(global_batch_size=8), CommModel(cl))
    T, h, k, dt, E = 512, 1024, 2, 2, 8          # T = b s / tp

    def ring(nbytes, n):                         # reduce-scatter or all-gather of a full tensor, in a node
        return (n - 1) * 0.003 + (n - 1) / n * nbytes / NVLINK
    a2a = (0.003 + (T * k * h * dt + 4 * T * k) / 2 / NVLINK) + (0.003 + T * k * h * dt / 2 / NVLINK)
    etp = ring(2 * T * k * h * dt, 2) * 2        # gather after the dispatch, reduce-scatter before the combine
    cost, *_ = moe_unit(src, 1.0, 1024, 2, True, 2, 2, MoEPlanSettings())
    assert cost.ep_comm == pytest.approx(2 * (a2a + etp), rel=1e-9)
    gather = ring(4 * T * (h * dt + E * 5), 4) + ring(4 * T * h * dt, 4)
    cost, *_ = moe_unit(src, 1.0, 1024, 2, True, 2, 2, MoEPlanSettings(token_dispatcher="allgather"))
    assert cost.ep_comm == pytest.approx(2 * gather, rel=1e-9)


def test_moe_needs_sequence_parallel_with_tp():
    from search.io.errors import AcesoError
    m = tiny_moe()
    cl = parse_cluster("1x8-h100")
    src = AnalyticSource(m, cl, TrainingSpec(global_batch_size=8), CommModel(cl))
    with pytest.raises(AcesoError, match="needs sequence parallelism"):
        moe_unit(src, 1.0, 1024, 2, False, 2, 1, MoEPlanSettings())


def test_overlap_ep_comm_hides_what_the_layer_pair_schedule_saves():
    """overlap_moe_expert_parallel_comm: the unit table's moe unit keeps exposed its all-to-all minus what the
    layer pair's schedule saves (ep_overlap.py: the attention unit and the moe unit's compute of the other
    micro-batch, with NCCL's SM tax); the rest is hidden, nothing else moves."""
    from search.costmodel.ep_overlap import LayerTimes, saving_ms
    m = tiny_moe(num_experts=16)
    cl = parse_cluster("2x8-h100")
    src = AnalyticSource(m, cl, TrainingSpec(global_batch_size=8), CommModel(cl))
    plain = src.unit_table(1.0, 1, ep=16, etp=1, moe=MoEPlanSettings())
    over = src.unit_table(1.0, 1, ep=16, etp=1, moe=MoEPlanSettings(overlap_ep_comm=True))
    i = [u.kind for u in m.units].index("moe")
    unit, *_ = moe_unit(src, 1.0, 1024, 1, False, 16, 1, MoEPlanSettings())
    d, c, _ = unit.ep_split
    a_f, a_b = plain.ep_fwd_ms[i][0], plain.ep_comm_ms[i] - plain.ep_fwd_ms[i][0]
    fwd = plain.fwd_ms - (plain.host_ms if plain.host_ms is not None else 0.0)
    x = LayerTimes(fwd[i - 1], plain.bwd_ms[i - 1], 0.0, fwd[i] - a_f, plain.bwd_ms[i] - a_b, 0.0,
                   d * a_f / (d + c), c * a_f / (d + c), d * a_b / (d + c), c * a_b / (d + c))
    save = saving_ms(x, src._tax_ep)
    assert save > 0
    assert over.ep_comm_ms[i] == pytest.approx(plain.ep_comm_ms[i] - save, rel=1e-9)
    assert over.ep_comm_ms[i] + over.ep_hidden_ms[i] == pytest.approx(plain.ep_comm_ms[i], rel=1e-9)


def test_moe_act_bytes_by_hand_as_megatron_core_keeps_them():
    """Every byte a gated (SwiGLU and GPT-OSS's quick-GELU GLU) moe unit keeps on a GPU, counted by hand from
    megatron-core 0.16.1's MoELayer: norm in/out 2 dt T h; router fp32 scores + probs + map T E (4 + 4 + 1) and
    top-k probs 4 T k; experts: fc1 input dt m h, activation input dt m 2f, the probs the weighted activation
    saves 4 m, fc2 input dt m f; nothing for the unpermute (the probs are applied in the activation, so the
    dispatchers' unpermute keeps only its row map). T 1024, k 2, m = T k = 2048, h 1024, E 8, f 512, dt 2."""
    from search.costmodel.moe_cost import moe_act_bytes
    cl = parse_cluster("1x8-h100")
    T, h, E, k, f, dt = 1024, 1024, 8, 2, 512, 2
    m_tok = T * k
    for act in ("swiglu", "quick_geglu"):
        m = tiny_moe().model_copy(update={"activation": act})
        src = AnalyticSource(m, cl, TrainingSpec(global_batch_size=8), CommModel(cl), kernels="flat")
        none, sel, full, transient = moe_act_bytes(src, 1.0, T, 1, 4, 1, MoEPlanSettings())
        kept = (2 * dt * T * h + T * E * 9 + 4 * T * k
                + dt * m_tok * h + dt * m_tok * 2 * f + 4 * m_tok + dt * m_tok * f)
        assert none == pytest.approx(kept), act
        assert none - sel == pytest.approx(dt * m_tok * f)          # moe_act drops the fc2 input
        assert full == dt * T * h and transient == dt * T * k * h   # the unit input; the permuted send buffer


def test_mla_activations_by_hand_and_quantized_linear_inputs():
    """DeepSeek-V3's MLA unit at b 1, s 4096, tp 1, flash: norm in/out 2 dt s h, the latents and their normalised
    copies dt s (2 ql + 2 kvl + dr), Q K V dt s n (2 (dq + dr) + dv), the projection input dt s n dv, the fp32
    log-sum-exp 4 n s. Under fp8 (a quantized unit, as the dense attention's linears) the down projections' input
    (s h), the up projections' latents (s (ql + kvl)) and the projection input (s n dv) are kept in 1 byte."""
    from search.costmodel.mla_mtp import mla_act_bytes
    m = load_model("deepseek-v3")
    cl = parse_cluster("1x8-h100")
    s, h, n, ql, kvl, dr, dq, dv, dt = 4096, 7168, 128, 1536, 512, 64, 128, 128, 2
    kept = 2 * dt * s * h + dt * s * (2 * ql + 2 * kvl + dr) + dt * s * n * (2 * (dq + dr) + dv) + dt * s * n * dv \
        + 4 * n * s
    src = AnalyticSource(m, cl, TrainingSpec(global_batch_size=8, attention="flash"), CommModel(cl), kernels="flat")
    none, sel, full, _, up = mla_act_bytes(src, 1.0, s, 1)
    assert none == pytest.approx(kept) and none - sel == pytest.approx(4 * n * s) and full == dt * s * h
    assert none - up == pytest.approx(dt * s * n * (2 * (dq + dr) + dv))    # mla_up_proj: the core's Q, K, V
    fp8 = AnalyticSource(m, cl, TrainingSpec(global_batch_size=8, precision="fp8-delayed", attention="flash"),
                         CommModel(cl), kernels="flat")
    qnone, _, qfull, _, _ = mla_act_bytes(fp8, 1.0, s, 1, lp=True)
    assert none - qnone == pytest.approx((2 - 1) * s * (h + ql + kvl + n * dv)) and qfull == full


def test_learned_routing_priced_as_even_says_so():
    """Issue 32: routing is learned by default and priced at moe_imbalance_factor 1; the analytic source says so in
    one note (search prints it), and not when the spec forces balance, sets a factor or bounds it by a capacity."""
    cl = parse_cluster("1x8-h100")

    def notes(**moe):
        m = tiny_moe(**moe)
        return [w for w in AnalyticSource(m, cl, TrainingSpec(global_batch_size=8), CommModel(cl)).warnings
                if "moe_imbalance_factor" in w]
    assert len(notes()) == 1 and "priced as evenly balanced" in notes()[0]
    for moe in ({"moe_router_force_load_balancing": True}, {"moe_imbalance_factor": 1.5},
                {"moe_expert_capacity_factor": 1.0}):
        assert notes(**moe) == [], moe
