"""The MoE time terms fitted on the published runs (docs/costmodel.md "MoE calibration") against hand-computed
cases: the quantized grouped GEMM's per-tile fixed cost (``1 + K0 / k`` on each GEMM's own inner depth), whether a
dispatcher synchronises with the host (megatron-core 0.16.1: dropless yes, padded to capacity no), and the
host-bound layer (forward = max(device, host) when synchronised; max over forward + backward when not)."""

import pytest

from search.cluster import parse_cluster
from search.costmodel.analytic import AnalyticSource
from search.costmodel.comm import CommModel
from search.costmodel.kernels import ShapeKernels
from search.costmodel.moe_cost import HOST_FWD_MS, host_bound, moe_unit, syncs
from search.costmodel.moe_primitives import grouped_gemm_bwd_ms, grouped_gemm_ms
from search.moe_plan import MoEPlanSettings
from search.training import TrainingSpec
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


def test_host_bound_by_hand():
    dropless, padded = tiny_moe(), tiny_moe(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True)
    # synchronised: the forward alone against the host time
    assert host_bound(dropless, 1.0, 10.0) == pytest.approx(HOST_FWD_MS - 1.0)
    assert host_bound(dropless, HOST_FWD_MS + 1, 0.0) == 0.0
    # not synchronised: forward + backward together
    assert host_bound(padded, 1.0, 1.5) == pytest.approx(max(0.0, HOST_FWD_MS - 2.5))
    assert host_bound(padded, 1.0, HOST_FWD_MS) == 0.0


def test_unit_table_adds_the_host_wait_to_each_moe_layer():
    """A tiny dropless layer on an H100 is host-bound: its moe unit's forward in the table is the kernels' time
    plus HOST_FWD_MS - (attention + moe forward); padded, the wait is against the whole layer's fwd + bwd."""
    cl = parse_cluster("1x8-h100")
    for m in (tiny_moe(), tiny_moe(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True)):
        src = AnalyticSource(m, cl, TrainingSpec(global_batch_size=8), CommModel(cl), kernels="flat")
        table = src.unit_table(1.0, 1, ep=4, etp=1, moe=MoEPlanSettings())
        att = src.attention(1.0, 1024, 1)
        moe, *_ = moe_unit(src, 1.0, 1024, 1, False, 4, 1, MoEPlanSettings())
        device = att.fwd + moe.fwd + (0.0 if syncs(m) else att.bwd + moe.bwd)
        assert HOST_FWD_MS > device                         # the case under test: the host is the longer
        kinds = [u.kind for u in m.units]
        i = kinds.index("moe")
        assert kinds[i - 1] == "attention"
        assert table.fwd_ms[i] == pytest.approx(moe.fwd + HOST_FWD_MS - device, rel=1e-9)
        assert table.bwd_ms[i] == pytest.approx(moe.bwd, rel=1e-9)
        assert table.fwd_ms[i - 1] == pytest.approx(att.fwd, rel=1e-9)
        assert table.recompute_ms[i, 2] == pytest.approx(table.fwd_ms[i], rel=1e-9)   # full recompute re-waits
