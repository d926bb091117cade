"""The runtime builds what an imported Hugging Face model sets: Llama 3.1's RoPE scaling (``rope_scaling`` llama3)
and Qwen2's QKV bias (``megatron.add_qkv_bias``) train exactly as stock megatron-core's ``GPTModel`` built with them,
and the scaling is applied (its frequencies are Hugging Face's llama3 formula, computed here with numpy, and the
loss moves)."""

import math

import numpy as np
import pytest
import torch

from search.spec.model import ModelSpec

BASE = dict(name="tiny-llama31", family="llama", num_layers=2, hidden_size=64, num_attention_heads=4,
            num_query_groups=2, ffn_hidden_size=128, seq_length=32, vocab_size=128, params_dtype="fp32",
            activation="swiglu", normalization="rmsnorm", position_embedding="rope", add_bias_linear=False,
            tied_embeddings=False, rotary_base=500000.0)
SCALED = ModelSpec(**BASE, rope_scaling={"type": "llama3", "factor": 8.0})
QKV_BIAS = ModelSpec(**{**BASE, "name": "tiny-qwen2"}, megatron={"add_qkv_bias": True, "layernorm_epsilon": 1e-6})


def _plan(model):
    return {"model": model.model_dump(), "micro_batch_size": 2, "global_batch_size": 4,
            "stages": [{"num_gpus": 1, "tp": 1, "dp": 1, "start_unit": 0, "end_unit": model.num_units,
                        "recompute": ["none"] * model.num_units}]}


@pytest.fixture(scope="module")
def single_process():
    from aceso_megatron.testing import free_port
    from aceso_megatron.testing.reference import init_single_process

    init_single_process(free_port())


def hf_llama3_inv_freq(dim: int, base: float, factor: float, low=1.0, high=4.0, old=8192) -> np.ndarray:
    """transformers' ``_compute_llama3_parameters`` (modeling_rope_utils.py), written out with numpy."""
    inv = 1.0 / base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    wavelen = 2 * math.pi / inv
    low_wavelen, high_wavelen = old / low, old / high
    scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled)


@pytest.mark.parametrize("model", [SCALED, QKV_BIAS], ids=["llama3-rope-scaling", "qkv-bias"])
def test_imported_fields_train_as_stock_megatron_core(single_process, model):
    from aceso_megatron.testing import make_batches
    from aceso_megatron.testing.reference import Reference
    from aceso_megatron.training.engine import build_runtime

    batches = make_batches(model, 2, 4, seed=3)
    rt = build_runtime(_plan(model), 0, 1, seed=7)
    loss = rt.forward_backward(iter(batches))
    ref = Reference(model, seed=7)
    assert ref.forward_backward(batches) == pytest.approx(loss, rel=1e-6)
    want, got = ref.grads(), rt.full_grads()
    assert set(got) == set(want)
    for k in want:
        assert torch.allclose(got[k], want[k], rtol=1e-5, atol=1e-7), k
    if model is QKV_BIAS:
        bias = "decoder.layers.0.self_attention.linear_qkv.bias"
        assert bias in got and sum(p.numel() for p in ref.gpt.parameters()) == model.num_parameters
        return
    inv = rt.stage_module.rotary_pos_emb.inv_freq.double().numpy()
    stock = ref.gpt.rotary_pos_emb.inv_freq.double().numpy()
    hf = hf_llama3_inv_freq(model.head_dim, model.rotary_base, 8.0)
    assert np.allclose(inv, hf, rtol=1e-6) and np.allclose(stock, hf, rtol=1e-6)
    plain = hf_llama3_inv_freq(model.head_dim, model.rotary_base, 1.0)
    assert not np.allclose(inv, plain, rtol=1e-3)                  # the scaling is applied (low frequencies / 8)
