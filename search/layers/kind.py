"""The layer-kind record and its registry: one ``LayerKind`` per kind of unit, in megatron-core's hybrid vocabulary.

A model is a sequence of units (``search.spec.model.ModelSpec.units``), each of one kind; a kind is what the planner,
the cost model and the runtime need to know about it, in one record (``LayerKind``):

- **where it sits**: its megatron-core hybrid layer symbol (``hybrid_layer_allocation.Symbols``: ``*`` attention,
  ``+`` MLA, ``-`` MLP, ``E`` MoE; T5's cross-attention and the MTP depth have none: ``/`` starts an MTP depth),
  its ``role`` in a layer (the attention or the MLP half, or a whole layer), which layers hold it (``in_layer``) and,
  for a kind that takes a base kind's place, which one: ``replaces`` in the layers ``selects`` names (a unit of its
  own name: MoE for MLP), or ``variant_of`` in the models ``applies`` names (the base's unit name: MLA for
  attention); a whole-layer kind follows the decoder ``repeat`` times (MTP);
- **what it is**: parameters (unsharded) and forward FLOPs per sample (``keys``: the keys per query it scores);
- **what it costs**: ``price(src, unit, PriceArgs) -> Row``: its time per micro-batch, the bytes it keeps per
  recompute choice, its parameters per rank and its transient bytes, written against the pricing context below;
  ``row_variant``: units of the kind priced apart (a sliding-window layer);
- **how it is built**: the ``TransformerLayer`` submodules its unit keeps (``model_specs.builders.unit_spec``) and
  its ``HybridStackSubmodules`` slot;
- **what the aceso runtime runs of it**: ``no_runtime_cp``, its units not under context parallelism yet (the
  runtime's refusal and the aceso search's cp 1 read it: ``search.targets.runtime_rules.layers_cp``);
- **what the cost model's other terms read of it**: whether its units hold routed experts (``routed_experts``: the
  stage's expert shape, EP dispatch, expert parameters) or are the unit megatron-core's EP overlap pairs with the
  routed-experts unit after it (``ep_overlap_partner``, ``ep_overlap_pairs``); its forward kernel launches by part
  (``launches``, ``costmodel.host``), its linears' module paths (``linears``: megatron-core's ``named_modules``
  names under the layer, which ``--te-precision-config-file`` patterns match, and each one's weight parameters per
  rank, ``linear_params``: the memory its recipe keeps), the 2-D weight shards Muon updates
  (``muon_shapes``, ``costmodel.optimizers``) and the input bytes of each module the fine-grained offload moves (``offload_inputs``, ``costmodel.stack_cost``;
  ``te_fused_norm``: the norm transformer-engine's spec fuses into the next linear, which it then does not move).

``register`` adds a kind (``search/layers/__init__.py`` registers the built-in ones in the order a layer runs them,
a test can register its own); ``get``, ``resolve`` (with the variant that applies), ``by_symbol`` and ``kinds`` read
them; ``layer_kinds`` / ``tail_kinds`` make a model's units; ``symbols`` writes its decoder as a hybrid layer
pattern. docs/layer-kinds.md has the recipe for a new kind.

**The pricing context** a pricer receives (``costmodel.analytic.AnalyticSource``): ``model``, ``dt`` (element
bytes), ``kern`` / ``kern_lp`` (the kernel models, bf16 and the low-precision recipe's: ``gemm``, ``gemm_parts``,
``bmm``, ``flash``, ``memory``), ``kern_wide(dtype)``, ``comm`` (the collectives), ``cluster``, ``settings``
(``RunSettings``), ``flash``, ``lp`` (the recipe), and the shared pieces ``attention`` / ``mlp`` (the dense units),
``_half`` (a unit's TP collectives), ``_linears`` (its GEMMs, quantized or not), ``_cp_ring_parts`` (ring
attention's K/V exchange) and ``head`` (final norm, logits, loss), and the cost model's formulas the built-in kinds
share: ``attention_act_bytes``, ``mlp_act_bytes``, ``unit_params_per_rank``, ``ep_all_to_all_ms``, ``mla_attention``,
``mla_act_bytes``, ``mla_params_per_rank``, ``mtp_unit`` and ``moe_unit``. The registry imports nothing of search's;
no kind module imports the cost model (which imports the registry): a pricer reads it through the context.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Literal, NamedTuple

UNAVAILABLE_MS = 1e9     # recompute time of a choice a unit cannot take: never chosen, never inf arithmetic


class UnitCost(NamedTuple):
    """One unit's time per micro-batch on one rank, ms."""

    fwd: float
    bwd: float
    rec_sel: float
    rec_full: float
    tp_comm: float       # fwd + bwd exposed TP collective time inside the unit
    rec_drop: float = UNAVAILABLE_MS   # attn_dropout: the probability dropout + probs x V forward, where it applies
    tp_hidden: float = 0.0             # TP collective time hidden behind the unit's GEMMs
    cp_comm: float = 0.0               # exposed ring-attention K/V exchange (fwd + bwd)
    cp_hidden: float = 0.0
    # the forward's shares (for timelines): TP exposed (without the ring), TP hidden, CP exposed, CP hidden
    comm_fwd: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)
    ep_comm: float = 0.0               # exposed expert-parallel dispatch / combine (+ ETP gather) fwd + bwd
    ep_hidden: float = 0.0             # the part hidden (shared-expert overlap, overlap_ep_comm)
    ep_fwd: tuple[float, float] = (0.0, 0.0)   # the forward's (exposed, hidden) share
    rec_up: float = UNAVAILABLE_MS     # mla_up_proj: MLA's Q/K/V up projections + RoPE forward (MLA units only)
    ep_split: tuple = ()               # moe units: (dispatch, combine, experts' weight-gradient GEMMs) ms, one way
    wgrad: float = 0.0                 # the unit's weight-gradient GEMMs (inside bwd): what delay_wgrad moves
    fwd_before_wait: float = 0.0       # moe units: forward ms before the dispatcher's host wait (moe_cost._before_wait)


class Row(NamedTuple):
    """What a pricer returns for one unit: its time, the bytes it keeps for backward per recompute choice (in
    ``search.spec.plan.RECOMPUTE_CHOICES`` order; a shorter tuple: the choices after it keep ``none``'s), its parameters
    per rank (of which routed experts), and the transient bytes it needs while it runs (MoE's dispatch buffers)."""

    cost: UnitCost
    act: tuple
    params: float
    expert_params: float = 0.0
    transient: float = 0.0


class PriceArgs(NamedTuple):
    """The shape a unit is priced at: per-rank batch ``b``, this unit's tokens per rank ``s`` (the sequence / cp;
    ``s_enc``: the encoder's, which T5's cross-attention reads), tp ``t``, ``cp``, sequence parallelism ``sp``, the
    TP communication overlap ``overlap``, a quantized unit ``lp`` (a low-precision recipe and not a layer kept in
    bf16; with per-module overrides a ``settings.precision_overrides.UnitRecipes``: each linear's recipe, read
    through ``src.recipe_of(lp, name)``), the stage's expert shape ``ep`` / ``etp`` and the plan's
    ``MoEPlanSettings`` ``moe``; ``row(unit)`` prices another unit at the same shape (MTP prices its inner layer's units)."""

    b: float
    s: int
    s_enc: int
    t: int
    cp: int
    sp: bool
    overlap: bool
    lp: Any          # bool, or UnitRecipes (per-module precision)
    ep: int
    etp: int
    moe: Any
    row: Callable


Role = Literal["attention", "mlp", "layer"]


def _always(*_args) -> bool:
    return True


def _plain(*_args) -> bool:
    return False


@dataclass(frozen=True, eq=False)
class LayerKind:
    """One kind of unit (module docstring). Functions take the ``ModelSpec`` first. A record is its own identity
    (compared and hashed as the object)."""

    name: str                                   # ``Unit.kind`` (a variant: the name it prices in place of)
    symbol: str | None                          # megatron-core's hybrid layer symbol (None: it has none)
    role: Role                                  # attention half, MLP half, or a whole layer (MTP)
    params: Callable[..., int]                  # (model) -> unsharded parameters, its norm included
    flops: Callable[..., float]                 # (model, tokens, keys) -> forward FLOPs per sample (keys: None = s)
    price: Callable[..., Row]                   # (src, unit, PriceArgs) -> Row (the pricing context: docstring)
    label: str = ""                             # how reports name it (default: ``name``)
    in_layer: Callable[..., bool] = _always     # (model, stack) -> a layer of that stack holds a unit of it
    replaces: str | None = None                 # the base kind whose unit it takes the place of (its own name) ...
    selects: Callable[..., bool] | None = None  # ... in the layers where (model, stack, layer) says so
    variant_of: str | None = None               # the kind it prices units of, under that kind's name ...
    applies: Callable[..., bool] | None = None  # ... in the models where (model) says so (MLA for attention)
    repeat: Callable[..., int] | None = None    # role "layer": (model) -> units after the decoder's last layer
    keys: Callable[..., int | None] = lambda m, u, s, s_enc: None   # keys per query of ``u`` (None: its tokens)
    row_variant: Callable[..., bool] = _plain   # (model, unit) -> units of this kind priced apart (sliding window)
    recompute: tuple[str, ...] = ("none", "selective", "full")   # the plan's recompute choices its units take
    megatron_modules: dict = field(default_factory=dict)   # plan choice -> the --recompute-modules entry giving it
    layer_parts: tuple[str, ...] = ()           # the ``TransformerLayer`` submodules its unit keeps
    hybrid_slot: str | None = None              # its ``HybridStackSubmodules`` field
    routed_experts: bool = False                # its units hold routed experts (expert shape, EP dispatch)
    ep_overlap_partner: bool = False            # megatron-core's EP overlap pairs it with a routed-experts unit after it
    launches: Callable[..., dict] | None = None           # (model, quantized, n_local, moe) -> launches by part
    linears: tuple[str, ...] = ()               # its transformer-engine linears' module paths under the layer
    #                                             (``settings.precision_overrides``: per-module precision)
    linear_params: Callable[..., tuple] | None = None     # (model, tp, ep, etp) -> each of ``linears``' weight
    #                                             parameters on one rank (0: a linear the model lacks), what its
    #                                             cached quantized copies are charged on (``costmodel.evaluate``)
    muon_shapes: Callable[..., list] | None = None        # (model, tp, ep, etp) -> [(rows, cols, count)] (routed
    #                                                       experts' shards second and third, as ``muon_matrices``)
    offload_inputs: Callable[..., float] | None = None    # (model, module, b, s, t, sp, dt, ep, etp) -> bytes
    te_fused_norm: str | None = None            # the offload module of its norm that megatron-core's TE spec fuses
    #                                             into the next linear (an IdentityOp, whose offload it skips)
    block: str | None = None                    # the ``ModelSpec`` field holding its spec, given exactly when a
    #                                             hybrid pattern writes its symbol (``hybrid.check_model``)
    shape_refusal: Callable[..., str | None] | None = None   # (model, tp, cp) -> why megatron-core refuses that
    #                                             shape for its layers (one line), None: allowed
    no_runtime_cp: str | None = None            # the aceso runtime does not run its units under context
    #                                             parallelism: their name in its refusal ("Mamba-2 layers"); the
    #                                             aceso search keeps cp 1 (``runtime_rules.layers_cp``). None: it runs

    @property
    def text(self) -> str:
        return self.label or self.name


_KINDS: dict[str, LayerKind] = {}


def _key(kind: LayerKind) -> str:
    return kind.name if kind.variant_of is None else f"{kind.variant_of}:{kind.label or kind.symbol}"


def register(kind: LayerKind) -> LayerKind:
    """Add ``kind`` to the registry (its name and symbol must be new; a kind that ``replaces`` another or is a
    ``variant_of`` one needs that one registered first, and its rule). Returns it."""
    base = kind.replaces or kind.variant_of
    if _key(kind) in _KINDS:
        raise ValueError(f"layer kind {_key(kind)!r} is registered already")
    if kind.symbol is not None and any(k.symbol == kind.symbol for k in _KINDS.values()):
        raise ValueError(f"layer kind {kind.name!r}: symbol {kind.symbol!r} belongs to another kind")
    if base is not None and (base not in _KINDS or (kind.selects if kind.replaces else kind.applies) is None):
        raise ValueError(f"layer kind {kind.name!r} takes the place of {base!r}: register that kind first and give "
                         f"{'selects' if kind.replaces else 'applies'}")
    if kind.role == "layer" and kind.repeat is None:
        raise ValueError(f"layer kind {kind.name!r}: a whole-layer kind needs repeat (how many follow the decoder)")
    _KINDS[_key(kind)] = kind
    return kind


def unregister(kind: LayerKind) -> None:
    """Remove ``kind`` (tests register their own and take them out again)."""
    _KINDS.pop(_key(kind), None)


def get(name: str) -> LayerKind:
    """The kind named ``name`` (``Unit.kind``), before any variant."""
    try:
        return _KINDS[name]
    except KeyError:
        names = ", ".join(k.name for k in _KINDS.values() if k.variant_of is None)
        raise ValueError(f"unit kind {name!r} is no registered layer kind ({names})") from None


def resolve(model, name: str) -> LayerKind:
    """The kind that prices ``model``'s units named ``name``: its variant where one applies (MLA for attention)."""
    for k in _KINDS.values():
        if k.variant_of == name and k.applies(model):
            return k
    return get(name)


def kinds() -> tuple[LayerKind, ...]:
    """Every registered kind (variants included), in registration order."""
    return tuple(_KINDS.values())


def by_symbol(symbol: str) -> LayerKind:
    """The kind of megatron-core's hybrid layer symbol ``symbol``."""
    for k in _KINDS.values():
        if k.symbol == symbol:
            return k
    known = "".join(k.symbol for k in _KINDS.values() if k.symbol)
    raise ValueError(f"{symbol!r} is no registered layer symbol ({known})")


# ----- the model as a sequence of units of kinds ----------------------------------------------------------------
def layer_kinds(model, stack: str, layer: int) -> tuple[str, ...]:
    """The unit kinds of layer ``layer`` of ``stack``, in execution order: each base kind the layer holds
    (``in_layer``), or the kind that ``replaces`` it there (``selects``: an MoE layer's ``moe`` for ``mlp``). A model
    written as a hybrid layer pattern (a ``hybrid_layer_pattern`` attribute, as megatron-core's ``HybridModel`` takes
    it; ``ModelSpec`` gains the field with issue 36) has one unit per symbol: layer ``layer`` is its symbol's kind."""
    pattern = getattr(model, "hybrid_layer_pattern", None)
    if pattern and stack == "decoder":
        k = by_symbol(pattern[layer])
        return (k.variant_of or k.name,)
    out = []
    for k in _KINDS.values():
        if k.replaces or k.variant_of or k.role == "layer" or not k.in_layer(model, stack):
            continue
        sub = next((r for r in _KINDS.values() if r.replaces == k.name and r.selects(model, stack, layer)), None)
        out.append((sub or k).name)
    return tuple(out)


def routed_after(model, partner) -> tuple[int, ...]:
    """The routed-experts units (MoE) whose previous unit's kind record satisfies ``partner``."""
    units = model.units
    return tuple(i for i in range(1, len(units)) if resolve(model, units[i].kind).routed_experts
                 and partner(resolve(model, units[i - 1].kind)))


def ep_overlap_pairs(model) -> tuple[int, ...]:
    """The units megatron-core's EP overlap schedules with the unit before them: each routed-experts unit (MoE)
    whose previous unit is its layer's ``ep_overlap_partner`` (self-attention, MLA)."""
    return routed_after(model, lambda k: k.ep_overlap_partner)


def tail_kinds(model) -> tuple[str, ...]:
    """The whole-layer units after the decoder's last layer (MTP: one per depth), in order."""
    return tuple(k.name for k in _KINDS.values() if k.role == "layer" and k.variant_of is None
                 for _ in range(k.repeat(model)))


def mtp_inner_kinds(model) -> tuple[str, str]:
    """The unit kinds of one MTP depth's inner layer: its symbols after '/' in a hybrid pattern (``*E``: attention,
    moe; ``search.layers.hybrid.check_model`` allows an attention-role and an MLP-role symbol), else the last decoder
    layer's (megatron-core's GPT MTP repeats the last layer's spec)."""
    pattern = getattr(model, "hybrid_layer_pattern", None)
    if pattern and "/" in pattern:
        inner = pattern.split("/")[1]
        return tuple((by_symbol(c).variant_of or by_symbol(c).name) for c in inner)
    last = layer_kinds(model, "decoder", model.num_layers - 1)
    return last[0], last[-1]


def symbols(model) -> str:
    """The decoder as megatron-core's hybrid layer pattern (``--hybrid-layer-pattern``): one symbol per unit (the
    variant's where one applies: ``+`` for an MLA model's attention), then ``/`` and the last layer's pattern per
    tail unit (an MTP depth: ``mtp_inner_kinds``). A kind without a symbol (T5's cross-attention) cannot be
    written: ValueError."""
    main, tail = [], 0
    for u in model.units:
        if u.stack != "decoder":
            continue
        k = resolve(model, u.kind)
        if k.role == "layer":
            tail += 1
            continue
        if k.symbol is None:
            raise ValueError(f"{k.text} has no hybrid layer symbol; megatron-core's hybrid models cannot hold it")
        main.append(k.symbol)
    inner = "".join(resolve(model, k).symbol for k in mtp_inner_kinds(model)) if tail else ""
    return "".join(main) + ("/" + inner) * tail


def without_runtime_cp(model) -> tuple[LayerKind, ...]:
    """The kinds of ``model``'s units the aceso runtime does not run under context parallelism (``no_runtime_cp``:
    Mamba-2, GDN), in unit order: its refusal (``search.targets.runtime_rules.layers_cp``) and the aceso search's
    cp 1 (``search.planner.space``) read them."""
    found: dict[str, LayerKind] = {}
    for u in model.units:
        if (k := resolve(model, u.kind)).no_runtime_cp:
            found.setdefault(k.name, k)
    return tuple(found.values())


def shape_refusal(model, tp: int, cp: int = 1) -> str | None:
    """Why megatron-core refuses ``tp`` / ``cp`` for a layer kind of ``model``'s hybrid pattern (each kind's
    ``shape_refusal``: Mamba-2's and GDN's heads per rank), None: every kind allows it."""
    pattern = getattr(model, "hybrid_layer_pattern", None) or ""
    for k in _KINDS.values():
        if k.symbol and k.symbol in pattern and k.shape_refusal is not None:
            why = k.shape_refusal(model, tp, cp)
            if why:
                return why
    return None
