"""Parameter counts of MoE / MLA / MTP models, module by module as megatron-core 0.16.1 allocates them.

Per decoder layer (``get_gpt_decoder_block_spec`` with local modules): the input norm and the attention (standard
QKV, or MLA's down/up projections with its q/kv latent norms), the pre-MLP norm and then either the dense MLP
(``ffn_hidden_size``) or the MoE block: router weight ``num_experts x h`` (+ bias with ``add_bias_linear``; the
DeepSeek expert bias is a buffer, not a parameter), ``num_experts`` expert MLPs of ``moe_ffn_hidden_size`` and the
shared expert of ``moe_shared_expert_intermediate_size`` (with ``moe_shared_expert_gate`` its 1 x h gate weight);
LatentMoE (``moe_latent_size`` l, megatron-core 0.19
``MoELayer``): ``fc1_latent_proj`` h -> l and ``fc2_latent_proj`` l -> h (TE linears, duplicated over TP) and
routed experts of l -> f -> l (``expert_width``). An MTP layer (``MultiTokenPredictionLayer``) adds two
norms (``enorm``, ``hnorm``), the ``eh_proj`` linear ``2h -> h``, one transformer layer like the last decoder layer
and its final norm; it shares the embedding and output layer with the main model. With ``mtp_use_repeated_layer``
(megatron-core 0.19 ``MultiTokenPredictionBlock``) one MTP layer is built and run at every depth: its parameters
count once.

*Active* parameters are the ones a token runs through (how DeepSeek, Qwen and Mistral quote "activated"): every
parameter except the ``num_experts - moe_router_topk`` routed experts a token skips in each MoE layer; embedding
and output layer included. ``tests/runtime/test_moe_params.py`` checks the totals against megatron-core's own
modules, ``tests/unit/test_moe.py`` against the published sizes.
"""

from __future__ import annotations

from typing import NamedTuple


class MoECounts(NamedTuple):
    """Whole-model counts (unsharded)."""

    total: int
    active: int
    mtp: int                 # inside total: the MTP layers (their share of the embedding/output not counted)
    experts_per_layer: int   # routed experts of one MoE layer, all of them
    router_per_layer: int
    shared_expert_per_layer: int


def _norm(m, width: int) -> int:
    return width * (2 if m.normalization == "layernorm" else 1)


def _qk_layernorm(m) -> bool:
    return bool((m.megatron or {}).get("qk_layernorm", False))


def _linear(m, n_in: int, n_out: int, bias: bool | None = None) -> int:
    return n_in * n_out + (n_out if (m.add_bias_linear if bias is None else bias) else 0)


def mla_params(m) -> int:
    """MLA self-attention of one layer, its input norm included (``MLASelfAttention``)."""
    a, h, n = m.mla, m.hidden_size, m.num_attention_heads
    qk = a.qk_head_dim + a.qk_pos_emb_head_dim
    norms = _qk_layernorm(m)
    if a.q_lora_rank is None:
        q = _linear(m, h, n * qk)
    else:
        q = _linear(m, h, a.q_lora_rank) + _linear(m, a.q_lora_rank, n * qk)
        q += _norm(m, a.q_lora_rank) if norms else 0
    kv = _linear(m, h, a.kv_lora_rank + a.qk_pos_emb_head_dim) + _linear(m, a.kv_lora_rank, n * (a.qk_head_dim +
                                                                                                 a.v_head_dim))
    kv += _norm(m, a.kv_lora_rank) if norms else 0
    return q + kv + _linear(m, n * a.v_head_dim, h) + _norm(m, h)


def attention_params(m) -> int:
    """Self-attention of one layer with its input norm: MLA, or the standard one (``ModelSpec.unit_params``, which
    holds the q/k norms when set: ``qk_norm_params``)."""
    if m.mla is not None:
        return mla_params(m)
    return m.unit_params("attention")


def mlp_params(m, ffn: int) -> int:
    """One MLP of inner width ``ffn`` (an expert, a shared expert or the dense MLP), without a norm."""
    up = 2 * ffn if m.gated_mlp else ffn
    return _linear(m, m.hidden_size, up) + _linear(m, ffn, m.hidden_size)


def expert_width(m) -> int:
    """The width a routed expert reads and writes and the token dispatcher moves: ``moe_latent_size`` (LatentMoE)
    or h."""
    return m.moe.moe_latent_size or m.hidden_size


def expert_params(m) -> int:
    """One routed expert: fc1 (w -> f, or 2f gated) and fc2 (f -> w) at ``expert_width`` w."""
    f, w = m.moe.moe_ffn_hidden_size, expert_width(m)
    return _linear(m, w, 2 * f if m.gated_mlp else f) + _linear(m, f, w)


def latent_proj_params(m) -> int:
    """LatentMoE's ``fc1_latent_proj`` (h -> l) and ``fc2_latent_proj`` (l -> h) of one MoE layer (0 without)."""
    l = m.moe.moe_latent_size
    return _linear(m, m.hidden_size, l) + _linear(m, l, m.hidden_size) if l else 0


def mtp_stored_depths(m) -> int:
    """MTP layers whose weights exist: one with ``mtp_use_repeated_layer``, else one per depth."""
    return min(m.mtp_num_layers or 0, 1) if m.mtp_use_repeated_layer else (m.mtp_num_layers or 0)


def router_params(m) -> int:
    return m.moe.num_experts * m.hidden_size + (m.moe.num_experts if m.add_bias_linear else 0)


def shared_expert_params(m) -> int:
    """The shared expert's MLP and its sigmoid gate (``shared_expert_gate_params``)."""
    size = m.moe.moe_shared_expert_intermediate_size
    return mlp_params(m, size) + shared_expert_gate_params(m) if size else 0


def shared_expert_gate_params(m) -> int:
    """The shared expert's sigmoid gate: megatron-core's ``SharedExpertMLP.gate_weight``, a plain (1, h) parameter
    whole on every TP rank (0.16.1 to 0.19.2; 0 without the gate or the shared expert)."""
    e = m.moe
    return m.hidden_size if e.moe_shared_expert_gate and e.moe_shared_expert_intermediate_size else 0


def layer_mlp_params(m, layer: int) -> tuple[int, int]:
    """(total, active) of layer ``layer``'s MLP half, its pre-MLP norm included."""
    norm = _norm(m, m.hidden_size)
    if m.moe is None or not m.moe.is_moe_layer(layer):
        n = mlp_params(m, m.ffn_hidden_size) + norm
        return n, n
    e = expert_params(m)
    common = router_params(m) + shared_expert_params(m) + latent_proj_params(m) + norm
    return common + m.moe.num_experts * e, common + m.moe.moe_router_topk * e


def mtp_layer_params(m) -> tuple[int, int]:
    """(total, active) of one MTP layer: enorm, hnorm, eh_proj (no bias), a layer like the last decoder layer,
    its final norm."""
    from search.layers.kind import mtp_inner_kinds
    a, f = mtp_inner_kinds(m)
    att = attention_params(m) if a == "attention" else m.unit_params(a)
    if m.hybrid_layer_pattern and f != "moe":      # a hybrid's MTP depth names its MLP half ('*-')
        tot = act = m.unit_params(f)
    else:
        tot, act = layer_mlp_params(m, m.num_layers - 1)
    own = 3 * _norm(m, m.hidden_size) + 2 * m.hidden_size * m.hidden_size
    return own + att + tot, own + att + act


def counts(m) -> MoECounts:
    """Total and active parameters of a decoder-only ``ModelSpec`` with or without MoE / MLA / MTP."""
    total = active = m.embedding_params() + m.output_params()
    att = attention_params(m)
    for layer in range(m.num_layers):
        tot, act = layer_mlp_params(m, layer)
        total, active = total + att + tot, active + att + act
    mtp = 0
    if m.mtp_num_layers:
        tot, act = mtp_layer_params(m)
        mtp = mtp_stored_depths(m) * tot
        total, active = total + mtp, active + mtp_stored_depths(m) * act
    if m.moe is None:
        return MoECounts(total, active, mtp, 0, 0, 0)
    return MoECounts(total, active, mtp, m.moe.num_experts * expert_params(m),
                     router_params(m), shared_expert_params(m))


def moe_unit_params(m) -> int:
    """All parameters of one ``moe`` unit (an MoE layer's MLP half): pre-MLP norm, router, routed and shared
    experts, LatentMoE's projections."""
    return (router_params(m) + shared_expert_params(m) + latent_proj_params(m) + _norm(m, m.hidden_size)
            + m.moe.num_experts * expert_params(m))

