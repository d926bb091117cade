"""Norms of a sequence-parallel stage built from megatron-core's local (pure PyTorch) specs.

With sequence parallelism a stage's norms run on its ``s/tp`` tokens, so their weight gradients are partial
sums per TP rank, all-reduced over the TP group after backward (``aceso_megatron.parallel.grads``, as
megatron-core's ``finalize_model_grads`` does for parameters flagged ``sequence_parallel``). megatron-core's
``FusedLayerNorm`` (apex) and ``TENorm``/TE's fused LayerNorm-linear set that flag; the torch fallback
``WrappedTorchNorm`` (local specs without apex) instead refuses ``config.sequence_parallel`` ("sequence parallel
not supported by torch LayerNorm"), because nothing would reduce its gradients. ``SequenceParallelNorm`` is that
same torch norm with the flag set, swapped into the layer spec by ``with_sequence_parallel_norms`` (a spec
change, no patch): same parameters, same names, same math.

Query/key norms (``qk_layernorm``) of a sequence-parallel stage run after the QKV projection has gathered the
sequence, on the rank's own heads: their gradients are partial per TP rank because of the heads, not the tokens,
and are summed over the TP group by their names (``qk_layernorm``), with or without SP. ``WrappedTorchNorm`` refuses
them under ``config.sequence_parallel`` all the same; ``with_sequence_parallel_norms`` swaps them for the same torch
norm built with the flag off (``QKNormUnderSP``, parameters not flagged: nothing to sum twice). So does a GDN
layer's ``out_norm`` (``GatedDeltaNet``'s norm over each value head's ``d_v`` channels, on the whole sequence of
the rank's heads: summed over TP by its name, ``parallel.grads``).
"""

from __future__ import annotations

import copy
import dataclasses

from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm

_LAYER_NORMS = ("input_layernorm", "pre_cross_attn_layernorm", "pre_mlp_layernorm", "norm")   # norm: MambaLayer's
_ATTENTIONS = ("self_attention", "cross_attention")
_QK_NORMS = ("q_layernorm", "k_layernorm", "out_norm")    # out_norm: GatedDeltaNet's per-head output norm
_MLA_NORMS = ("q_layernorm", "kv_layernorm")


class SequenceParallelNorm:
    """``WrappedTorchNorm`` for a sequence-parallel stage: its parameters flagged ``sequence_parallel``."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **kwargs):
        plain = copy.copy(config)
        plain.sequence_parallel = False  # only WrappedTorchNorm's refusal reads it
        norm = WrappedTorchNorm(plain, hidden_size, eps, **kwargs)
        for p in norm.parameters():
            p.sequence_parallel = True
        return norm


class QKNormUnderSP:
    """``WrappedTorchNorm`` as a query/key norm of a sequence-parallel stage (see the module docstring)."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **kwargs):
        plain = copy.copy(config)
        plain.sequence_parallel = False
        return WrappedTorchNorm(plain, hidden_size, eps, **kwargs)


def _is_torch_norm(spec) -> bool:
    return (spec.module if isinstance(spec, ModuleSpec) else spec) is WrappedTorchNorm


def sequence_parallel_norm(spec):
    """``spec`` (a norm class or ModuleSpec) with ``SequenceParallelNorm`` for a ``WrappedTorchNorm``."""
    if not _is_torch_norm(spec):
        return spec
    return dataclasses.replace(spec, module=SequenceParallelNorm) if isinstance(spec, ModuleSpec) \
        else SequenceParallelNorm


def _qk_norm(spec):
    if not _is_torch_norm(spec):
        return spec
    return dataclasses.replace(spec, module=QKNormUnderSP) if isinstance(spec, ModuleSpec) else QKNormUnderSP


def _with_qk_norms(attention):
    """An attention ModuleSpec whose torch q/k norms are ``QKNormUnderSP`` (MLA's latent norms, which run on
    the rank's ``s/tp`` tokens under SP: ``SequenceParallelNorm``)."""
    sub = getattr(attention, "submodules", None)
    if not isinstance(attention, ModuleSpec) or not dataclasses.is_dataclass(sub):
        return attention
    if hasattr(sub, "kv_layernorm"):   # MLASelfAttentionSubmodules
        changes = {n: sequence_parallel_norm(getattr(sub, n)) for n in _MLA_NORMS if getattr(sub, n, None)}
        return dataclasses.replace(attention, submodules=dataclasses.replace(sub, **changes))
    changes = {n: _qk_norm(getattr(sub, n)) for n in _QK_NORMS if getattr(sub, n, None) is not None}
    return dataclasses.replace(attention, submodules=dataclasses.replace(sub, **changes)) if changes else attention


def with_sequence_parallel_norms(layer: ModuleSpec) -> ModuleSpec:
    """A layer spec whose torch norms are ``SequenceParallelNorm`` and whose torch q/k norms are ``QKNormUnderSP``
    (other norm modules are kept)."""
    sub = layer.submodules
    changes = {n: sequence_parallel_norm(getattr(sub, n)) for n in _LAYER_NORMS if hasattr(sub, n)}
    changes.update({n: _with_qk_norms(getattr(sub, n)) for n in _ATTENTIONS if hasattr(sub, n)})
    return dataclasses.replace(layer, submodules=dataclasses.replace(sub, **changes))
