"""The MoE time terms fitted on the published runs (docs/costmodel.md "MoE calibration") against hand-computed
cases: the quantized grouped GEMM's per-tile fixed cost (``1 + K0 / k`` on each GEMM's own inner depth), whether a
dispatcher synchronises with the host (megatron-core 0.16.1: dropless yes, padded to capacity no; the host-bound
layer itself: tests/unit/test_stack_features.py)."""

import pytest

from search.spec.cluster import parse_cluster
from search.costmodel.analytic import AnalyticSource
from search.costmodel.comm import CommModel
from search.costmodel.kernels import ShapeKernels
from search.costmodel.moe_cost import moe_unit, syncs
from search.costmodel.moe_primitives import grouped_gemm_bwd_ms, grouped_gemm_ms
from search.settings.moe_plan import MoEPlanSettings
from search.spec.training import TrainingSpec
from tests.unit.test_moe_cost import tiny_moe


def _h100():
    return ShapeKernels("h100", 989e9, 3.35e9, 2.0)


def test_grouped_gemm_per_tile_cost_by_hand():
    # 8 experts x (4096 x 7168) @ (7168 x 4096) on an H100 (test_moe_primitives: 32 waves, eff 0.803 x 0.83 x
    # 4096 / (32 x 132)); K0 = 1024 adds 1024 / 7168 of the k loop
    eff = 0.803 * 0.83 * 4096 / (32 * 132)
    t = 2.0 * 8 * 4096 * 4096 * 7168 / (989e9 * eff) + 0.005
    assert grouped_gemm_ms(_h100(), 8, 4096, 4096, 7168, 1024) == pytest.approx(t * (1 + 1024 / 7168))
    assert grouped_gemm_ms(_h100(), 8, 4096, 4096, 7168) == pytest.approx(t)      # bf16: k0 0


def test_grouped_gemm_backward_takes_each_gemms_own_inner_depth():
    # backward of (m 256, n 4096, k 7168): input gradient (256, 7168, 4096), inner 4096; weight gradient
    # (7168, 4096, 256), inner 256 = the tokens per expert: the small-m wgrad pays K0 / 256
    k = _h100()
    dgrad, wgrad = k.bmm(8, 256, 7168, 4096), k.bmm(8, 7168, 4096, 256)
    assert grouped_gemm_bwd_ms(k, 8, 256, 4096, 7168, 512) == pytest.approx(dgrad * (1 + 512 / 4096)
                                                                            + wgrad * (1 + 512 / 256))
    assert grouped_gemm_bwd_ms(k, 8, 256, 4096, 7168) == pytest.approx(k.bmm(8, 256, 4096, 7168, backward=True))
    assert grouped_gemm_bwd_ms(k, 8, 0, 4096, 7168, 512) == 0.0


def test_dropless_dispatch_synchronises_padded_does_not():
    # megatron-core 0.16.1 MoEAlltoAllTokenDispatcher: the D2H copy and sync run only `if not self.drop_and_pad`
    assert syncs(tiny_moe())
    assert syncs(tiny_moe(moe_expert_capacity_factor=1.0))      # dropping without padding still syncs
    assert not syncs(tiny_moe(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True))


def _gpt_oss_like(**kw):
    """tiny_moe's shape with GPT-OSS's expert kernels: quick-GEGLU (gated: fc1 is h -> 2f), linear biases, the clamp."""
    from search.spec.model import ModelSpec
    base = tiny_moe().model_dump()
    base.update(name="tiny-gpt-oss", activation="quick_geglu", add_bias_linear=True, glu_linear_offset=1.0,
                activation_func_clamp_value=7.0)
    base.update(kw)
    return ModelSpec(**base)


def test_gpt_oss_experts_by_hand():
    """b 1, s 1024, tp 1, ep 4, etp 1, flat H100 kernels, grouped GEMM: against tiny_moe's gelu experts, GPT-OSS's
    cost (a) fc1 of width 2f (quick-GEGLU is gated, as SwiGLU), (b) the fused gated activation's 3 dt m f (read 2f,
    write f) for gelu's 2, (c) megatron-core's TEGroupedMLP._apply_bias: (24 + 2 dt) bytes per fc2 output element
    forward, (32 + 4 dt) backward, (d) the clamp and cat before weighted_bias_quick_geglu_impl: 8 dt per m x f
    element forward, 6 dt backward (the moe_act recompute re-runs the clamp, not the bias)."""
    from search.costmodel.kernels import GPU_EFFICIENCY, LAUNCH_MS
    cl = parse_cluster("1x8-h100")
    e = GPU_EFFICIENCY["h100"]
    peak, hbm = 989e9, 3350e6

    def grouped(flops):
        return flops / (peak * e.bmm) + LAUNCH_MS

    def mem(nbytes):
        return nbytes / (hbm * e.mem) + LAUNCH_MS

    T, h, E, k, f, dt, ep = 1024, 1024, 8, 2, 512, 2, 4
    m = T * k                                  # tokens at this rank's 2 local experts (m_e = 1024 each)
    costs = {}
    for name, model in (("gelu", tiny_moe()), ("oss", _gpt_oss_like())):
        src = AnalyticSource(model, cl, TrainingSpec(global_batch_size=8), CommModel(cl), kernels="flat")
        costs[name] = moe_unit(src, 1.0, 1024, 1, False, ep, 1, MoEPlanSettings())[0]
    fc1 = grouped(2 * m * (2 * f) * h) - grouped(2 * m * f * h)
    act = mem(3 * dt * m * f) - mem(2 * dt * m * f)
    bias_f, bias_b = mem((24 + 2 * dt) * m * h), mem((32 + 4 * dt) * m * h)
    clamp_f, clamp_b = mem(8 * dt * m * f), mem(6 * dt * m * f)
    assert costs["oss"].fwd - costs["gelu"].fwd == pytest.approx(fc1 + act + bias_f + clamp_f, rel=1e-9)
    # backward: the GEMMs' two gradients (flat: 2x the forward FLOPs), the activation 1.5x its bytes
    fc1_b = grouped(2 * 2 * m * (2 * f) * h) - grouped(2 * 2 * m * f * h)
    act_b = mem(1.5 * 3 * dt * m * f) - mem(1.5 * 2 * dt * m * f)
    assert costs["oss"].bwd - costs["gelu"].bwd == pytest.approx(fc1_b + act_b + bias_b + clamp_b, rel=1e-9)
    assert costs["oss"].rec_sel == pytest.approx(mem(3 * dt * m * f) + clamp_f, rel=1e-9)
    # without the clamp and the biases, quick-GEGLU's experts cost what SwiGLU's do (the same gated shapes)
    plain = AnalyticSource(_gpt_oss_like(add_bias_linear=False, activation_func_clamp_value=None), cl,
                           TrainingSpec(global_batch_size=8), CommModel(cl), kernels="flat")
    swiglu = AnalyticSource(_gpt_oss_like(add_bias_linear=False, activation_func_clamp_value=None,
                                          glu_linear_offset=None, activation="swiglu"), cl,
                            TrainingSpec(global_batch_size=8), CommModel(cl), kernels="flat")
    a, b = (moe_unit(s, 1.0, 1024, 1, False, ep, 1, MoEPlanSettings())[0] for s in (plain, swiglu))
    assert (a.fwd, a.bwd) == pytest.approx((b.fwd, b.bwd), rel=1e-12)
