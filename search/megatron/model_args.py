"""The model flags of a Megatron-LM command line -> ``ModelSpec`` (with Megatron-LM's defaults), named after the
preset it is, if any.

Vocabulary: Megatron-LM takes it from the tokenizer, which a command line names but does not contain. In order:
aceso's own ``--vocab-size`` option; ``--padded-vocab-size P`` (the model's exact vocabulary); ``--vocab-size N``
(NullTokenizer: N + 1 before Megatron-LM 0.18, which adds the EOD token, N from 0.18; other tokenizers: N); else the vocabulary of the preset whose architecture the
flags match; else an error asking for aceso's ``--vocab-size``. Padding: ``--make-vocab-size-divisible-by k``
(default 128) pads to a multiple of ``k * tp``, so the plan's ``make_vocab_size_divisible_by`` is ``k * tp``.
"""

from __future__ import annotations

import pydantic

from model_specs import presets as model_presets

from search.io.errors import AcesoError, format_validation_error
from search.spec.megatron_fields import NO_COST
from search.spec.model import ModelSpec
from search.spec.presets import load_model
from . import layer_variant_flags
from .expressible import T5_ROTARY_BASE
from .moe_flags import moe_model_fields

# fields that name a preset's architecture (everything but labels, precision, dropout rates and padding)
_LABELS = {"name", "family", "aceso_db_key", "nominal_params_b", "params_dtype", "attention_dropout",
           "hidden_dropout", "make_vocab_size_divisible_by"}
# MoESpec fields a run sets (loss type and coefficient, token dropping, the load-balance assumption): a command line
# with other values is still the preset's architecture (the model keeps the command line's values, the preset's name)
_MOE_RUN = {"moe_aux_loss_coeff", "moe_router_load_balancing_type", "moe_expert_capacity_factor",
            "moe_router_force_load_balancing", "moe_imbalance_factor", "moe_pad_expert_input_to_capacity"}


def model_from_flags(f, tp: int, t5: bool, notes: list[str], vocab_size: int | None = None):
    """``(ModelSpec, attention)``: attention is flash (``--transformer-impl transformer_engine``, the default) or
    unfused (``--transformer-impl local``, or ``--attention-backend unfused|local``)."""
    def need(name: str, alt: str | None = None):
        v = f.get(name) if f.has(name) or alt is None else f.get(alt)
        if v is None:
            raise AcesoError(f"{name} is missing; Megatron-LM requires it")
        return v

    num_layers = need("--encoder-num-layers", "--num-layers") if t5 and not f.has("--num-layers") \
        else need("--num-layers")
    if t5 and f.has("--decoder-num-layers") and f.get("--decoder-num-layers") != num_layers:
        notes.append(f"--decoder-num-layers {f.get('--decoder-num-layers')} is not used by pretrain_t5.py "
                     f"({f.release.tag}), which builds {num_layers} decoder layers (--num-layers)")
    h, heads = need("--hidden-size"), need("--num-attention-heads")
    swiglu = f.has("--swiglu")
    ffn = f.get("--ffn-hidden-size", int((4 * h * 2 / 3) / 64) * 64 if swiglu else 4 * h)
    kv = f.get("--kv-channels")
    groups = f.get("--num-query-groups") if f.has("--group-query-attention") else None
    if f.has("--num-query-groups") and not f.has("--group-query-attention"):
        notes.append("--num-query-groups without --group-query-attention: Megatron-LM uses multi-head attention")
    pos = "rope" if f.has("--use-rotary-position-embeddings") else f.value("--position-embedding-type")
    if f.has("--no-position-embedding") and pos != "rope":
        raise AcesoError(f"--no-position-embedding with --position-embedding-type {pos}: {f.release.label} "
                         "raises (deprecated, use --position-embedding-type); with rope it runs RoPE")
    if pos not in ("learned_absolute", "rope", "yarn"):
        raise AcesoError(f"--position-embedding-type {pos}: aceso models learned_absolute, rope and yarn only")
    norm = f.value("--normalization")
    if norm not in ("LayerNorm", "RMSNorm"):
        raise AcesoError(f"--normalization {norm}: aceso models LayerNorm and RMSNorm only")
    if f.has("--bf16") and f.has("--fp16"):
        raise AcesoError("--bf16 and --fp16 together: Megatron-LM asserts one of them")
    impl = f.value("--transformer-impl")
    if impl not in ("transformer_engine", "local"):
        raise AcesoError(f"--transformer-impl {impl}: aceso plans transformer_engine or local layers")
    seq = need("--encoder-seq-length", "--seq-length") if t5 and not f.has("--seq-length") else need("--seq-length")
    spec = {
        "name": "custom", "family": "t5" if t5 else ("llama" if swiglu and norm == "RMSNorm" else "gpt"),
        "num_layers": num_layers, "num_decoder_layers": num_layers if t5 else None, "hidden_size": h,
        "num_attention_heads": heads, "num_query_groups": groups, "kv_channels": kv,
        "ffn_hidden_size": ffn, "seq_length": seq,
        "decoder_seq_length": need("--decoder-seq-length") if t5 else None,
        "activation": "swiglu" if swiglu else "gelu", "normalization": norm.lower(),
        "position_embedding": "rope" if pos in ("rope", "yarn") else "learned",   # yarn: arch_flags' rope_scaling
        "rotary_base": float(f.value("--rotary-base")),
        "tied_embeddings": not f.has("--untie-embeddings-and-output-weights"),
        "add_bias_linear": not f.has("--disable-bias-linear"),
        "attention_dropout": f.value("--attention-dropout"), "hidden_dropout": f.value("--hidden-dropout"),
        "params_dtype": "bf16" if f.has("--bf16") else "fp16" if f.has("--fp16") else "fp32",
    }
    spec.update(layer_variant_flags.read(f))       # --window-size, --softmax-type, --quick-geglu, ...
    if t5:
        _t5_rope(spec, pos, f, notes)
    if spec["activation"] == "quick_geglu" and norm == "RMSNorm":
        spec["family"] = "llama"
    moe = moe_model_fields(f, num_layers, ffn, spec["position_embedding"], notes)
    spec["megatron"] = {**(spec.get("megatron") or {}), **(moe.pop("megatron", None) or {})} or None
    spec.update(moe)
    spec.update(_vocab(f, tp, vocab_size))
    model = _named(spec, notes)
    backend = f.value("--attention-backend")
    if backend not in ("auto", "flash", "fused", "unfused", "local"):
        raise AcesoError(f"--attention-backend {backend}: use auto, flash, fused, unfused or local")
    return model, ("unfused" if impl == "local" or backend in ("unfused", "local") else "flash")


def _t5_rope(spec: dict, pos: str, f, notes: list[str]) -> None:
    """The RoPE pretrain_t5.py trains: ``T5Model`` (megatron-core 0.16.1 to 0.19.2) takes --rotary-percent but no
    rotary base and no scaling (``expressible.t5_rope_refusal``), and builds rotary embeddings for ``rope`` only."""
    if pos == "yarn":
        raise AcesoError(f"--position-embedding-type yarn with pretrain_t5.py: {f.release.label}'s T5Model builds "
                         "rotary embeddings for rope only (with yarn it trains without positions); use rope")
    if spec["position_embedding"] != "rope":
        return
    if spec.get("rope_scaling") is not None:
        notes.append(f"--use-rope-scaling is not used by pretrain_t5.py ({f.release.tag}): T5Model takes no RoPE "
                     "scaling; the plan models the plain RoPE it trains")
        spec["rope_scaling"] = None
    if spec["rotary_base"] != T5_ROTARY_BASE:
        notes.append(f"--rotary-base {spec['rotary_base']:g} is not used by pretrain_t5.py ({f.release.tag}): "
                     f"T5Model's RoPE runs base {T5_ROTARY_BASE:g}; the plan models that")
        spec["rotary_base"] = T5_ROTARY_BASE


def _vocab(f, tp: int, given: int | None) -> dict:
    k = f.value("--make-vocab-size-divisible-by")
    if given is not None:
        return {"vocab_size": given, "make_vocab_size_divisible_by": k * tp}
    if f.has("--padded-vocab-size"):
        return {"vocab_size": f.get("--padded-vocab-size"), "make_vocab_size_divisible_by": 1}
    if f.has("--vocab-size"):
        n = f.get("--vocab-size")
        if n < 1:
            raise AcesoError(f"--vocab-size {n}: give the tokenizer's vocabulary size (at least 1)")
        return {"vocab_size": f.release.null_vocab(n) if f.get("--tokenizer-type") == "NullTokenizer" else n,
                "make_vocab_size_divisible_by": k * tp}
    return {"vocab_size": None, "make_vocab_size_divisible_by": k * tp}


def _named(spec: dict, notes: list[str]) -> ModelSpec:
    """The model named after the preset with this architecture (any depth), else ``custom``. Head width and
    query groups compare by value (``kv_channels`` None and ``hidden / heads`` are the same model)."""
    vocab_known = spec["vocab_size"] is not None
    mine = _validated({**spec, "vocab_size": spec["vocab_size"] or 1})
    for name in model_presets.preset_names():
        preset = load_model(name)
        if preset.is_t5 != mine.is_t5 or (preset.moe is None) != (mine.moe is None):
            continue
        if preset.num_layers != mine.num_layers:
            try:
                preset = load_model(name, num_layers=mine.num_layers)
            except (AcesoError, ValueError):          # its layer pattern does not fit this depth
                continue
        if _architecture(preset, vocab_known) == _architecture(mine, vocab_known):
            spec = {**spec, **{k: getattr(preset, k) for k in ("name", "family", "aceso_db_key", "nominal_params_b",
                                                               "kv_channels", "num_query_groups")}}
            if not vocab_known:
                spec["vocab_size"] = preset.vocab_size
                notes.append(f"vocabulary: {preset.vocab_size} tokens, the preset {name}'s (the command line's "
                             "tokenizer sets it; give --vocab-size to change it)")
            break
    if spec["vocab_size"] is None:
        raise AcesoError("the vocabulary size is not in the command line (its tokenizer sets it) and the "
                         "architecture is no preset's; give aceso's --vocab-size N")
    return _validated(spec)


def _architecture(m: ModelSpec, with_vocab: bool) -> dict:
    d = {k: v for k, v in m.model_dump().items()
         if k not in _LABELS and k not in ("kv_channels", "num_query_groups", "rope_scaling")
         and (with_vocab or k != "vocab_size")}
    if d.get("moe"):        # the router's training settings are the run's, not the architecture
        d["moe"] = {k: v for k, v in d["moe"].items() if k not in _MOE_RUN}
    # numerics that cost nothing (norm epsilon, top-k scaling; RoPE scaling above): the model keeps the command
    # line's values under the preset's name, as with the router settings
    d["megatron"] = {k: v for k, v in (d.get("megatron") or {}).items() if k not in NO_COST} or None
    return {**d, "head_dim": m.head_dim, "groups": m.groups}


def _validated(spec: dict) -> ModelSpec:
    try:
        return ModelSpec.model_validate({k: v for k, v in spec.items() if v is not None or k == "name"})
    except pydantic.ValidationError as e:
        raise AcesoError("the model flags: " + format_validation_error(e, names=_flag_of)) from None


def _flag_of(path: str) -> str | None:
    """The Megatron-LM flag of a spec field (``moe.moe_router_topk`` -> ``--moe-router-topk``), if it has one."""
    from .cmdline import megatron_flags

    flag = "--" + path.split(".", 1)[-1].replace("_", "-")
    return flag if flag in megatron_flags() else None
