"""One megatron-core ``MambaLayer`` on CPU under ``patches.mamba_cpu``, checked against independent references.

The layer is built from megatron-core's own local Mamba layer spec (``post_training.modelopt.mamba.model_specs``:
``MambaLayer`` with ``MambaMixer``, ``ColumnParallelLinear`` in_proj, ``RowParallelLinear`` out_proj, bias-dropout-
add) with its pre-norm ``Norm`` (which needs transformer-engine) swapped for megatron-core's torch norm. Checked:

- forward and backward against a hand-written Mamba-2 layer on the same weights whose scan is the step-by-step
  recurrence (``patches._mamba_ref.naive_scan``), not the chunked kernel under test;
- the parameters megatron-core allocates per TP rank against ``search.layers.mamba.params`` (a one-process stand-in
  TP group of size tp: construction only reads its size and rank);
- the bytes autograd keeps for backward in one mixer forward against ``search.layers.mamba.act_bytes``.

Imported by ``test_mamba_layer.py`` (megatron-core 0.16.1, Python 3.11) and run as a script under megatron-core 0.19.2
(``python tests/runtime/mamba_case.py`` with the repository on PYTHONPATH), printing one JSON line.
"""

from __future__ import annotations

import json

import torch
import torch.nn.functional as F

from search.layers.mamba import Mamba2Spec, act_bytes, fixed_act_bytes, params, tp_refusal

HIDDEN, SEQ, BATCH = 32, 20, 2
CASES = {   # Mamba2Spec fields; chunk 8 so SEQ spans several chunks with a partial one
    "expand-heads": {"mamba_state_dim": 8, "mamba_head_dim": 8, "mamba_num_groups": 2, "chunk_size": 8},
    "explicit-heads": {"mamba_state_dim": 4, "mamba_head_dim": 4, "mamba_num_groups": 4, "mamba_num_heads": 12,
                       "chunk_size": 8},
    "one-group": {"mamba_state_dim": 16, "mamba_head_dim": 16, "mamba_num_groups": 1, "mamba_num_heads": 2,
                  "chunk_size": 8},
}


class _Group:
    """A stand-in process group of a given size for building a TP shard in one process."""

    def __init__(self, size: int):
        self._size = size

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return 0


def setup(port: int) -> None:
    from aceso_megatron.testing.reference import init_single_process
    from patches import mamba_cpu

    mamba_cpu.apply()
    init_single_process(port)
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(1)


def layer_spec():
    from dataclasses import replace

    from megatron.core.post_training.modelopt.mamba.model_specs import get_mamba_stack_modelopt_spec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    spec = get_mamba_stack_modelopt_spec().submodules.mamba_layer
    return replace(spec, submodules=replace(spec.submodules, norm=WrappedTorchNorm))


def build(m: Mamba2Spec, tp: int = 1, dtype=torch.float32):
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, normalization="RMSNorm",
                            hidden_dropout=0.0, attention_dropout=0.0,
                            use_cpu_initialization=True, params_dtype=dtype, add_bias_linear=False,
                            bias_dropout_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False,
                            mamba_state_dim=m.mamba_state_dim, mamba_head_dim=m.mamba_head_dim,
                            mamba_num_groups=m.mamba_num_groups, mamba_num_heads=m.mamba_num_heads)
    if tp == 1:
        groups = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
    else:
        groups = ProcessGroupCollection(tp=_Group(tp), cp=_Group(1))
    spec = layer_spec()
    spec.submodules.mixer.params = {"chunk_size": m.chunk_size}
    torch.manual_seed(0)
    return build_module(spec, config=cfg, layer_number=1, pg_collection=groups)


def _param(layer, *names):
    named = dict(layer.named_parameters())
    return next(named[n] for n in names if n in named)


def reference(layer, x, m: Mamba2Spec):
    """A Mamba-2 layer written out from the weights: norm, in_proj, causal conv + SiLU, the SSM step by step,
    D skip, silu(z) gate, grouped RMSNorm, out_proj, residual."""
    from patches._mamba_ref import naive_scan

    mix = layer.mixer
    heads, p, g, n = mix.nheads, m.mamba_head_dim, m.mamba_num_groups, m.mamba_state_dim
    d_inner = heads * p
    hn = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-5) * _param(layer, "norm.weight")
    zxbcdt = hn @ _param(layer, "mixer.in_proj.weight").t()                    # (s, b, .)
    z, xbc, dt = torch.split(zxbcdt.transpose(0, 1), [d_inner, d_inner + 2 * g * n, heads], dim=-1)
    w = _param(layer, "mixer.conv1d.weight", "mixer.conv1d_weight")
    conv = F.conv1d(F.pad(xbc.transpose(1, 2), (w.shape[-1] - 1, 0)), w, _param(layer, "mixer.conv1d.bias",
                                                                                   "mixer.conv1d_bias"),
                    groups=w.shape[0])
    xs, B, C = torch.split(F.silu(conv).transpose(1, 2), [d_inner, g * n, g * n], dim=-1)
    b, s = xs.shape[:2]
    xs = xs.reshape(b, s, heads, p)
    step = F.softplus(dt + _param(layer, "mixer.dt_bias"))
    y, _ = naive_scan(xs, step, -torch.exp(_param(layer, "mixer.A_log")), B.reshape(b, s, g, n),
                      C.reshape(b, s, g, n))
    y = (y + xs * _param(layer, "mixer.D")[:, None]).reshape(b, s, d_inner) * F.silu(z)
    yg = y.reshape(b, s, g, d_inner // g)
    y = (yg * torch.rsqrt(yg.square().mean(-1, keepdim=True) + 1e-5)).reshape(b, s, d_inner)
    y = y * _param(layer, "mixer.norm.weight")
    return x + (y @ _param(layer, "mixer.out_proj.weight").t()).transpose(0, 1)


def check_forward_backward(name: str) -> dict:
    """Largest relative differences of output and gradients (megatron-core under the patch vs the reference)."""
    m = Mamba2Spec(**CASES[name])
    layer = build(m)
    x = torch.randn(SEQ, BATCH, HIDDEN, requires_grad=True)
    out = layer(x)
    grad = torch.randn_like(out)
    out.backward(grad)
    ref_x = x.detach().clone().requires_grad_()
    ref = reference(layer, ref_x, m)
    wanted = [p for _, p in layer.named_parameters()]
    ref_grads = torch.autograd.grad(ref, [ref_x, *wanted], grad)

    def rel(a, b):
        return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))

    grads = {"input": rel(x.grad, ref_grads[0])}
    grads.update({n: rel(p.grad, r) for (n, p), r in zip(layer.named_parameters(), ref_grads[1:])})
    return {"output": rel(out.detach(), ref.detach()), "grads": grads}


def tp_sizes(name: str) -> list[int]:
    """The TP sizes megatron-core accepts for a case (whole heads and groups per rank)."""
    return [tp for tp in (1, 2, 4) if tp_refusal(Mamba2Spec(**CASES[name]), HIDDEN, tp) is None]


def check_params(name: str, tp: int) -> dict:
    m = Mamba2Spec(**CASES[name])
    layer = build(m, tp=tp)
    return {"megatron": sum(p.numel() for p in layer.parameters()), "formula": params(m, HIDDEN, tp=tp).total}


def check_act_bytes(name: str, dtype: str = "fp32") -> dict:
    """Bytes kept by one MambaMixer forward (its input included: in_proj keeps it) vs the formula."""
    from aceso_megatron.profiler.memory import SavedTensors

    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    m = Mamba2Spec(**CASES[name])
    mixer = build(m, dtype=torch_dtype).mixer
    x = torch.randn(SEQ, BATCH, HIDDEN, dtype=torch_dtype, requires_grad=True)
    with SavedTensors(params=list(mixer.parameters())) as saved:
        out, _ = mixer(x)
    kept = saved.nbytes
    out.sum().backward()    # the saved tensors are the ones backward reads
    per_token = act_bytes(m, HIDDEN, torch_dtype.itemsize).total
    return {"megatron": kept, "formula": per_token * SEQ * BATCH + fixed_act_bytes(m, HIDDEN, torch_dtype.itemsize)}


def main() -> None:
    from aceso_megatron.testing import free_port

    setup(free_port())
    result = {"version": __import__("megatron.core", fromlist=["package_info"]).package_info.__version__,
              "forward_backward": {n: check_forward_backward(n) for n in CASES},
              "params": {f"{n}/tp{tp}": check_params(n, tp) for n in CASES for tp in tp_sizes(n)},
              "act_bytes": {f"{n}/{d}": check_act_bytes(n, d) for n in CASES for d in ("fp32", "bf16")}}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
