"""Hybrid models as megatron-core builds them: the layer pattern, an architecture record, and its parameter count.

Pattern syntax (megatron-core 0.19.2 ``models/hybrid/hybrid_layer_allocation.py``; 0.17 on in
``ssm/mamba_hybrid_layer_allocation.py``): one symbol per decoder layer, ``M`` Mamba-2, ``G`` gated delta net, ``*``
attention, ``D`` DeepSeek sparse attention, ``+`` MLA (0.19), ``-`` MLP, ``E`` MoE; ``|`` cuts the main pattern into
pipeline segments (``pp x vp`` of them, segment ``vp_stage * pp + pp_rank`` on each rank); ``/`` starts the MTP
part, one identical pattern per MTP depth (``"M*M*/*E/*E"``: 4 layers, 2 MTP depths of ``*E``). megatron-core
0.16.1 knows ``M * - E`` only, without ``|`` or ``/`` (``--hybrid-override-pattern``). ``*`` may not be mixed with
``D`` or ``+``.

``HybridArch`` is an architecture record in megatron-core's terms (``model_specs/hybrid/*.json``, each field with
its source); ``search.spec.hybrid_arch.counts`` gives its parameters from ``search.layers.mamba`` (Mamba layers), ``search.spec.model`` /
``search.layers.moe_params`` (attention, MLP, MoE, embeddings) and the LatentMoE projections of megatron-core's
``MoELayer`` (``moe_latent_size``: the router reads h; ``fc1_latent_proj`` h -> latent before dispatch and
``fc2_latent_proj`` latent -> h after combine; routed experts map latent -> ffn -> latent; the shared expert stays
at h). An MTP depth (``MultiTokenPredictionLayer``) is ``enorm``, ``hnorm``, ``eh_proj`` (2h -> h), the layers of
its pattern and a final norm; with ``mtp_use_repeated_layer`` all depths share one block's weights.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, JsonValue, model_validator

from . import kind as _kinds
from .mamba import Mamba2Spec, shape as mamba_shape

_STRICT = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)
# megatron-core 0.19's layer symbols (hybrid_layer_allocation.Symbols), in its order; what each is, is its registered
# layer kind's (search.layers), and for the two aceso has no kind for yet, here
MEGATRON_SYMBOLS = "MG*D+-E"
UNREGISTERED = {"D": "ds_attention"}
PIPE, MTP = "|", "/"
SYMBOLS_0_16 = frozenset("M*-E")
DATA = Path(__file__).resolve().parents[2] / "model_specs" / "hybrid"


def symbol_name(symbol: str) -> str:
    """What megatron-core's layer symbol ``symbol`` is: its registered kind's name (a variant's label: ``mla``),
    else the name of a megatron-core layer aceso has no kind for (``ds_attention``)."""
    if symbol in UNREGISTERED:
        return UNREGISTERED[symbol]
    k = _kinds.by_symbol(symbol)
    return k.name if k.variant_of is None else k.text.lower()


class Pattern(NamedTuple):
    segments: tuple[str, ...]     # the main pattern cut at '|' (one segment: no cut)
    mtp: str | None               # the pattern of one MTP depth
    mtp_depths: int

    @property
    def layers(self) -> str:
        return "".join(self.segments)


def parse_pattern(pattern: str) -> Pattern:
    """A hybrid layer pattern as megatron-core 0.19's ``parse_hybrid_pattern`` reads it (ValueError, one line)."""
    main, *mtp = pattern.split(MTP)
    bad = sorted({c for c in main if c not in MEGATRON_SYMBOLS and c != PIPE})
    if bad:
        raise ValueError(f"hybrid pattern: '{bad[0]}' is not a layer symbol (valid: {MEGATRON_SYMBOLS} and "
                         f"'{PIPE}' between pipeline segments)")
    if mtp and all(p == "" for p in mtp):
        mtp = []
    if mtp:
        if any(p != mtp[0] for p in mtp):
            raise ValueError(f"hybrid pattern: every MTP depth must repeat one pattern, got {'/'.join(mtp)}")
        bad = sorted({c for c in mtp[0] if c not in MEGATRON_SYMBOLS})
        if bad:
            raise ValueError(f"hybrid pattern: '{bad[0]}' is not a layer symbol of an MTP pattern")
    for part in [main, *mtp[:1]]:
        if "*" in part and ("D" in part or "+" in part):
            raise ValueError("hybrid pattern: attention '*' cannot be mixed with DSA 'D' or MLA '+'")
    segments = tuple(main.split(PIPE)) if main else ("",)
    return Pattern(segments, mtp[0] if mtp else None, len(mtp))


def pipeline_refusal(pattern: Pattern, pp: int, vp: int = 1) -> str | None:
    """How megatron-core 0.17-0.19 places the segments (``select_pipeline_segment``): with ``|``, segment
    ``vp_stage * pp + pp_rank`` on each rank's virtual stage, so VPP runs with ``pp x vp`` segments; without, one
    pattern split evenly by layer count over pp and no VPP (it raises for a ``vp_stage``);
    ``num_layers_in_first/last_pipeline_stage`` can make the ends uneven there, not modelled here."""
    if len(pattern.segments) > 1:
        if len(pattern.segments) != pp * vp:
            return (f"hybrid pattern has {len(pattern.segments)} pipeline segments; pp x vp = {pp * vp} "
                    f"must equal it")
        return None
    if vp > 1:
        return ("virtual pipeline stages of a hybrid model need '|' segments in the pattern (megatron-core 0.17-0.19 "
                "select_pipeline_segment places segment vp_stage x pp + pp_rank, and raises without '|')")
    if len(pattern.layers) % pp:
        return f"{len(pattern.layers)} layers without '|' cuts must divide evenly over pp ({pp})"
    return None


# ----- a ModelSpec written as a pattern --------------------------------------------------------------------------
def check_model(model) -> None:
    """The rules megatron-core 0.19 / Megatron-LM apply to a hybrid model, for ``ModelSpec.hybrid_layer_pattern``
    and ``ModelSpec.mamba`` (ValueError, one line naming the field and the fix). Megatron-LM derives ``--num-layers``
    from the main pattern (``get_hybrid_total_layer_count``: its symbols without '|') and ``--mtp-num-layers`` from
    the depths after '/' (training/arguments.py, ``validate_args``); '|' cuts are a plan's, not the model's."""

    pattern = model.hybrid_layer_pattern
    if pattern is None:
        for k in _kinds.kinds():         # a kind only a pattern writes (Mamba-2, GDN) needs the pattern
            if k.block and not (k.replaces or k.variant_of) and getattr(model, k.block) is not None:
                raise ValueError(f"{k.block}: a {k.text} block needs hybrid_layer_pattern (its '{k.symbol}' layers); "
                                 f"add the pattern or remove {k.block}")
        return
    if model.is_t5:
        raise ValueError("hybrid_layer_pattern is for gpt/llama decoders (megatron-core's HybridModel), not t5; "
                         "remove it")
    if PIPE in pattern:
        raise ValueError("hybrid_layer_pattern: '|' stage cuts are the plan's, not the model's; remove them")
    p = parse_pattern(pattern)
    if not p.layers:
        raise ValueError("hybrid_layer_pattern: the main pattern (before '/') has no layer; give one symbol per layer")
    for c in p.layers + (p.mtp or ""):
        try:
            _kinds.by_symbol(c)
        except ValueError:
            raise ValueError(f"hybrid_layer_pattern: '{c}' ({symbol_name(c)}) layers are not supported by aceso yet; "
                             f"use {''.join(k.symbol for k in _kinds.kinds() if k.symbol)}") from None
    if len(p.layers) != model.num_layers:
        raise ValueError(f"num_layers ({model.num_layers}) must equal the layers of hybrid_layer_pattern "
                         f"({len(p.layers)} before '/'; Megatron-LM derives --num-layers from the pattern)")
    if p.mtp_depths != (model.mtp_num_layers or 0):
        raise ValueError(f"mtp_num_layers ({model.mtp_num_layers}) must equal the MTP depths of hybrid_layer_pattern "
                         f"({p.mtp_depths}: one '/' and its symbols per depth; Megatron-LM infers "
                         "--mtp-num-layers from them)")
    if p.mtp is not None:
        roles = [_kinds.by_symbol(c).role for c in p.mtp]
        if roles != ["attention", "mlp"]:
            raise ValueError(f"hybrid_layer_pattern: an MTP depth is priced as one attention and one MLP or MoE layer "
                             f"('*E', '*-'); '{p.mtp}' is not supported yet")
    used = p.layers + (p.mtp or "")
    for k in _kinds.kinds():
        if k.block is None or k.symbol is None:
            continue
        have = getattr(model, k.block)
        if (k.symbol in used) != (have is not None):
            raise ValueError(f"{k.block}: give it exactly when hybrid_layer_pattern has '{k.symbol}' layers "
                             f"({'add' if have is None else 'remove'} it)")
    if model.mla is None and "*" not in used and "+" not in used:
        pass        # an attention-free hybrid (pure Mamba) is allowed, as megatron-core builds it
    if model.moe is not None and (model.moe.moe_layer_freq != 1 or model.moe.first_k_dense_layers):
        raise ValueError("moe.moe_layer_freq / moe.first_k_dense_layers: in a hybrid model the pattern's 'E' says "
                         "which layers are MoE; remove them")
    if model.mamba is not None:
        mamba_shape(model.mamba, model.hidden_size)      # MambaMixer's own shape assertions


def export_refusal(model, target: str) -> str | None:
    """Why the export cannot write ``model`` for ``target`` (None: it can): a model with Mamba-2 layers runs as
    Megatron-LM's ``pretrain_hybrid.py`` with ``--hybrid-layer-pattern`` (the Megatron-LM export's only form for it,
    ``search/megatron/hybrid_pattern.py``), or as a Megatron-Bridge Nemotron-H recipe (``bridge_hybrid.py``, Mamba-2
    only); the Aceso reference's op-level config has neither."""
    what = "Mamba-2" if model.mamba is not None else "GDN" if model.gdn is not None else None
    if what is None or target == "megatron-lm" or (target == "megatron-bridge" and model.gdn is None):
        return None
    if target == "megatron-bridge":
        return (f"--to megatron-bridge: model {model.name} has GDN layers, which aceso's Megatron-Bridge hybrid "
                "recipe does not write; export it with --to megatron-lm (pretrain_hybrid.py)")
    return (f"--to {target}: model {model.name} has {what} layers (hybrid_layer_pattern); export it with --to "
            "megatron-lm (pretrain_hybrid.py)" + (" or --to megatron-bridge" if model.gdn is None else ""))


def mtp_layer(model) -> str | None:
    """The pattern of one MTP depth of ``model`` (None: no MTP, or not a hybrid model)."""
    pattern = model.hybrid_layer_pattern
    return parse_pattern(pattern).mtp if pattern else None


# ----- architecture record ---------------------------------------------------------------------------------------
class HybridMoE(BaseModel):
    model_config = _STRICT

    num_experts: int = Field(gt=1)
    moe_router_topk: int = Field(gt=0)
    moe_ffn_hidden_size: int = Field(gt=0)
    moe_shared_expert_intermediate_size: int | None = Field(None, gt=0)
    moe_latent_size: int | None = Field(None, gt=0, description="LatentMoE: experts run at this width.")
    moe_router_score_function: Literal["softmax", "sigmoid"] = "softmax"
    moe_router_topk_scaling_factor: float | None = None
    moe_router_enable_expert_bias: bool = False
    moe_router_load_balancing_type: str = "aux_loss"
    moe_aux_loss_coeff: float = 0.0
    moe_router_dtype: str | None = None
    moe_router_num_groups: int | None = None
    moe_router_group_topk: int | None = None


class HybridArch(BaseModel):
    """A hybrid model in megatron-core ``TransformerConfig`` / ``HybridModel`` terms; ``sources`` names where each
    field comes from (keys of ``references``)."""

    model_config = _STRICT

    name: str
    hybrid_layer_pattern: str = Field(description="Main decoder pattern (no '|' cuts: where to cut is a plan's).")
    mtp_pattern: str | None = Field(None, description="One MTP depth's pattern (megatron-core's text after '/').")
    mtp_num_layers: int = Field(0, ge=0, description="MTP depths run in training.")
    mtp_use_repeated_layer: bool = Field(False, description="All MTP depths share one block's weights.")
    hidden_size: int = Field(gt=0)
    ffn_hidden_size: int = Field(gt=0)
    num_attention_heads: int = Field(gt=0)
    num_query_groups: int = Field(gt=0)
    kv_channels: int = Field(gt=0)
    mamba: Mamba2Spec
    moe: HybridMoE | None = None
    vocab_size: int = Field(gt=0)
    make_vocab_size_divisible_by: int = Field(128, gt=0)
    seq_length: int = Field(gt=0)
    max_position_embeddings: int = Field(gt=0)
    normalization: Literal["RMSNorm", "LayerNorm"] = "RMSNorm"
    layernorm_epsilon: float = 1e-5
    activation: Literal["squared_relu", "swiglu", "gelu"] = "squared_relu"
    add_bias_linear: bool = False
    position_embedding_type: Literal["none", "rope", "learned_absolute"] = "none"
    untie_embeddings_and_output_weights: bool = True
    init_method_std: float | None = Field(None, gt=0, description="The weights' init std (None: megatron-core's 0.02).")
    mtp_loss_scaling_factor: float | None = Field(None, gt=0, description="The MTP losses' weight (None: "
                                                  "megatron-core's 0.1).")
    sources: dict[str, str] = Field(description="field -> key of references (a dotted name for nested fields).")
    references: dict[str, str] = Field(description="key -> where: repository, file, revision.")
    published: dict[str, JsonValue] = Field(description="Published totals to check the counts against.")
    uncertain: list[str] = Field(default_factory=list)

    @model_validator(mode="after")
    def _check(self) -> "HybridArch":
        pattern = parse_pattern(self.full_pattern)
        if PIPE in self.hybrid_layer_pattern:
            raise ValueError("hybrid_layer_pattern: an architecture has no '|' cuts (they are a plan's)")
        if ("E" in pattern.layers + (pattern.mtp or "")) != (self.moe is not None):
            raise ValueError("moe: give it exactly when the pattern has 'E' layers")
        if (self.mtp_pattern is None) != (self.mtp_num_layers == 0):
            raise ValueError("mtp_pattern and mtp_num_layers go together")
        missing = sorted(set(self.sources.values()) - set(self.references))
        if missing:
            raise ValueError(f"sources: reference '{missing[0]}' is not in references")
        return self

    @property
    def full_pattern(self) -> str:
        """The unified megatron-core 0.19 pattern (main, then one ``/pattern`` per MTP depth)."""
        return self.hybrid_layer_pattern + "".join(MTP + self.mtp_pattern for _ in range(self.mtp_num_layers))

    @property
    def num_layers(self) -> int:
        return len(self.hybrid_layer_pattern)


def load(name: str, folder: Path = DATA) -> HybridArch:
    return HybridArch.model_validate(json.loads((folder / f"{name}.json").read_text()))


def available(folder: Path = DATA) -> list[str]:
    return sorted(p.stem for p in folder.glob("*.json"))
