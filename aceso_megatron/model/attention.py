"""The ``attn_dropout`` recompute choice: the attention-probability dropout and the probs x V product of an
attention (or cross-attention) unit run again in backward.

megatron-core's unfused ``DotProductAttention.forward`` keeps for backward Q and K (for the scores), the softmax
output, the dropout mask, and the dropped probabilities and V (for the probs x V product). Here the dropout and
the product run under megatron-core's ``tensor_parallel.checkpoint``: its inputs, the softmax output (kept by the
softmax anyway) and V, are kept; the mask and the dropped probabilities are not, per attention unit
``b * heads/tp * s_q * s_k`` elements of each (the mask: 1 byte on CUDA; on CPU torch's dropout keeps a noise
tensor of the activation dtype instead). The checkpoint saves and restores every RNG state (CPU, CUDA, the
rng tracker's), so the recomputed dropout draws the forward's mask; with ``attention_dropout == 0`` it frees
nothing and is still exact.

16-bit activations with the softmax in fp32 (megatron-core's default ``attention_softmax_in_fp32``): the softmax
keeps its fp32 output and upstream casts it back to 16 bits before the dropout. That cast moves into the
recomputed part too (the softmax module's 16-bit input flags are cleared and the scores cast to fp32 here, the
same ops as upstream), so the checkpoint keeps the fp32 output the softmax keeps anyway rather than a new 16-bit
copy.

``RecomputedDropoutAttention.forward`` mirrors ``DotProductAttention.forward`` of megatron-core 0.16.1 (the only
version it was checked against): the same ops in the same order, with the cast, the dropout and the product
moved into ``_dropout_value``. It is the unit spec's ``core_attention``, no patch. Transformer-engine's fused
attention keeps no mask or probabilities: there ``attn_dropout`` runs as ``none`` (``fall_back_with_te``, one
warning).
"""

from __future__ import annotations

import dataclasses
import logging

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.spec_utils import ModuleSpec

from search.spec.model import UnitKind

_ATTENTION = {"attention": "self_attention", "cross_attention": "cross_attention"}
log = logging.getLogger(__name__)


class RecomputedDropoutAttention(DotProductAttention):
    """``DotProductAttention`` whose dropout and probs x V product are recomputed in backward."""

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        self.upcast = (config.fp16 or config.bf16) and config.attention_softmax_in_fp32
        if self.upcast:  # fp32 scores in, fp32 probabilities out: the casts happen in forward / _dropout_value
            sm = self.scale_mask_softmax
            sm.input_in_fp16 = sm.input_in_bf16 = sm.input_in_float16 = False

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        assert packed_seq_params is None, "Packed sequence is not supported by DotProductAttention."
        assert attention_bias is None, "Attention bias is not supported for DotProductAttention."
        rep = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        if rep > 1:  # grouped-query attention: K and V repeated to the query heads
            key, value = key.repeat_interleave(rep, dim=2), value.repeat_interleave(rep, dim=2)
        sq, b, heads, sk = query.size(0), query.size(1), query.size(2), key.size(0)
        q = query.reshape(sq, b * heads, -1).transpose(0, 1)  # [b * np, sq, hn]
        k = key.view(sk, b * heads, -1).transpose(0, 1).transpose(1, 2)  # [b * np, hn, sk]
        buf = parallel_state.get_global_memory_buffer().get_tensor((b * heads, sq, sk), query.dtype, "mpu")
        scores = torch.baddbmm(buf, q, k, beta=0.0, alpha=self.softmax_scale).view(b, heads, sq, sk)
        probs = self.scale_mask_softmax(scores.float() if self.upcast else scores, attention_mask,
                                        self.softmax_offset)
        v = value.view(sk, b * heads, -1).transpose(0, 1)  # [b * np, sk, hn]
        if self.training and torch.is_grad_enabled():
            context = tensor_parallel.checkpoint(self._dropout_value, False, probs, v)
        else:
            context = self._dropout_value(probs, v)
        # [b * np, sq, hn] -> [sq, b, np * hn]
        context = context.view(b, heads, sq, -1).permute(2, 0, 1, 3).contiguous()
        return context.view(sq, b, self.hidden_size_per_partition)

    def _dropout_value(self, probs: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        probs = probs.to(v.dtype)  # upstream's cast after an fp32 softmax (a no-op otherwise)
        if self.config.sequence_parallel:
            probs = self.attention_dropout(probs)
        else:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                probs = self.attention_dropout(probs)
        return torch.bmm(probs.view(v.size(0), probs.size(2), -1), v)


def with_recomputed_dropout(spec: ModuleSpec, kind: UnitKind) -> ModuleSpec:
    """An attention unit's spec with ``RecomputedDropoutAttention`` as its core attention."""
    name = _ATTENTION[kind]
    att = getattr(spec.submodules, name)
    core = att.submodules.core_attention
    if getattr(core, "module", core) is not DotProductAttention:
        raise ValueError(f"attn_dropout needs megatron-core's DotProductAttention as {name}'s core, not {core}")
    att = dataclasses.replace(att, submodules=dataclasses.replace(att.submodules,
                                                                  core_attention=RecomputedDropoutAttention))
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, **{name: att}))


def fall_back_with_te(recompute: list[str], te: bool, stage: int) -> list[str]:
    """A stage's recompute choices; with transformer-engine's fused attention ``attn_dropout`` becomes ``none``
    (nothing to free), with one warning for the stage."""
    n = recompute.count("attn_dropout")
    if not te or not n:
        return list(recompute)
    log.warning("stage %d: attn_dropout on %d unit(s) runs as none: transformer-engine's fused attention keeps "
                "no dropout mask or probabilities to free", stage, n)
    return ["none" if rc == "attn_dropout" else rc for rc in recompute]


def attention_mismatch(plan, te: bool, device: str) -> str | None:
    """A warning when the plan's prediction assumed another attention kernel than this run uses (GPU only): a plan
    costed with flash attention keeps s^2 activations per attention unit under megatron-core's local attention."""
    assumed = plan.predicted.attention if plan.predicted is not None else None
    runs = "flash" if te else "unfused"
    if device == "cpu" or assumed is None or assumed == runs:
        return None
    if assumed == "flash":
        return ("the plan was costed with flash attention but transformer-engine is not installed: megatron-core's "
                "local attention keeps s^2 activations per attention unit, more memory than predicted; install "
                "transformer-engine or re-plan with `aceso search --attention unfused`")
    return ("the plan was costed with unfused attention but transformer-engine's fused attention runs: it needs "
            "less memory and time than predicted; `aceso search --attention flash` may find a faster plan")
