"""A model chunk's layers as megatron-core's hybrid layer pattern, placed by megatron-core's ``HybridStack``.

Aceso's units are megatron-core's hybrid layers (``megatron/core/models/hybrid``, 0.19): HybridModel's attention
layer (``*``) is a ``TransformerLayer`` of the input norm, the self-attention and its residual add -- an attention
unit; its MLP layer (``-``, ``MLPLayer``) the pre-MLP norm, the MLP and its residual add -- an MLP unit; ``E`` an MoE
unit, ``+`` an MLA attention unit. So a GPT / Llama model is the pattern ``*-`` per layer (``*E`` for an MoE layer,
``+-`` / ``+E`` with MLA), and a chunk holding units ``[start, end)`` is that slice of the pattern, its first layer
at offset ``start``: what Megatron-LM writes ``--hybrid-layer-pattern "*-*-|*-*-"`` for, with any cut.

A unit's symbol and its ``HybridStackSubmodules`` slot are its layer kind's (``search.layers``: ``symbol``,
``hybrid_slot``; a new layer kind, e.g. Mamba's ``M``, brings both in its own record). Where megatron-core has the hybrid models (0.19), ``build_stack`` builds the
chunk's ``HybridStack`` from its pattern (checked by megatron-core's ``validate_segment_layers``): ``HybridStack``
walks it, numbers its layers ``start + i + 1`` and asks the symbol's slot for each; every slot here hands over the
plan's unit at that place (``build_unit_layers``: the unit's own config, recompute and layer spec, its GPT layer
number), checking that its kind is the symbol's. The chunk runs the units itself (``GPTStage.forward``: RoPE, the
recipe's contexts and the full recompute per unit, which ``HybridStack.forward`` has no notion of), and has no final
norm in the stack (the last chunk's norm and output layer are the stage's, as today). Without the hybrid models
(0.16.1), and for layers that are not one unit each (T5's cross-attention, a user's layer that runs whole), the
chunk keeps a plain ``ModuleList`` of its units.
"""

from __future__ import annotations

import copy

from patches.compat import have_hybrid
from search.layers import LayerKind, kinds, resolve
from search.spec.model import ModelSpec, Unit


def hybrid_layers() -> tuple[LayerKind, ...]:
    """The registered kinds megatron-core's ``HybridStack`` builds as layers of their own: a symbol and a slot."""
    return tuple(k for k in kinds() if k.symbol is not None and k.hybrid_slot is not None)


def kind_of(model: ModelSpec, unit: Unit) -> LayerKind | None:
    """The layer kind of ``unit`` (MLA's for an MLA model's attention), or None for a unit no hybrid layer is (T5's
    cross-attention, MTP)."""
    k = resolve(model, unit.kind)
    return k if k in hybrid_layers() else None


def pattern(model: ModelSpec, units: list[Unit]) -> str | None:
    """The hybrid layer pattern of ``units`` (``*-*-`` for two GPT layers), or None if one of them is no hybrid
    layer."""
    found = [kind_of(model, u) for u in units]
    if model.is_t5 or None in found:
        return None
    return "".join(k.symbol for k in found)


class _PlannedLayer:
    """A ``HybridStack`` slot that hands over the plan's unit at the layer's place (``layer_number - 1`` is its
    global unit index), after checking that the unit is of the slot's kind."""

    def __new__(cls, *, layers: dict, slot: str, model: ModelSpec, layer_number: int, **_ignored):
        layer = layers[layer_number - 1]
        k = kind_of(model, layer.unit)
        if k is None or k.hybrid_slot != slot:
            raise ValueError(f"hybrid pattern: unit {layer_number - 1} is a {layer.unit.kind} unit, not one of "
                             f"{slot}")
        return layer


def build_stack(model: ModelSpec, units: list[Unit], layers: list, start: int, config, pg_collection):
    """megatron-core's ``HybridStack`` placing ``layers`` (one per unit of ``units``, the first at global unit
    ``start``) by their pattern, or None where megatron-core has no hybrid models or the units make no pattern."""
    text = pattern(model, units)
    if not have_hybrid() or text is None or len(layers) != len(units):
        return None
    from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
    from megatron.core.models.hybrid.hybrid_layer_allocation import validate_segment_layers
    from megatron.core.transformer.spec_utils import ModuleSpec

    by_index = {start + i: layer for i, layer in enumerate(layers)}
    slots = {k.hybrid_slot: ModuleSpec(module=_PlannedLayer, params={"layers": by_index, "slot": k.hybrid_slot,
                                                                     "model": model})
             for k in hybrid_layers()}
    # the stack only places layers: no quantization contexts of its own around them (each unit enters its recipe's)
    cfg = copy.copy(config)
    cfg.fp8, cfg.fp4 = None, None
    return HybridStack(cfg, HybridStackSubmodules(**slots), pre_process=True,
                       layer_type_list=validate_segment_layers(text), pp_layer_offset=start, post_layer_norm=False,
                       post_process=False, pg_collection=pg_collection)

