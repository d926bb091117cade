"""How a stage gets its layers: one ``UnitLayer`` per unit of its span, from the model's layer spec (megatron-core's
stock spec or the user's ``layer_spec``, ``model_specs.builders.layer_spec``) and the stage's config.

A carvable layer (``model_specs.extensions.whole_layer_reason`` is None) gives one ``TransformerLayer`` per unit,
built from the unit spec (the other halves as identities; ``attn_dropout`` units with
``aceso_megatron.model.attention``'s core attention) with the unit's config (its selective recompute) and its global
layer number. A layer that runs whole gives one ``UnitLayer`` for all its units (the plan keeps them together with
one recompute choice, none or full: ``check_model``).

A unit runs in its recipe's FP8 / FP4 context (``lowprec.layer_context``, inside a full recompute's function as in
megatron-core's ``TransformerBlock``) and is built in its quantized-parameter context (``lowprec.init_context``).

Selective recompute of an MLP unit wraps the built MLP's own ``activation_func`` (``CheckpointedActivation``), so a
user's MLP with its own activation is recomputed too.

``check_model(plan, device)`` runs everything that can be wrong with the model before any process group exists:
the ``megatron`` block against ``TransformerConfig`` (names, types, megatron-core's own checks), the layer-spec
providers, QK norms without ``qk_layernorm`` (their gradients would not be summed over TP), and the plan against
layers that run whole or core attentions that ``attn_dropout`` cannot use.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.spec_utils import build_module

from model_specs.builders import bind_tp_group, gdn_layer_spec, layer_spec, mamba_layer_spec, unit_spec
from model_specs.extensions import (
    check_attn_dropout,
    check_qk_layernorm,
    check_whole_layers,
    whole_layer_stacks,
)
from patches.compat import shared_mtp_refusal
from search import layers
from search.io.errors import AcesoError
from search.spec.model import ModelSpec, Unit

from .attention import with_recomputed_dropout
from .config import stage_config, unit_config
from .lowprec import init_context, layer_context
from .recompute import CheckpointedActivation, run_unit


class UnitLayer(torch.nn.Module):
    """One unit (or a whole layer's units): a ``TransformerLayer``, optionally fully recomputed. ``unit`` is its
    (first) unit."""

    def __init__(self, unit: Unit, layer: torch.nn.Module, full_recompute: bool, num_units: int = 1):
        super().__init__()
        self.unit = unit
        self.layer = layer
        self.full_recompute = full_recompute
        self.num_units = num_units

    def forward(self, hidden, rotary_pos_emb=None, attention_mask=None, context=None, context_mask=None):
        def run(h, ctx):   # in the unit's FP8 / FP4 context (global layer number; bf16 layers: none)
            with layer_context(self.layer.config, self.unit.layer):
                out, _ = self.layer(h, attention_mask=attention_mask, context=ctx, context_mask=context_mask,
                                    rotary_pos_emb=rotary_pos_emb)
            return out

        return run_unit(run, self.full_recompute, hidden, context)


class MambaUnitLayer(UnitLayer):
    """A Mamba unit: megatron-core's whole ``MambaLayer`` (pre-norm, mixer, residual add), which takes the hidden
    states only and returns them (no bias pair); ``full`` recompute as any unit."""

    def forward(self, hidden, rotary_pos_emb=None, attention_mask=None, context=None, context_mask=None):
        def run(h, _ctx):
            with layer_context(self.layer.config, self.unit.layer):
                return self.layer(h)

        return run_unit(run, self.full_recompute, hidden, context)


def _mamba_layer(model: ModelSpec, unit: Unit, rc: str, config, pg_collection, te: bool, transform) -> UnitLayer:
    """A Mamba unit's layer (``builders.mamba_layer_spec``): none or full recompute (its kind's choices)."""
    with init_context(config, unit.layer):
        layer = build_module(transform(mamba_layer_spec(model, te)), config=config, layer_number=unit.layer + 1,
                             pg_collection=pg_collection)
    return MambaUnitLayer(unit, layer, rc == "full")


def _gdn_layer(model: ModelSpec, unit: Unit, rc: str, config, pg_collection, te: bool, transform) -> UnitLayer:
    """A GDN unit's layer (``builders.gdn_layer_spec``, a ``TransformerLayer`` run as an attention unit): none or
    full recompute. Its packed TP shards are marked with their parts, as megatron-core marks Mamba's
    (``partition_sizes``, ``model.init``): ``in_proj``'s ``[q, k, v, z, beta, alpha]`` and ``conv1d``'s ``[q, k,
    v]``, each split over TP (``GatedDeltaNet.sharded_state_dict`` splits them the same way)."""
    with init_context(config, unit.layer):
        layer = build_module(transform(gdn_layer_spec(model, te)), config=config, layer_number=unit.layer + 1,
                             pg_collection=pg_collection)
    mixer = layer.self_attention
    mixer.in_proj.weight.partition_sizes = list(mixer.in_proj_split_sections)
    mixer.conv1d.weight.partition_sizes = [mixer.qk_dim_local_tp, mixer.qk_dim_local_tp, mixer.v_dim_local_tp]
    return UnitLayer(unit, layer, rc == "full")


# units that are a whole megatron-core layer of their own kind (not a part of a ``TransformerLayer``)
_OWN_LAYERS = {"mamba": _mamba_layer, "gdn": _gdn_layer}


def _expert_mlps(moe_layer) -> list:
    """The MLPs of an ``MoELayer``: each local expert of its ``SequentialMLP``, and the shared expert."""
    experts = getattr(getattr(moe_layer, "experts", None), "local_experts", None)
    if experts is None:
        raise AcesoError(f"selective recompute of an MoE unit needs SequentialMLP experts, not "
                         f"{type(getattr(moe_layer, 'experts', None)).__name__}; use none or full")
    shared = getattr(moe_layer, "shared_experts", None)
    return list(experts) + ([shared] if shared is not None else [])


def _recompute_activation(layer, unit: Unit) -> None:
    """Selective recompute of an MLP unit: its activation output dropped after ``linear_fc2`` and recomputed (an
    MoE unit: every expert's, one after another as ``SequentialMLP`` runs them)."""
    if unit.kind == "moe":
        for mlp in _expert_mlps(layer.mlp):
            _checkpoint_activation(mlp, unit)
        return
    _checkpoint_activation(getattr(layer, "mlp", None), unit)


def _checkpoint_activation(mlp, unit: Unit) -> None:
    if not (callable(getattr(mlp, "activation_func", None)) and hasattr(mlp, "linear_fc2")):
        raise AcesoError(f"{unit.stack} layer {unit.layer}: selective recompute of an MLP unit needs an MLP with "
                         f"activation_func and linear_fc2, not {type(mlp).__name__}; use none or full")
    if not isinstance(mlp.activation_func, CheckpointedActivation):
        mlp.activation_func = CheckpointedActivation(mlp.activation_func)
    mlp.activation_func.release_after(mlp.linear_fc2)


def build_unit_layers(model: ModelSpec, units: list[Unit], recompute: list[str], config, pg_collection,
                      te: bool, transform=None) -> list[UnitLayer]:
    """The layers of a span of units with their recompute choices (``recompute[i]`` for ``units[i]``);
    ``transform(spec) -> spec``, if given, is applied to every unit's (or whole layer's) spec before it is built."""
    transform = transform or (lambda spec: spec)
    whole = whole_layer_stacks(model)
    out: list[UnitLayer] = []
    i = 0
    while i < len(units):
        unit, rc = units[i], recompute[i]
        if unit.kind in _OWN_LAYERS:
            out.append(_OWN_LAYERS[unit.kind](model, unit, rc, config, pg_collection, te, transform))
            i += 1
            continue
        full = layer_spec(model, unit.stack, te, unit.layer, bool(getattr(config, "moe_grouped_gemm", False)))
        if unit.stack in whole:   # the layer's units are consecutive here (check_model)
            n = sum(1 for u in units[i:] if (u.stack, u.layer) == (unit.stack, unit.layer))
            spec = transform(bind_tp_group(full, pg_collection.tp))
            with init_context(config, unit.layer):
                layer = build_module(spec, config=config, layer_number=unit.layer + 1, pg_collection=pg_collection)
            out.append(UnitLayer(unit, layer, rc == "full", n))
            i += n
            continue
        cfg = unit_config(config, unit.kind, rc)
        spec = transform(unit_spec(full, unit.kind, pg_collection.tp))
        if rc == "attn_dropout":
            spec = with_recomputed_dropout(spec, unit.kind)
        with init_context(cfg, unit.layer):
            layer = build_module(spec, config=cfg, layer_number=unit.layer + 1, pg_collection=pg_collection)
        if rc == "selective" and layers.get(unit.kind).role == "mlp":
            _recompute_activation(layer, unit)
        out.append(UnitLayer(unit, layer, rc == "full"))
        i += 1
    return out


def hybrid_refusal(model: ModelSpec) -> str | None:
    """Why this megatron-core cannot run ``model``'s hybrid layer pattern (None: it can): the runtime places a hybrid
    model's layers with megatron-core 0.19's ``HybridStack`` and proves it against stock ``HybridModel``, neither of
    which 0.16.1 has; a Mamba layer without mamba-ssm needs ``patches.mamba_cpu``'s packages, a GDN layer a
    megatron-core that has one (``patches.gdn_cpu``)."""
    from patches import gdn_cpu, mamba_cpu
    from patches.compat import have_hybrid

    if model.hybrid_layer_pattern is None:
        return None
    if not have_hybrid():
        import megatron.core

        return (f"hybrid_layer_pattern: the aceso runtime runs hybrid models on megatron-core >= 0.19 (HybridModel); "
                f"this is {megatron.core.__version__}: use the Python 3.12 stack (README), or export the plan with "
                "aceso export --to megatron-lm")
    return ((mamba_cpu.refusal() if model.mamba is not None else None)
            or (gdn_cpu.refusal() if model.gdn is not None else None))


def installed_refusal(model: ModelSpec) -> str | None:
    """Why the megatron-core (and Mamba / GDN packages) installed here cannot build ``model`` (None: they can): a
    verdict on this machine, not on the plan, which another machine's megatron-core may run."""
    return hybrid_refusal(model) or shared_mtp_refusal(model)


def check_model(plan, device: str = "cpu", fast=None) -> None:
    """Every fault of the model and its fit with the plan, as one ``AcesoError``, before any process group exists;
    the config is built with the fast paths ``fast`` the run will use (default: what this machine offers)."""
    model = plan.model
    if (msg := installed_refusal(model)) is not None:
        raise AcesoError(msg)
    try:
        stage_config(model, 1, device, fast=fast)
    except AcesoError:
        raise
    except (ValueError, AssertionError, TypeError) as e:
        if not model.megatron:
            raise
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise AcesoError(f"megatron block: megatron-core's TransformerConfig refused it: {first}") from None
    check_whole_layers(plan)   # imports the providers (their faults are AcesoErrors too)
    check_qk_layernorm(model)
    check_attn_dropout(plan)
