"""Norms of a sequence-parallel stage built from megatron-core's local (pure PyTorch) specs.

With sequence parallelism a stage's norms run on its ``s/tp`` tokens, so their weight gradients are partial
sums per TP rank, all-reduced over the TP group after backward (``aceso_megatron.parallel.grads``, as
megatron-core's ``finalize_model_grads`` does for parameters flagged ``sequence_parallel``). megatron-core's
``FusedLayerNorm`` (apex) and ``TENorm``/TE's fused LayerNorm-linear set that flag; the torch fallback
``WrappedTorchNorm`` (local specs without apex) instead refuses ``config.sequence_parallel`` ("sequence parallel
not supported by torch LayerNorm"), because nothing would reduce its gradients. ``SequenceParallelNorm`` is that
same torch norm with the flag set, swapped into the layer spec by ``with_sequence_parallel_norms`` (a spec
change, no patch): same parameters, same names, same math.
"""

from __future__ import annotations

import copy
import dataclasses

from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm

_LAYER_NORMS = ("input_layernorm", "pre_cross_attn_layernorm", "pre_mlp_layernorm")


class SequenceParallelNorm:
    """``WrappedTorchNorm`` for a sequence-parallel stage: its parameters flagged ``sequence_parallel``."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **kwargs):
        plain = copy.copy(config)
        plain.sequence_parallel = False  # only WrappedTorchNorm's refusal reads it
        norm = WrappedTorchNorm(plain, hidden_size, eps, **kwargs)
        for p in norm.parameters():
            p.sequence_parallel = True
        return norm


def _is_torch_norm(spec) -> bool:
    return (spec.module if isinstance(spec, ModuleSpec) else spec) is WrappedTorchNorm


def sequence_parallel_norm(spec):
    """``spec`` (a norm class or ModuleSpec) with ``SequenceParallelNorm`` for a ``WrappedTorchNorm``."""
    if not _is_torch_norm(spec):
        return spec
    return dataclasses.replace(spec, module=SequenceParallelNorm) if isinstance(spec, ModuleSpec) \
        else SequenceParallelNorm


def with_sequence_parallel_norms(layer: ModuleSpec) -> ModuleSpec:
    """A layer spec whose torch norms are ``SequenceParallelNorm`` (other norm modules are kept)."""
    sub = layer.submodules
    changes = {n: sequence_parallel_norm(getattr(sub, n)) for n in _LAYER_NORMS if hasattr(sub, n)}
    return dataclasses.replace(layer, submodules=dataclasses.replace(sub, **changes))
