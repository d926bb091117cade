"""Per-unit recompute choices <-> Megatron-LM's recompute settings (megatron-core 0.16.1 semantics).

What megatron-core does with each setting (``TransformerBlock._checkpointed_forward``, ``TransformerLayer``,
``Attention``): ``--recompute-granularity selective --recompute-modules core_attn`` re-runs the core attention of
every layer (self- and cross-attention) in backward; ``--recompute-granularity full`` checkpoints whole layers:
``--recompute-method uniform --recompute-num-layers 1`` every layer, ``block N`` the first ``N`` layers of each
transformer block (one block per model chunk; a T5 model has an encoder and a decoder block) and none of the rest.

In plan terms (one choice per unit, ``search.spec.plan.RECOMPUTE_CHOICES``) a layer is then one of

=============  =========================================================  =========================================
layer          plan units                                                 Megatron-LM
=============  =========================================================  =========================================
none           every unit ``none``                                        no recompute flag
selective      attention / cross-attention ``selective``, MLP ``none``    ``--recompute-granularity selective``
                                                                          ``--recompute-modules core_attn``
full           every unit ``full``                                        ``--recompute-granularity full`` (uniform
                                                                          1, or block N for the leading layers)
=============  =========================================================  =========================================

and anything else is refused: ``attn_dropout`` (Megatron-LM has no dropout-only recompute), ``selective`` on an MLP
unit (our activation-function recompute; megatron-core's ``mlp`` module re-runs the whole MLP and ``moe_act`` is for
MoE experts only), a layer whose units differ, selective next to none or full (one granularity for the model),
fully recomputed layers that are not the leading ones of their block, or a different leading count between blocks.
MoE units (kind ``moe``): ``selective`` is megatron-core's ``--recompute-modules moe_act`` (the experts'
activation function; with core_attn both may be given), full / none as an MLP unit. An MLA model's attention units:
``mla_up_proj`` is ``--recompute-modules mla_up_proj`` (the Q/K/V up projections and RoPE, ``MLASelfAttention``'s
``CheckpointWithoutOutput``; with moe_act both may be given; with core_attn too an MLA unit still reads as
``mla_up_proj``: one choice per unit, the importer notes it). ``moe`` / ``shared_experts`` / ``mlp`` /
``layernorm`` are not plan choices: the importer lists them in a note; the MTP unit takes what megatron-core gives
the MTP layer (``mtp_choice``).
Memory: megatron-core's full recompute keeps one input per layer, the plan's ``full`` one per unit, so a plan's
prediction is an upper bound by ``s * b * h`` elements per fully recomputed layer (docs/megatron.md).
"""

from __future__ import annotations

from ..layers import resolve
from search.spec.model import ModelSpec
from search.spec.plan import ParallelPlan
from .config import NO_RECOMPUTE, NotExpressible, Recompute, layer_bounds, layer_name

CORE_ATTN = ("core_attn",)
MODULE_ORDER = ("core_attn", "moe_act", "mla_up_proj")    # the order an exported --recompute-modules lists them


def blocks_of(model: ModelSpec, start: int, end: int) -> list[tuple[str, list[tuple[int, int]]]]:
    """The transformer blocks of a chunk ``[start, end)``: ``(stack, [(layer start unit, end unit), ...])``.

    GPT/Llama chunks have one (decoder) block; a T5 chunk has its encoder layers, then its decoder layers.
    ``start``/``end`` must fall on layer boundaries (checked before).
    """
    starts = layer_bounds(model)
    out: list[tuple[str, list[tuple[int, int]]]] = []
    for a, b in zip(starts[:-1], starts[1:]):
        if a < start or b > end:
            continue
        stack = model.units[a].stack
        if not out or out[-1][0] != stack:
            out.append((stack, []))
        out[-1][1].append((a, b))
    return out


def _layer_kind(model: ModelSpec, choices: list[str], lo: int, modules: tuple[str, ...]) -> str | None:
    kinds = [model.units[lo + i].kind for i in range(len(choices))]
    if modules and choices == [_selective(model, k, modules) for k in kinds]:
        return "selective"
    if all(c == "none" for c in choices):
        return "none"
    if all(c == "full" for c in choices):
        return "full"
    return None


def _selective(model: ModelSpec, kind: str, modules: tuple[str, ...] = CORE_ATTN) -> str:
    """A unit's choice under ``--recompute-modules MODULES``: the plan choice whose module its layer kind lists
    (``LayerKind.megatron_modules``: core_attn re-runs the attention core of attention units, moe_act the experts'
    activation function of moe units (the plan's ``selective`` on them), mla_up_proj the Q/K/V up projections of an
    MLA model's attention units (the plan's ``mla_up_proj``; with core_attn too, still ``mla_up_proj``: a unit takes
    one choice, the importer notes it); MLP units and the MTP unit are not recomputed (a plan's MTP unit takes none
    or full)."""
    given = resolve(model, kind).megatron_modules
    for choice in ("mla_up_proj", "selective"):
        if given.get(choice) in modules:
            return choice
    return "none"


def plan_modules(plan: ParallelPlan) -> tuple[str, ...]:
    """The selective modules the plan's choices name: each unit's choice's module (``LayerKind.megatron_modules``:
    core_attn for selective attention units, moe_act for selective moe units, mla_up_proj for mla_up_proj units)."""
    m = plan.model
    named = {resolve(m, m.units[ch.start_unit + k].kind).megatron_modules.get(rc)
             for _, _, ch in plan.chunks_in_order() for k, rc in enumerate(ch.recompute)}
    return tuple(x for x in MODULE_ORDER if x in named)


def mtp_choice(rc: Recompute) -> str:
    """The MTP unit under a Megatron-LM setting (megatron-core 0.16.1 ``MultiTokenPredictionLayer``): full
    uniform recomputes it, block skips it ("not supported for MTP yet"); selective re-runs its inner layer's
    attention core, which a plan's MTP unit cannot say (none or full): none, an upper bound on its memory."""
    return "full" if rc.granularity == "full" and rc.method == "uniform" else "none"


def _check_units(plan: ParallelPlan) -> None:
    for s, j, ch in plan.chunks_in_order():
        for k, rc in enumerate(ch.recompute):
            unit = plan.model.units[ch.start_unit + k]
            if rc == "attn_dropout":
                raise NotExpressible(
                    f"{plan.chunk_where(s, j)}.recompute[{k}] is attn_dropout: Megatron-LM has no dropout-only "
                    "recompute (its selective recompute re-runs the whole attention core, --recompute-modules "
                    "core_attn)")
            if rc == "selective" and "selective" not in resolve(plan.model, unit.kind).megatron_modules:
                raise NotExpressible(
                    f"{plan.chunk_where(s, j)}.recompute[{k}] is selective on an MLP unit: Megatron-LM's selective "
                    "recompute covers the attention core only (--recompute-modules core_attn; its mlp module "
                    "re-runs the whole MLP)")


def recompute_of(plan: ParallelPlan) -> Recompute:
    """The Megatron-LM setting that gives exactly the plan's per-unit choices, or ``NotExpressible``.

    Stage boundaries must already be known to fall between layers.
    """
    _check_units(plan)
    m = plan.model
    modules = plan_modules(plan)
    blocks = []           # (where, block name, [layer kinds])
    for s, j, ch in plan.chunks_in_order():
        for stack, layers in blocks_of(m, ch.start_unit, ch.end_unit):
            kinds = []
            for a, b in layers:
                choices = ch.recompute[a - ch.start_unit:b - ch.start_unit]
                kind = _layer_kind(m, choices, a, modules)
                if kind is None:
                    k0 = a - ch.start_unit
                    raise NotExpressible(
                        f"{plan.chunk_where(s, j)}.recompute[{k0}:{k0 + b - a}] ({', '.join(choices)}) mixes choices "
                        f"inside {layer_name(m, m.units[a])}: Megatron-LM recomputes a layer fully (full), its "
                        "attention core (selective) or not at all")
                kinds.append(kind)
            name = f"{stack} layers" if m.is_t5 else "layers"
            blocks.append((plan.chunk_where(s, j), name, kinds))
    used = {k for _, _, kinds in blocks for k in kinds}
    if used <= {"none"}:
        return _with_mtp(plan, NO_RECOMPUTE)
    if "selective" in used:
        if used != {"selective"}:
            other = "full" if "full" in used else "none"
            a = next(w for w, _, kinds in blocks if "selective" in kinds)
            b = next(w for w, _, kinds in blocks if other in kinds)
            raise NotExpressible(
                f"{a} recomputes layers selectively but {b} has layers with {other} recompute: Megatron-LM's "
                "--recompute-granularity is one setting for every layer")
        return _with_mtp(plan, Recompute("selective", modules=modules))
    rc = _full_setting(blocks)
    if rc.method == "uniform" and _mtp_choices(plan) and set(_mtp_choices(plan)) == {"none"}:
        # every layer full and the MTP block not: block N (N = the longest block) also recomputes every layer
        rc = Recompute("full", "block", max(len(kinds) for _, _, kinds in blocks))
    return _with_mtp(plan, rc)


def _mtp_choices(plan: ParallelPlan) -> list[str]:
    """The choices of the MTP units (after the last transformer layer, in the last chunk)."""
    _, _, ch = list(plan.chunks_in_order())[-1]
    return ch.recompute[max(layer_bounds(plan.model)[-1], ch.start_unit) - ch.start_unit:]


def _with_mtp(plan: ParallelPlan, rc: Recompute) -> Recompute:
    """``rc`` if the plan's MTP unit has the choice megatron-core makes for it under ``rc``, else NotExpressible."""
    end = layer_bounds(plan.model)[-1]
    s, j, ch = list(plan.chunks_in_order())[-1]
    for k in range(max(end, ch.start_unit) - ch.start_unit, ch.end_unit - ch.start_unit):
        if ch.recompute[k] != mtp_choice(rc):
            raise NotExpressible(f"{plan.chunk_where(s, j)}.recompute[{k}] (the MTP block) is {ch.recompute[k]}, but "
                                 f"Megatron-LM's {rc.label} recompute gives it {mtp_choice(rc)}")
    return rc


def _full_setting(blocks) -> Recompute:
    pinned, whole = [], []
    for where, name, kinds in blocks:
        lead = next((i for i, k in enumerate(kinds) if k != "full"), len(kinds))
        if "full" in kinds[lead:]:
            raise NotExpressible(
                f"{where}.recompute: its fully recomputed {name} are not the leading ones: Megatron-LM's "
                "--recompute-method block recomputes the first --recompute-num-layers layers of each (virtual) "
                "pipeline stage")
        (whole if lead == len(kinds) else pinned).append((where, lead, len(kinds)))
    if not pinned:
        return Recompute("full", "uniform", 1)
    where, n, total = pinned[0]
    for w, lead, count in pinned[1:] + whole:
        if (lead != n) if lead < count else (count > n):
            what = f"all its {count}" if lead == count else f"its first {lead}"
            raise NotExpressible(
                f"{w} recomputes {what} layers fully but {where} its first {n} of {total}: Megatron-LM's "
                "--recompute-num-layers (block) is one count for every (virtual) pipeline stage")
    return Recompute("full", "block", n)


def unit_choices(rc: Recompute, model: ModelSpec, start: int, end: int) -> list[str]:
    """Per-unit choices of the chunk ``[start, end)`` under a Megatron-LM setting (the inverse of ``recompute_of``)."""
    out: list[str] = []
    for _, layers in blocks_of(model, start, end):
        for i, (a, b) in enumerate(layers):
            for u in range(a, b):
                if rc.granularity == "selective":
                    out.append(_selective(model, model.units[u].kind, rc.modules))
                elif rc.granularity == "full" and (rc.method == "uniform" or i < (rc.num_layers or 0)):
                    out.append("full")
                else:
                    out.append("none")
    out += [mtp_choice(rc)] * (end - max(start, layer_bounds(model)[-1]))     # the MTP unit(s) after the layers
    return out
