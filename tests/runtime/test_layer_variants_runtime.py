"""The runtime and GPT-OSS's layer fields (search.layers.layer_variants): a sliding-window plan trains exactly as stock
megatron-core built with the same window (the window reaches every unit's config, each layer keeps its global
layer number, so the right layers are windowed) and the window changes the loss (it is applied). The softmax offset
and the clamped quick GEGLU: tests/runtime/test_gpt_oss_runtime.py."""

import pytest
import torch

from search.spec.model import ModelSpec

LLAMA = ModelSpec(name="tiny-swa", family="llama", num_layers=3, hidden_size=32, num_attention_heads=4,
                  num_query_groups=2, ffn_hidden_size=64, seq_length=16, vocab_size=128, params_dtype="fp32",
                  activation="swiglu", normalization="rmsnorm", position_embedding="rope", add_bias_linear=False,
                  tied_embeddings=False, window_size=[3, 0], window_attn_skip_freq=2)


def _plan(model, rc):
    n = model.num_units
    return {"model": model.model_dump(), "micro_batch_size": 2, "global_batch_size": 4,
            "stages": [{"num_gpus": 1, "tp": 1, "dp": 1, "start_unit": 0, "end_unit": n, "recompute": rc}]}


@pytest.fixture(scope="module")
def single_process():
    from aceso_megatron.testing import free_port
    from aceso_megatron.testing.reference import init_single_process

    init_single_process(free_port())


def test_sliding_window_plan_equals_stock_model(single_process):
    from aceso_megatron.testing import make_batches
    from aceso_megatron.testing.reference import Reference
    from aceso_megatron.training.engine import build_runtime

    rc = ["selective", "none", "full", "selective", "none", "none"]
    batches = make_batches(LLAMA, 2, 4, seed=5)
    rt = build_runtime(_plan(LLAMA, rc), 0, 1, seed=9)
    loss = rt.forward_backward(iter(batches))
    ref = Reference(LLAMA, seed=9)
    assert ref.forward_backward(batches) == pytest.approx(loss, rel=1e-6)
    want, got = ref.grads(), rt.full_grads()
    for k in want:
        assert torch.allclose(got[k], want[k], rtol=1e-5, atol=1e-7), k
    full = Reference(LLAMA.model_copy(update={"window_size": None, "window_attn_skip_freq": None}), seed=9)
    full.forward_backward(batches)
    qkv = "decoder.layers.0.self_attention.linear_qkv.weight"        # a windowed layer's gradient moves
    assert not torch.allclose(full.grads()[qkv], want[qkv], rtol=1e-2, atol=0), qkv
