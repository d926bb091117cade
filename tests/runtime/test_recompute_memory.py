"""Recompute choices free what the cost model says they free: the activations autograd keeps for backward after
one unit's forward, measured with saved-tensor hooks, against hand-computed sizes."""

from __future__ import annotations

import pytest
import torch

from search.model import ModelSpec

S, B, H, FFN = 16, 2, 32, 128
GPT = ModelSpec(name="t", family="gpt", num_layers=1, hidden_size=H, num_attention_heads=4, ffn_hidden_size=FFN,
                seq_length=S, vocab_size=128, params_dtype="fp32")


@pytest.fixture(scope="module")
def single_process():
    from aceso_megatron.reference import init_single_process
    from aceso_megatron.testing import free_port

    init_single_process(free_port())


def kept_bytes(model: ModelSpec, rc: str) -> tuple[int, torch.Tensor]:
    from aceso_megatron.engine import build_runtime
    from aceso_megatron.profiler.memory import SavedTensors

    raw = {"model": model.model_dump(), "micro_batch_size": B, "global_batch_size": B,
           "stages": [{"num_gpus": 1, "tp": 1, "dp": 1, "start_unit": 0, "end_unit": 2, "recompute": ["none", rc]}]}
    rt = build_runtime(raw, 0, 1, seed=1)
    mlp_unit = rt.stage_module.units[1]
    torch.manual_seed(0)
    x = torch.randn(S, B, H, requires_grad=True)
    with SavedTensors(exclude=[x], params=list(rt.stage_module.parameters())) as saved:
        out = mlp_unit(x)
    out = out[0] if isinstance(out, tuple) else out
    kept = saved.nbytes
    out.square().sum().backward()
    return kept, x.grad


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_selective_mlp_frees_the_activation_output_and_keeps_gradients(single_process, activation):
    model = GPT.model_copy(update={"activation": activation, "add_bias_linear": activation == "gelu"})
    none, g_none = kept_bytes(model, "none")
    sel, g_sel = kept_bytes(model, "selective")
    full, g_full = kept_bytes(model, "full")
    act_out = S * B * FFN * 4  # the activation function's output, fp32, that selective recompute drops
    assert none - sel == act_out
    # the planner's activation model says the same (fp32, tp 1)
    from search.costmodel.memory import mlp_act_bytes

    a_none, a_sel, _ = mlp_act_bytes(model, b=B, s=S, t=1, dt=4.0)
    assert a_none - a_sel == act_out
    if activation == "swiglu":  # the f-wide tensors kept beyond a gelu MLP's, measured and modelled
        gelu = GPT.model_copy(update={"add_bias_linear": False})
        gelu_none, _, _ = mlp_act_bytes(gelu, b=B, s=S, t=1, dt=4.0)
        assert none - kept_bytes(gelu, "none")[0] == a_none - gelu_none == 3 * act_out
    assert full == 0  # only the unit input is kept (excluded here: it is the previous unit's output)
    torch.testing.assert_close(g_sel, g_none, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(g_full, g_none, rtol=1e-6, atol=1e-7)
