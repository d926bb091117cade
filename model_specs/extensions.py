"""A user's own layer spec and ``megatron`` block, as the runtime and the profiler use them (torch, megatron-core).

``provided_spec(path)`` imports a ``layer_spec`` provider, ``package.module:attr``, as Megatron-LM's ``--spec`` does:
``attr`` is a megatron-core ``ModuleSpec`` or a function of no arguments returning one, for a layer module that
subclasses ``BaseTransformerLayer``. The module is imported from ``sys.path`` and, failing that, from the current
folder. Every fault is one ``AcesoError`` line naming the provider.

Carving (``whole_layer_reason``): a layer is split into units (attention half, MLP half, T5 cross-attention) by
replacing the other halves with identities (``builders.unit_spec``), which computes exactly the full layer when the
layer is megatron-core's ``TransformerLayer`` running its own ``forward`` over ``TransformerLayerSubmodules``. A
layer that is not (a subclass with its own ``forward``/``_forward_attention``/``_forward_mlp``, e.g. a parallel
attention + MLP block, or another ``BaseTransformerLayer``) runs whole: its units must sit in one model chunk with
one recompute choice, ``none`` or ``full`` (``check_whole_layers``). An MoE ``mlp`` is refused (no expert
parallelism yet), and so are QK norms without ``megatron.qk_layernorm`` (``check_qk_layernorm``).

``megatron_kwargs(model)``: the ``megatron`` block checked against the imported ``TransformerConfig`` (names as in
``search.spec.megatron_fields``, and types: JSON lists become tuples where the field is a tuple, enum members are given
by name; callables, dtypes and other objects cannot come from a spec file).
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import os
import sys
import types
import typing
from functools import lru_cache

from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig
from megatron.core.transformer.transformer_layer import (
    BaseTransformerLayer,
    TransformerLayer,
    TransformerLayerSubmodules,
)

from patches.compat import mlp_class
from search.spec import megatron_fields
from search.io.errors import AcesoError

_OWN_METHODS = ("forward", "_forward_attention", "_forward_pre_mlp_layernorm", "_forward_mlp", "_forward_post_mlp")


# ----- the provider ---------------------------------------------------------------------------------------------
def _import(module: str, path: str):
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if not e.name or not (module == e.name or module.startswith(f"{e.name}.")):   # the module's own import
            raise AcesoError(f"layer_spec '{path}': importing {module} failed: {e}") from None
        cwd = os.getcwd()
        if cwd not in sys.path:
            sys.path.append(cwd)
            try:
                return importlib.import_module(module)
            except ModuleNotFoundError:
                pass
        raise AcesoError(f"layer_spec '{path}': no module named {e.name}; make {module} importable (installed, on "
                         "PYTHONPATH or in the current folder)") from None
    except Exception as e:  # noqa: BLE001 - the user's module failed while importing: one line
        raise AcesoError(f"layer_spec '{path}': importing {module} raised {type(e).__name__}: {e}") from None


@lru_cache(maxsize=None)
def provided_spec(path: str) -> ModuleSpec:
    """The ``ModuleSpec`` the provider ``package.module:attr`` gives (cached per path)."""
    module, _, attr = path.partition(":")
    obj = _import(module, path)
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise AcesoError(f"layer_spec '{path}': {module} has no attribute {attr}; check the name after ':'")
        obj = getattr(obj, part)
    if not isinstance(obj, ModuleSpec):
        if not callable(obj):
            raise AcesoError(f"layer_spec '{path}' is a {type(obj).__name__}, not a ModuleSpec or a function "
                             "returning one")
        try:
            obj = obj()
        except Exception as e:  # noqa: BLE001 - the user's function failed: one line
            raise AcesoError(f"layer_spec '{path}' raised {type(e).__name__}: {e}{_te_hint(e)}") from None
        if not isinstance(obj, ModuleSpec):
            raise AcesoError(f"layer_spec '{path}' returned {type(obj).__name__}, not a megatron-core ModuleSpec")
    if not (isinstance(obj.module, type) and issubclass(obj.module, BaseTransformerLayer)):
        name = getattr(obj.module, "__name__", repr(obj.module))
        raise AcesoError(f"layer_spec '{path}' builds {name}, not a transformer layer; its ModuleSpec.module must "
                         "subclass megatron-core's TransformerLayer (BaseTransformerLayer)")
    _refuse_moe(obj, path)
    return obj


def _module_of(sub) -> type | None:
    m = getattr(sub, "module", sub)
    return m if isinstance(m, type) else None


def _refuse_moe(spec: ModuleSpec, path: str) -> None:
    from megatron.core.transformer.moe.moe_layer import MoELayer

    mlp = mlp_class(getattr(spec.submodules, "mlp", None))
    if mlp is not None and issubclass(mlp, MoELayer):
        raise AcesoError(f"layer_spec '{path}': submodule mlp is an MoE layer ({mlp.__name__}); aceso prices and "
                         "builds MoE layers from the model's moe field (with expert parallelism from the plan's "
                         "stages[].ep); describe the experts there and keep the layer_spec's mlp dense")


# ----- carving --------------------------------------------------------------------------------------------------
def whole_layer_reason(spec: ModuleSpec) -> str | None:
    """Why a layer of ``spec`` cannot be split into units (it then runs whole), or None when it can."""
    cls = spec.module
    if not issubclass(cls, TransformerLayer):
        return f"{cls.__name__} is not a megatron-core TransformerLayer"
    own = [m for m in _OWN_METHODS if getattr(cls, m) is not getattr(TransformerLayer, m)]
    if own:
        return f"{cls.__name__}.{own[0]} is its own, not TransformerLayer's"
    if not isinstance(spec.submodules, TransformerLayerSubmodules):
        return f"its submodules are a {type(spec.submodules).__name__}, not TransformerLayerSubmodules"
    return None


TE_MISSING = "needs transformer-engine, which is not installed here"


def _te_hint(e: Exception) -> str:
    """A provider that fails for want of transformer-engine (megatron-core 0.16.1's TE specs name
    ``TESpecProvider``, ``TELayerNormColumnParallelLinear``, ... only when TE imports: ``NameError``; 0.19 sets them
    None: ``TypeError`` calling None inside its ``..._transformer_engine_...`` spec function): say so, and what runs
    instead."""
    import traceback

    text = f"{type(e).__name__} {e}"
    in_te_spec = isinstance(e, TypeError) and "NoneType" in text and any(
        "transformer_engine" in frame.name for frame in traceback.extract_tb(e.__traceback__))
    if in_te_spec or (isinstance(e, NameError | ImportError | AttributeError)
                      and ("TE" in text or "transformer_engine" in text)):
        return (f"; it {TE_MISSING} (and never runs on CPU): use a local "
                "spec (megatron-core's get_gpt_layer_local_spec) or run on a GPU with transformer-engine")
    return ""


def stack_spec(model, stack: str) -> ModuleSpec | None:
    """The user's spec of ``stack``, or None for the stock layer."""
    path = model.layer_spec_path(stack)
    return provided_spec(path) if path else None


def whole_layer_stacks(model) -> dict[str, str]:
    """stack -> reason, for the stacks whose layers run whole."""
    out = {}
    for stack in ("encoder", "decoder") if model.is_t5 else ("decoder",):
        spec = stack_spec(model, stack)
        reason = whole_layer_reason(spec) if spec is not None else None
        if reason:
            out[stack] = f"layer_spec '{model.layer_spec_path(stack)}': {reason}"
    return out


def check_whole_layers(plan) -> None:
    """A plan over whole-layer stacks keeps every such layer in one chunk with one recompute choice, none or full."""
    model = plan.model
    whole = whole_layer_stacks(model)
    if not whole:
        return
    where = {}   # unit -> (stage, chunk, recompute)
    for s, j, ch in plan.chunks_in_order():
        for k, rc in enumerate(ch.recompute):
            where[ch.start_unit + k] = (s, j, rc)
    starts = model.layer_starts
    for lo, hi in zip(starts, starts[1:]):
        unit = model.units[lo]
        if unit.stack not in whole:
            continue
        name = f"{unit.stack} layer {unit.layer}"
        chunks = {where[u][:2] for u in range(lo, hi)}
        rcs = [where[u][2] for u in range(lo, hi)]
        why = f"{name} runs whole ({whole[unit.stack]})"
        if len(chunks) > 1:
            edges = ", ".join(map(str, starts[:4])) + ", ..."
            raise AcesoError(f"{why}, but the plan cuts it between units {lo} and {hi}; put stage boundaries at "
                             f"layer edges (units {edges})")
        if len(set(rcs)) > 1 or rcs[0] not in ("none", "full"):
            raise AcesoError(f"{why}, but its units take recompute {rcs}; give all its units none or all full")


def check_qk_layernorm(model) -> None:
    """A layer spec with QK norms needs ``megatron.qk_layernorm``: megatron-core (and the runtime, as it) sums the
    norms' gradients over the TP group only when the config says so; without it they would silently differ per
    TP rank."""
    if (model.megatron or {}).get("qk_layernorm"):
        return
    for stack in ("encoder", "decoder") if model.is_t5 else ("decoder",):
        spec = stack_spec(model, stack)
        for name in ("self_attention", "cross_attention"):
            sub = getattr(getattr(getattr(spec, "submodules", None), name, None), "submodules", None)
            norms = [n for n in ("q_layernorm", "k_layernorm")
                     if _module_of(getattr(sub, n, None)) not in (None, IdentityOp)]
            if norms:
                raise AcesoError(f"layer_spec '{model.layer_spec_path(stack)}': {name}.{norms[0]} is a norm but "
                                 "the megatron block lacks qk_layernorm; add megatron: {qk_layernorm: true} (its "
                                 "gradients are summed over tensor parallelism only then, as in megatron-core)")


def check_attn_dropout(plan) -> None:
    """``attn_dropout`` needs megatron-core's ``DotProductAttention`` as the unit's core attention."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    model = plan.model
    for _s, _j, ch in plan.chunks_in_order():
        for k, rc in enumerate(ch.recompute):
            unit = model.units[ch.start_unit + k]
            spec = stack_spec(model, unit.stack)
            if rc != "attn_dropout" or spec is None:
                continue
            name = "self_attention" if unit.kind == "attention" else "cross_attention"
            core = getattr(getattr(getattr(spec.submodules, name, None), "submodules", None), "core_attention", None)
            if _module_of(core) is not DotProductAttention:
                raise AcesoError(f"unit {ch.start_unit + k}: attn_dropout needs megatron-core's DotProductAttention "
                                 f"as {name}'s core attention, but layer_spec '{model.layer_spec_path(unit.stack)}' "
                                 f"has {getattr(_module_of(core), '__name__', core)}; use none, selective or full")


# ----- the megatron block ---------------------------------------------------------------------------------------
def _convert(value, tp):
    """``value`` (JSON) as type ``tp``; ``TypeError`` with the expected type when it is not one."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is typing.Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for a in args:
            if a is type(None):
                continue
            try:
                return _convert(value, a)
            except TypeError:
                continue
        raise TypeError(tp)
    if origin is typing.Literal:
        if value in args:
            return value
        raise TypeError(tp)
    if tp is bool or tp is str:
        if isinstance(value, tp):
            return value
        raise TypeError(tp)
    if tp is int or tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool) and (tp is float or isinstance(value, int)):
            return tp(value)
        raise TypeError(tp)
    if origin in (list, tuple) and isinstance(value, list):
        if origin is list:
            return [_convert(v, args[0] if args else typing.Any) for v in value]
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_convert(v, args[0]) for v in value)
        if args and len(args) != len(value):
            raise TypeError(tp)
        return tuple(_convert(v, a) for v, a in zip(value, args or [typing.Any] * len(value)))
    if isinstance(tp, type) and issubclass(tp, enum.Enum) and isinstance(value, str):
        if value in tp.__members__:
            return tp[value]
        raise TypeError(tp)
    raise TypeError(tp)


def _type_name(tp) -> str:
    return getattr(tp, "__name__", None) if isinstance(tp, type) else str(tp).replace("typing.", "")


def megatron_kwargs(model) -> dict:
    """The model's ``megatron`` block as ``TransformerConfig`` keyword arguments (validated and converted)."""
    block = model.megatron or {}
    if not block:
        return {}
    # an MLA model's stages are MLATransformerConfigs: its fields (rope_type, rotary_scaling_factor, ...) too
    fields = {f.name: f for f in dataclasses.fields(MLATransformerConfig if model.mla else TransformerConfig)}
    try:
        megatron_fields.check_names(block, frozenset(fields))
    except ValueError as e:
        raise AcesoError(str(e)) from None
    out = {}
    for name, value in block.items():
        tp = fields[name].type
        try:
            out[name] = _convert(value, tp)
        except TypeError:
            raise AcesoError(f"megatron.{name}: {value!r} is not a {_type_name(tp)}; give a value of that type (a "
                             "spec file holds JSON values only: callables and objects go in your layer_spec)"
                             ) from None
    return out
