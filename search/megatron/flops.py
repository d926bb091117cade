"""Megatron-LM's own FLOP count of a batch: what its ``--log-throughput`` TFLOP/s/GPU is (that count / the
iteration time / the world size), so that a log's throughput tells which model ran (``aceso calibrate``) and a
published TFLOP/s converts to a step time (bench/moe_published.py).

Megatron-LM core_v0.16.1, megatron/training/training.py ``num_floating_point_operations`` ->
``transformer_flops`` (GPT models; no hybrid Mamba or linear-attention layers here), per token of a batch of
``batch_size`` sequences of ``seq_length``, 3 x (forward, weight and input gradient) x 2 (multiply-add)::

    MLP       h (ffn x e x dense + moe_ffn x topk x e x moe + shared x e x moe),  e = 3 with --swiglu, else 2
              (dense / MoE layers by --moe-layer-freq; MTP layers count as the last layer's kind)
    attention per layer (all layers, MTP's included):
              GQA/MHA: h (q + 2k) + q s/2 x 2 (QK^T and PV over the causal half) + q h,  q = d n, k = d g
              MLA:     q_term + kvl (h + n (dq + dv) + 1) + h dr + n dv h + s n (dq + dr)/2 + s n dv / 2,
                       q_term = h n (dq + dr) without q_lora_rank, else ql (h + n (dq + dr) + 1)
    MTP       mtp (3 h + 2 h^2)   (norms and eh_proj)
    logits    h V (mtp + 1)       (V: the padded vocabulary)

Only ``--swiglu`` counts the gated MLP as 3 GEMMs (Megatron-LM's rule: ``--quick-geglu`` counts 2).

LatentMoE (``--moe-latent-size`` l): core_v0.16.1's ``transformer_flops`` counts the routed experts at the hidden
width as above (only its ``hybrid_flops`` knows l); from core_v0.17 (0.17.1, 0.18.2, 0.19.0 alike) it counts them
at the latent width plus the latent up / down projections: ``h (moe_ffn x topk x e x l / h + 2 l)`` per MoE layer
(``release``, default 0.16).
"""

from __future__ import annotations

LATENT_SINCE = (0, 17)      # transformer_flops counts --moe-latent-size


def num_floating_point_operations(m, batch_size: int, padded_vocab: int | None = None,
                                  release: tuple[int, int] = (0, 16)) -> float:
    """Megatron-LM core_v0.16.1's ``num_floating_point_operations(args, batch_size)`` for ``ModelSpec`` ``m``
    (``padded_vocab``: Megatron-LM's padded vocabulary, default ``m.padded_vocab_size``; ``release``: the
    Megatron-LM (major, minor) whose count, 0.17 on: LatentMoE's latent width)."""
    h, s, n = m.hidden_size, m.seq_length, m.num_attention_heads
    ffe = 3 if m.activation == "swiglu" else 2
    mtp = m.mtp_num_layers or 0
    e = m.moe
    if e is None:
        dense, moe_layers, topk, moe_ffn, shared = m.num_layers + mtp, 0, 0, 0, 0
    else:
        moe_layers = sum(e.is_moe_layer(i) for i in range(m.num_layers))
        last_moe = int(e.is_moe_layer(m.num_layers - 1))
        dense = m.num_layers - moe_layers + (1 - last_moe) * mtp
        moe_layers += last_moe * mtp
        topk, moe_ffn = e.moe_router_topk, e.moe_ffn_hidden_size or m.ffn_hidden_size
        shared = e.moe_shared_expert_intermediate_size or 0
    routed = moe_ffn * topk * ffe
    if e is not None and e.moe_latent_size and release >= LATENT_SINCE:
        routed = routed * e.moe_latent_size / h + 2 * e.moe_latent_size
    if m.mla is not None:
        a = m.mla
        qk = a.qk_head_dim + a.qk_pos_emb_head_dim
        q_term = h * n * qk if a.q_lora_rank is None else a.q_lora_rank * (h + n * qk + 1)
        attn = 6 * (q_term + a.kv_lora_rank * (h + n * (a.qk_head_dim + a.v_head_dim) + 1)
                    + h * a.qk_pos_emb_head_dim + n * a.v_head_dim * h + s * n * qk / 2 + s * n * a.v_head_dim / 2)
    else:
        q, k = m.head_dim * n, m.head_dim * m.groups
        attn = 6 * (h * (q + 2 * k) + q * s / 2 * 2 + q * h)
    vocab = padded_vocab or m.padded_vocab_size
    per_token = (6 * h * (m.ffn_hidden_size * ffe * dense + routed * moe_layers
                          + shared * ffe * moe_layers)
                 + attn * (m.num_layers + mtp) + 6 * mtp * (3 * h + 2 * h * h)
                 + 6 * h * vocab * (mtp + 1))
    return batch_size * s * per_token
