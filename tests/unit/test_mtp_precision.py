"""The recipe an MTP depth runs under a low-precision plan, as megatron-core runs it (core_v0.16.1-0.19.0
transformer/multi_token_prediction.py; 0.17+ models/hybrid/hybrid_block.py): a GPT model's MTP layer under the fp8
context of the whole block (``get_fp8_context(config)``, layer_no -1, whatever the first / last bf16 layers) and no
fp4 context ("TODO: currently ignoring FP4 in MTP layers"); a hybrid model's MTP ``HybridStack`` under each inner
layer's fp8 or fp4 context. Its time and its cached quantized weights follow the same answer
(``settings.precision.unit_quantized``)."""

import pytest

from search.pricing import make_cost_model
from search.spec.cluster import parse_cluster
from search.spec.presets import load_model
from search.spec.training import TrainingSpec

# transformer-engine's weight cache in training, bytes per weight (rowwise and columnwise copies and their scales;
# tensor/mxfp8_tensor.py: uint8 data + an E8M0 scale per 32; tensor/nvfp4_tensor.py: packed FP4 + an E4M3 scale
# per 16), tile padding aside
TE_CACHE = {"mxfp8": 2 * (1 + 1 / 32), "nvfp4": 2 * (0.5 + 1 / 16)}


def _with_mtp(name: str, mtp):
    """The preset with ``mtp`` MTP depths (a hybrid pattern: '/' and Super's MTP layer, attention + MoE, per depth)."""
    d = load_model(name).model_dump()
    if d.get("hybrid_layer_pattern") and mtp:
        d["hybrid_layer_pattern"] += "/*E" * mtp
    return type(load_model(name)).model_validate({**d, "mtp_num_layers": mtp})


def _stage(m, precision: str, **tr):
    cm = make_cost_model(m, parse_cluster("1x8-b200"), TrainingSpec(global_batch_size=16, micro_batch_sizes=[2],
                                                                     precision=precision, **tr))
    st = cm.stage_cost(0, 1, 0, 0, m.num_units, tp=1, dp=1, recompute=[0] * m.num_units, micro_batch_size=2)
    return st.fwd_ms, st.memory_breakdown["params"]


def _mtp_delta(name: str, precision: str, **tr):
    """What one MTP depth adds to the stage: (forward ms, params-term MiB)."""
    (f0, p0), (f1, p1) = (_stage(_with_mtp(name, n), precision, **tr) for n in (None, 1))
    return f1 - f0, p1 - p0


def test_gpt_mtp_runs_nvfp4_plans_in_bf16():
    """No fp4 context around a GPT model's MTP layer: under NVFP4 it adds what it adds under bf16, its forward and
    its weights (no cached FP4 copies)."""
    f_bf, p_bf = _mtp_delta("llama3-8b", "bf16")
    f_nv, p_nv = _mtp_delta("llama3-8b", "nvfp4")
    assert f_nv == pytest.approx(f_bf, rel=1e-9) and p_nv == pytest.approx(p_bf, rel=1e-9)


def test_gpt_mtp_runs_fp8_recipes_quantized_and_caches_their_weights():
    """The fp8 context covers a GPT model's MTP layer: under MXFP8 it runs faster than under bf16 and each of its
    weights holds transformer-engine's MXFP8 cache beside the bf16 parameter."""
    f_bf, p_bf = _mtp_delta("llama3-8b", "bf16")
    f_mx, p_mx = _mtp_delta("llama3-8b", "mxfp8")
    weights = p_bf / 2                                  # MiB of bf16 parameters / 2 bytes: its parameter count
    assert f_mx < f_bf
    assert (p_mx - p_bf) / weights == pytest.approx(TE_CACHE["mxfp8"], rel=1e-6)


def test_gpt_mtp_is_quantized_whatever_the_last_layers_in_bf16():
    """``get_fp8_context(config)`` with layer_no -1 is never a first / last bf16 layer: keeping the decoder's last
    layer in bf16 leaves the MTP depth quantized (it was priced as that last layer, in bf16)."""
    plain = _mtp_delta("llama3-8b", "mxfp8")
    last_bf16 = _mtp_delta("llama3-8b", "mxfp8", bf16_layers_start=0, bf16_layers_end=1)
    assert last_bf16 == pytest.approx(plain, rel=1e-9)


def test_hybrid_mtp_runs_the_fp4_context_of_its_layers():
    """A hybrid model's MTP layer is a HybridStack whose layers enter get_fp4_context: under NVFP4 its weights hold
    the NVFP4 cache (and before, no MTP weight was charged a cache under any recipe)."""
    f_bf, p_bf = _mtp_delta("nemotron-3-nano", "bf16")
    f_nv, p_nv = _mtp_delta("nemotron-3-nano", "nvfp4")
    assert f_nv < f_bf
    assert (p_nv - p_bf) / (p_bf / 2) == pytest.approx(TE_CACHE["nvfp4"], rel=1e-6)
