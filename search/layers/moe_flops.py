"""Forward FLOPs per sample of the MLA attention, ``moe`` and ``mtp`` units (``ModelSpec.unit_forward_flops``).

2 FLOPs per multiply-add, as ``search.spec.model``; *active* FLOPs: a token runs ``moe_router_topk`` routed experts (and
the shared expert), so MFU of an MoE model is quoted against what its tokens compute, as DeepSeek and NVIDIA do.
Per sample of ``s`` tokens (h hidden, n heads, E experts, k top-k, f expert width, up = 2f for the gated SwiGLU and quick-GEGLU):

    MLA attention   q: 2s h ql + 2s ql n (dq + dr) (q_lora_rank ql; none: 2s h n (dq + dr)),
                    kv down 2s h (kvl + dr), kv up 2s kvl n (dq + dv), out 2s n dv h,
                    core 2 s^2 n (dq + dr) (Q K^T) + 2 s^2 n dv (P V): the full score matrix, as the dense units
                    (dq = qk_head_dim, dr = qk_pos_emb_head_dim, dv = v_head_dim;
                    megatron-core ``MLASelfAttention``)
    moe             router 2s h E + k x 2s (w up + f w) + shared expert 2s (h up_s + f_s h) (+ its sigmoid gate
                    2s h, ``moe_shared_expert_gate``), w = h; LatentMoE
                    (``moe_latent_size`` l): w = l and the two latent projections 2 x 2s h l
    mtp             eh_proj 2s (2h) h + the attention unit + the last layer's mlp / moe unit + its own logits
                    2 s h V (the output layer shared with the main model; megatron-core
                    ``MultiTokenPredictionLayer`` + ``process_mtp_loss``)
"""

from __future__ import annotations


def _mlp(m, s: int, ffn: int, width: int | None = None) -> float:
    up = 2 * ffn if m.gated_mlp else ffn
    w = width or m.hidden_size
    return 2.0 * s * (w * up + ffn * w)


def mla_flops(m, s: int) -> float:
    a, h, n = m.mla, m.hidden_size, m.num_attention_heads
    qk = a.qk_head_dim + a.qk_pos_emb_head_dim
    q = 2.0 * s * h * n * qk if a.q_lora_rank is None else 2.0 * s * (h * a.q_lora_rank + a.q_lora_rank * n * qk)
    kv = 2.0 * s * (h * (a.kv_lora_rank + a.qk_pos_emb_head_dim) + a.kv_lora_rank * n * (a.qk_head_dim + a.v_head_dim))
    out = 2.0 * s * n * a.v_head_dim * h
    core = 2.0 * s * s * n * qk + 2.0 * s * s * n * a.v_head_dim
    return q + kv + out + core


def moe_flops(m, s: int) -> float:
    e = m.moe
    shared = _mlp(m, s, e.moe_shared_expert_intermediate_size) if e.moe_shared_expert_intermediate_size else 0.0
    shared += 2.0 * s * m.hidden_size if e.moe_shared_expert_gate else 0.0     # its gate: one h -> 1 linear
    latent = 2 * 2.0 * s * m.hidden_size * e.moe_latent_size if e.moe_latent_size else 0.0
    return (2.0 * s * m.hidden_size * e.num_experts + latent + shared
            + e.moe_router_topk * _mlp(m, s, e.moe_ffn_hidden_size, e.moe_latent_size))


def mtp_flops(m, s: int) -> float:
    from search.layers.kind import mtp_inner_kinds
    att, last = mtp_inner_kinds(m)
    h = m.hidden_size
    return (2.0 * s * 2 * h * h + m.unit_forward_flops(att, s) + m.unit_forward_flops(last, s)
            + 2.0 * s * h * m.padded_vocab_size)

