"""Run by tests/runtime/test_gdn_cpu.py under megatron-core 0.19 (its Python 3.12 environment, the repository on
PYTHONPATH): megatron-core's own GDN layer (``model_specs.builders.gdn_layer_spec``: ``TransformerLayer`` with
``GatedDeltaNet``, local linears and norms) on CPU under ``patches.gdn_cpu``, forward and backward, against a GDN
layer written out from the same weights whose rule is the token-by-token recurrence
(``patches._gdn_ref.naive_recurrent``), not the chunked kernel under test, and whose conv and norms are written
with torch's own ops. Prints one JSON line: per case, the largest relative difference of the output and of each
gradient, and the patch's swaps undone by ``revert()``."""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.nn.functional as F

HIDDEN, SEQ, BATCH = 32, 20, 2
CASES = {   # GDNSpec fields: grouped heads (2 value heads per key head) in fla's one chunk of 64, and one value head
    # per key head in chunks of 8 (the rule's chunk size: patches._gdn_ref.CHUNK)
    "grouped": {"linear_key_head_dim": 8, "linear_value_head_dim": 6, "linear_num_key_heads": 2,
                "linear_num_value_heads": 4, "linear_conv_kernel_dim": 4},
    "square-chunks-of-8": {"linear_key_head_dim": 4, "linear_value_head_dim": 4, "linear_num_key_heads": 3,
               "linear_num_value_heads": 3, "linear_conv_kernel_dim": 2},
}


def _model(fields: dict):
    from search.spec.model import ModelSpec

    return ModelSpec(name="g", family="llama", num_layers=2, hidden_size=HIDDEN, num_attention_heads=4,
                     ffn_hidden_size=48, seq_length=SEQ, vocab_size=128, activation="swiglu", normalization="rmsnorm",
                     position_embedding="rope", add_bias_linear=False, params_dtype="fp32",
                     hybrid_layer_pattern="G-", gdn=fields)


def build(model):
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    from model_specs.builders import architecture_kwargs, gdn_layer_spec

    cfg = TransformerConfig(**architecture_kwargs(model), hidden_dropout=0.0, attention_dropout=0.0,
                            use_cpu_initialization=True, bias_dropout_fusion=False, persist_layer_norm=False,
                            gradient_accumulation_fusion=False)
    torch.manual_seed(0)
    layer = build_module(gdn_layer_spec(model, te=False), config=cfg, layer_number=1,
                         pg_collection=ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"]))
    with torch.no_grad():       # megatron-core's init leaves A_log, dt_bias and the norms at constants: vary them
        for p in layer.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return layer


def reference(layer, x, g):
    """The GDN layer from its definition: RMS pre-norm, in_proj -> q, k, v, z, b, a; causal depthwise conv + SiLU
    over q, k, v; L2-normalised q, k repeated to the value heads; decay ``-exp(A_log) softplus(a + dt_bias)``, write
    strength ``sigmoid(b)``; the recurrence; per-head RMSNorm gated by silu(z); out_proj; residual."""
    from patches._gdn_ref import naive_recurrent

    p = dict(layer.named_parameters())
    hk, hv, dk, dv = g.linear_num_key_heads, g.linear_num_value_heads, g.linear_key_head_dim, g.linear_value_head_dim
    hn = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-5) * p["input_layernorm.weight"]
    proj = (hn @ p["self_attention.in_proj.weight"].t()).transpose(0, 1)           # (b, s, .)
    q, k, v, z, b, a = torch.split(proj, [hk * dk, hk * dk, hv * dv, hv * dv, hv, hv], dim=-1)
    qkv = torch.cat([q, k, v], -1).transpose(1, 2)
    w = p["self_attention.conv1d.weight"]
    qkv = F.silu(F.conv1d(F.pad(qkv, (w.shape[-1] - 1, 0)), w, groups=w.shape[0])).transpose(1, 2)
    q, k, v = torch.split(qkv, [hk * dk, hk * dk, hv * dv], dim=-1)
    bs, s = q.shape[:2]
    q, k = (t.reshape(bs, s, hk, dk) for t in (q, k))
    q, k = (t / torch.sqrt(t.square().sum(-1, keepdim=True) + 1e-6) for t in (q, k))
    q, k = (t.repeat_interleave(hv // hk, dim=2) for t in (q, k))
    decay = -p["self_attention.A_log"].exp() * F.softplus(a + p["self_attention.dt_bias"])
    o, _ = naive_recurrent(q, k, v.reshape(bs, s, hv, dv), decay, torch.sigmoid(b))
    o = o * torch.rsqrt(o.square().mean(-1, keepdim=True) + 1e-5) * p["self_attention.out_norm.weight"]
    o = (o * F.silu(z.reshape(bs, s, hv, dv))).reshape(bs, s, hv * dv)
    return x + (o @ p["self_attention.out_proj.weight"].t()).transpose(0, 1)


def check(name: str) -> dict:
    from patches import _gdn_ref
    from search.layers.gdn import GDNSpec

    _gdn_ref.CHUNK = 8 if name.endswith("chunks-of-8") else 64     # SEQ 20: 3 chunks, a partial one; or 1 chunk
    model = _model(CASES[name])
    layer = build(model)
    x = torch.randn(SEQ, BATCH, HIDDEN, requires_grad=True)
    out, _ = layer(x, attention_mask=None)
    grad = torch.randn_like(out)
    out.backward(grad)
    ref_x = x.detach().clone().requires_grad_()
    named = list(layer.named_parameters())
    ref = reference(layer, ref_x, GDNSpec(**CASES[name]))
    ref_grads = torch.autograd.grad(ref, [ref_x, *(p for _, p in named)], grad)

    def rel(a, b):
        return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))

    diffs = {"output": rel(out, ref), "input": rel(x.grad, ref_grads[0])}
    diffs.update({n: rel(p.grad, r) for (n, p), r in zip(named, ref_grads[1:])})
    return diffs


def main() -> None:
    from aceso_megatron.testing.reference import init_single_process
    from megatron.core.ssm.gated_delta_net import common, gdn
    from patches import gdn_cpu

    gdn_cpu.apply()
    init_single_process(29500 + os.getpid() % 1000)
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(1)
    result = {"cases": {name: check(name) for name in CASES}}
    gdn_cpu.revert()
    result["reverted"] = (common.HAVE_FLA is False and gdn.chunk_gated_delta_rule is None
                          and common.l2norm is None and not gdn_cpu.is_applied())
    print(json.dumps(result))


if __name__ == "__main__":
    sys.exit(main())
