"""What tensor parallelism costs the MTP layer's ``eh_proj`` (megatron-core 0.19.2 transformer/
multi_token_prediction.py ``MultiTokenPredictionLayer._concat_embeddings``: a column-parallel 2h -> h / t linear,
an all-gather along the hidden dimension, with SP a local slice of the sequence) against hand-written formulas,
with the datasheet constants of tests/unit/test_moe_cost.py (H100 989 TFLOP/s bf16, NVLink 450 GB/s at 80%, 3 us
per ring step; NCCL's 16 channel SMs of H100's 132 as the overlap tax) and the flat kernel model, never by calling
the code under test for the expected number."""

from __future__ import annotations

import pytest

from search.spec.cluster import parse_cluster
from search.costmodel.analytic import AnalyticSource
from search.costmodel.comm import CommModel
from search.costmodel.kernels import GPU_EFFICIENCY, LAUNCH_MS
from search.costmodel.mla_mtp import eh_proj_tp
from search.settings.moe_plan import MoEPlanSettings
from search.spec.model import ModelSpec
from search.spec.training import TrainingSpec

PEAK, NVLINK, ALPHA, TAX = 989e9, 450e6 * 0.8, 0.003, 16 / 132
S, H, DT = 1024, 1024, 2


def _model() -> ModelSpec:
    moe = {"num_experts": 8, "moe_router_topk": 2, "moe_ffn_hidden_size": 512}
    return ModelSpec(name="mtp", family="llama", num_layers=2, hidden_size=H, num_attention_heads=8,
                     ffn_hidden_size=2048, seq_length=S, vocab_size=32000, activation="gelu", normalization="rmsnorm",
                     position_embedding="rope", add_bias_linear=False, tied_embeddings=False, params_dtype="bf16",
                     moe=moe, mtp_num_layers=1)


def _src(m):
    cl = parse_cluster("1x8-h100")
    return AnalyticSource(m, cl, TrainingSpec(global_batch_size=8), CommModel(cl), kernels="flat")


def _gather(nbytes: float) -> float:       # all-gather / reduce-scatter of a full tensor over 2 NVLink ranks
    return ALPHA + nbytes / 2 / NVLINK


def test_eh_proj_tp_by_hand():
    """tp 2, b 1, s 1024, X = dt s h. SP: forward the 2h-wide input's all-gather and the hidden all-gather; backward
    the slice's gradient all-gather (blocking), the input re-gather behind the input-gradient GEMM and the
    input-gradient reduce-scatter behind the weight-gradient GEMM (each GEMM 2 s (h/2) 2h flops, flat). Without SP:
    forward the hidden all-gather, backward the input-gradient all-reduce behind the weight-gradient GEMM."""
    x = DT * S * H
    g = 2 * S * (H / 2) * (2 * H) / (PEAK * GPU_EFFICIENCY["h100"].gemm) + LAUNCH_MS
    src = _src(_model())
    sp = eh_proj_tp(src, 1.0, S, 2, True)
    assert sp.fwd == pytest.approx(_gather(2 * x) + _gather(x), rel=1e-12)
    hid = min(_gather(2 * x), g) + min(_gather(2 * x), g)
    assert sp.bwd == pytest.approx(_gather(x) + 2 * max(0.0, _gather(2 * x) - g) + TAX * hid, rel=1e-12)
    assert sp.hidden == pytest.approx(hid, rel=1e-12)
    no_sp = eh_proj_tp(src, 1.0, S, 2, False)
    reduce = 2 * ALPHA + 2 * x / NVLINK                  # ring all-reduce of 2X over 2 ranks
    assert no_sp.fwd == pytest.approx(_gather(x), rel=1e-12)
    assert no_sp.bwd == pytest.approx(max(0.0, reduce - g) + TAX * min(reduce, g), rel=1e-12)
    assert eh_proj_tp(src, 1.0, S, 1, False) == (0.0, 0.0, 0.0, 0.0)


def test_the_mtp_unit_carries_eh_proj_collectives():
    """On the unit table (tp 2, SP) the MTP unit's TP time is its inner layer's (priced like the decoder's last
    attention and MoE units) plus eh_proj's, the 2h-wide gathers included: the forward is
    AG(2X) + AG(X), not a TP half's AG(X) + RS(X)."""
    m = _model()
    tab = _src(m).unit_table(1.0, 2, sp=True, ep=4, etp=1, moe=MoEPlanSettings())
    kinds = [u.kind for u in m.units]
    mtp, moe, att = kinds.index("mtp"), len(kinds) - 2, len(kinds) - 3
    assert (kinds[att], kinds[moe]) == ("attention", "moe")
    x = DT * S * H
    g = 2 * S * (H / 2) * (2 * H) / (PEAK * GPU_EFFICIENCY["h100"].gemm) + LAUNCH_MS
    hid = 2 * min(_gather(2 * x), g)
    eh = _gather(2 * x) + _gather(x) + _gather(x) + 2 * max(0.0, _gather(2 * x) - g) + TAX * hid
    assert tab.tp_comm_ms[mtp] - tab.tp_comm_ms[att] - tab.tp_comm_ms[moe] == pytest.approx(eh, rel=1e-9)
    assert tab.tp_hidden_ms[mtp] - tab.tp_hidden_ms[att] - tab.tp_hidden_ms[moe] == pytest.approx(hid, rel=1e-9)
