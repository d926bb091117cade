"""``patches/expert_bias_out_of_place``: a biased expert (GPT-OSS's) adds its fc2 bias, scaled by the token's routing
probability, out of place. Without the patch megatron-core's own ``MLP.forward`` raises under autograd (its in-place
add on the output of ``_ReduceFromModelParallelRegion``); under ``no_grad``, where autograd allows that add, the
patched forward equals the original bit for bit; with autograd it equals the sum written out,
``fc2(act(fc1(x)) p) + b2 p`` (``act`` the clamped quick GEGLU with its offset, ``p`` the routing probability), and so
do its gradients."""

from __future__ import annotations

import pytest
import torch

from tests.runtime.test_gpt_oss_runtime import OSS_MOE
from tests.runtime.test_yarn_runtime import _plan



@pytest.fixture(scope="module")
def expert():
    """An expert MLP of the runtime's first MoE layer (the patch applied by ``build_runtime``) and the original
    ``MLP.forward``."""
    from megatron.core.transformer.mlp import MLP

    from aceso_megatron.testing import free_port
    from aceso_megatron.testing.reference import init_single_process
    from aceso_megatron.training.engine import build_runtime

    init_single_process(free_port())
    rt = build_runtime(_plan(OSS_MOE), 0, 1, seed=7)
    mlp = next(m for name, m in rt.stage_module.named_modules() if isinstance(m, MLP) and ".experts." in name)
    assert mlp.linear_fc2.bias is not None and MLP.forward is not MLP.forward.__wrapped__   # patched
    return mlp, MLP.forward.__wrapped__


def _inputs(mlp, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(6, OSS_MOE.hidden_size, generator=g, requires_grad=True)
    p = torch.rand(6, generator=g, requires_grad=True)
    return x, p


def test_megatron_core_alone_raises_under_autograd(expert):
    mlp, original = expert
    x, p = _inputs(mlp)
    with pytest.raises(RuntimeError, match="modified inplace"):
        original(mlp, x, p)


def test_equal_to_the_original_where_autograd_allows_it(expert):
    mlp, original = expert
    x, p = _inputs(mlp)
    with torch.no_grad():
        want, want_bias = original(mlp, x, p)
        got, got_bias = mlp(x, p)
    assert want_bias is None and got_bias is None
    assert torch.equal(got, want)


def test_equal_to_the_sum_written_out_with_its_gradients(expert):
    mlp, _ = expert
    x, p = _inputs(mlp, seed=1)
    got, bias = mlp(x, p)
    assert bias is None
    w1, b1 = mlp.linear_fc1.weight, mlp.linear_fc1.bias
    w2, b2 = mlp.linear_fc2.weight, mlp.linear_fc2.bias
    c, off = OSS_MOE.activation_func_clamp_value, OSS_MOE.glu_linear_offset
    gate, lin = (x @ w1.t() + b1).chunk(2, dim=-1)
    gate, lin = gate.clamp(max=c), lin.clamp(-c, c)
    h = gate * torch.sigmoid(1.702 * gate) * (lin + off) * p.unsqueeze(-1)
    want = h @ w2.t() + b2 * p.unsqueeze(-1)
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-7)
    upstream = torch.randn_like(got)
    params = [x, p, w1, b1, w2, b2]
    g_got = torch.autograd.grad(got, params, upstream)
    g_want = torch.autograd.grad(want, params, upstream)
    for name, a, b in zip(("x", "p", "w1", "b1", "w2", "b2"), g_got, g_want):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7), name
    assert g_got[-1].abs().min() > 0           # the bias is trained
