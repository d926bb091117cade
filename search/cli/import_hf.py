"""Turn a Hugging Face config.json (GPT-2, Llama-style, T5 types) into a model spec file.

Reads the file only: no download, no transformers import. Every field of the config is kept, or the import stops
naming it (``search.spec.hf_config``: a field aceso does not know may change the architecture):
GPT-2 (``model_type`` gpt2): n_layer, n_embd, n_head, n_inner (default 4h), n_positions, vocab_size; gelu,
layernorm, learned positions, tied embeddings, biases.
Llama-style (llama, mistral, qwen2; with experts/MLA/MTP, search.spec.hf_moe: mixtral, qwen2_moe, qwen3, qwen3_moe,
deepseek_v3, kimi_k2, glm4_moe, gpt_oss): num_hidden_layers, hidden_size, num_attention_heads, num_key_value_heads,
head_dim, intermediate_size, vocab_size, tie_word_embeddings; swiglu, rmsnorm, rope; biases, QK norms, RoPE
base and scaling, sliding windows and the norm epsilon as search.spec.hf_arch reads them. Gemma and Llama 4 are refused
with the field megatron-core 0.16.1 cannot build.
Nemotron-H / Nemotron-3 (nemotron_h): the hybrid layer pattern, the Mamba-2 mixer and the experts as
search.spec.hf_hybrid reads them (LatentMoE refused).
T5 (t5, mt5): num_layers, num_decoder_layers, d_model, num_heads, d_kv, d_ff, vocab_size, as Megatron-LM's T5
(pretrain_t5.py: learned positions, LayerNorm, biases); the sequence lengths are not in a T5 config:
--seq-length (encoder, default 512) and --decoder-seq-length (default 128).

The training sequence length is ``--seq-length``, else ``min(context, 4096)`` with a note: a config's
``max_position_embeddings`` (Qwen2.5: 131072) is the longest context the model takes, not the length it trains at.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pydantic

from search.io.argtypes import positive_int
from search.io.errors import AcesoError, format_validation_error, read_json
from search.spec.hf_arch import NORM_EPSILON, llama_style, refuse_type
from search.spec.hf_config import HFConfig
from search.spec.hf_hybrid import nemotron_h_fields
from search.spec.hf_moe import MLA_TYPES, MOE_TYPES, moe_fields
from search.spec.model import ModelSpec
from .common import check_output, write_output

_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
DEFAULT_SEQ = 4096               # the training length when --seq-length is not given (and the context is longer)
LLAMA_TYPES = ("llama", "mistral", "qwen2") + MOE_TYPES
_GELU = ("gelu", "gelu_new", "gelu_fast", "gelu_pytorch_tanh")   # GPT-2's GELUs: megatron-core's gelu
# spec field -> the config keys it is read from (a bound the spec checks is reported under the config's own key)
CONFIG_KEYS = {
    "num_layers": ("num_hidden_layers", "n_layer", "num_layers"), "num_decoder_layers": ("num_decoder_layers",),
    "hidden_size": ("hidden_size", "n_embd", "d_model"), "num_attention_heads": ("num_attention_heads", "n_head",
                                                                                 "num_heads"),
    "num_query_groups": ("num_key_value_heads",), "kv_channels": ("head_dim", "v_head_dim", "d_kv"),
    "ffn_hidden_size": ("intermediate_size", "n_inner", "d_ff"), "vocab_size": ("vocab_size",),
    "rotary_base": ("rope_theta",), "attention_dropout": ("attention_dropout", "attn_pdrop", "dropout_rate"),
    "hidden_dropout": ("hidden_dropout", "resid_pdrop", "dropout_rate"), "mtp_num_layers": ("num_nextn_predict_layers",),
    "moe.num_experts": ("n_routed_experts", "num_local_experts", "num_experts"),
    "moe.moe_router_topk": ("num_experts_per_tok", "experts_per_token"),
    "moe.moe_ffn_hidden_size": ("moe_intermediate_size", "intermediate_size"),
    "moe.first_k_dense_layers": ("first_k_dense_replace",), "moe.moe_router_num_groups": ("n_group",),
    "moe.moe_router_group_topk": ("topk_group",), "moe.moe_aux_loss_coeff": ("aux_loss_alpha", "router_aux_loss_coef"),
    **{f"mla.{k}": (v,) for k, v in (("q_lora_rank", "q_lora_rank"), ("kv_lora_rank", "kv_lora_rank"),
                                    ("qk_head_dim", "qk_nope_head_dim"), ("qk_pos_emb_head_dim", "qk_rope_head_dim"),
                                    ("v_head_dim", "v_head_dim"))},
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="a Hugging Face config.json")
    p.add_argument("-o", "--output", default="-", help="spec file to write (.json), or - for stdout")
    p.add_argument("--name", default=None, help="model name in the spec (default: the folder or model_type)")
    p.add_argument("--seq-length", type=positive_int, default=None,
                   help=f"training sequence length (default: the model's context, at most {DEFAULT_SEQ}; T5: the "
                        "encoder length, default 512)")
    p.add_argument("--decoder-seq-length", type=positive_int, default=None, help="T5 decoder length (default 128)")


def _seq(c: HFConfig, keys: tuple[str, ...], given: int | None, notes: list[str]) -> int:
    """``given``, else the model's context capped at ``DEFAULT_SEQ`` (noted when capped)."""
    context = c.int(*keys)
    if given is not None:
        return given
    if context > DEFAULT_SEQ:
        notes.append(f"seq_length {DEFAULT_SEQ}: {keys[0]} {context} is the longest context the model takes, not "
                     "a training length; give --seq-length N to plan another")
    return min(context, DEFAULT_SEQ)


def _gpt2(c: HFConfig, seq: int | None, notes: list[str]) -> dict:
    h = c.int("n_embd", "hidden_size")
    act = c.str("activation_function", "gelu_new")
    if act not in _GELU:
        raise c.refuse("activation_function", f"GPT-2 with another activation than GELU ({', '.join(_GELU)}) is "
                       "not megatron-core's GPT")
    c.expect("scale_attn_weights", lambda v: v is True, "attention without the 1/sqrt(head dim) scale is not "
             "megatron-core's")
    c.expect("scale_attn_by_inverse_layer_idx", lambda v: v is False, "per-layer attention scaling is not "
             "megatron-core's")
    c.ignore("embd_pdrop", "reorder_and_upcast_attn", "summary_type", "summary_use_proj", "summary_activation",
             "summary_proj_to_labels", "summary_first_dropout", "n_special", "predict_special_tokens")
    eps = c.float("layer_norm_epsilon", default=NORM_EPSILON)     # the head's fields, dropout: Megatron's hidden one
    return dict(
        family="gpt", num_layers=c.int("n_layer", "num_hidden_layers"), hidden_size=h,
        num_attention_heads=c.int("n_head", "num_attention_heads"),
        ffn_hidden_size=c.int("n_inner", default=4 * h),
        seq_length=_seq(c, ("n_positions", "n_ctx"), seq, notes),
        vocab_size=c.int("vocab_size"), activation="gelu", normalization="layernorm",
        position_embedding="learned", tied_embeddings=True, add_bias_linear=True, params_dtype="fp16",
        attention_dropout=c.float("attn_pdrop", default=0.1), hidden_dropout=c.float("resid_pdrop", default=0.1),
        megatron={"layernorm_epsilon": eps} if eps != NORM_EPSILON else None)


def _llama(c: HFConfig, mtype: str, dtype: str, seq: int | None, notes: list[str]) -> dict:
    heads, layers = c.int("num_attention_heads"), c.int("num_hidden_layers")
    groups = c.int("num_key_value_heads", default=heads)
    if mtype in MLA_TYPES and groups != heads:
        raise c.refuse("num_key_value_heads", f"multi-latent attention has no query groups (heads {heads})")
    data = dict(
        family="llama", num_layers=layers, hidden_size=c.int("hidden_size"), num_attention_heads=heads,
        num_query_groups=None if mtype in MLA_TYPES else groups,     # MLA: Megatron-LM asserts no GQA
        kv_channels=c.int("head_dim", required=False),
        ffn_hidden_size=c.int("intermediate_size"),
        seq_length=_seq(c, ("max_position_embeddings",), seq, notes),
        vocab_size=c.int("vocab_size"), activation="swiglu", normalization="rmsnorm", position_embedding="rope",
        tied_embeddings=c.bool("tie_word_embeddings", False), params_dtype=dtype,
        attention_dropout=c.float("attention_dropout", default=0.0),
        hidden_dropout=c.float("hidden_dropout", default=0.0))
    data.update(llama_style(c, mtype, layers, mtype in MLA_TYPES))   # biases, QK norms, RoPE, windows, epsilon
    moe = moe_fields(c, mtype, layers)                                 # experts, MLA, MTP (search.spec.hf_moe)
    block = {**(data.get("megatron") or {}), **(moe.pop("megatron", None) or {})}
    return {**data, **moe, "megatron": block or None}


def _t5(c: HFConfig, dtype: str, seq: int | None, dec: int | None, notes: list[str]) -> dict:
    act = "swiglu" if c.str("feed_forward_proj", "relu").startswith("gated") else "gelu"
    # Megatron-LM's T5 (pretrain_t5.py) has learned positions, LayerNorm and biases: HF T5's relative position
    # buckets, its norm epsilon and activation details are not carried over (the note says so)
    c.ignore("relative_attention_num_buckets", "relative_attention_max_distance", "layer_norm_epsilon",
             "is_encoder_decoder", "dense_act_fn", "is_gated_act", "n_positions", "output_past",
             "gradient_checkpointing")
    notes.append("imported as Megatron-LM's T5 (pretrain_t5.py: learned absolute positions, LayerNorm, linear "
                 "biases), not HF T5's relative position buckets and RMS norm")
    if seq is None or dec is None:
        notes.append("seq_length 512 / decoder_seq_length 128 where not given: a T5 config has no sequence length; "
                     "give --seq-length and --decoder-seq-length")
    layers = c.int("num_layers")
    return dict(
        family="t5", num_layers=layers, num_decoder_layers=c.int("num_decoder_layers", default=layers),
        hidden_size=c.int("d_model"), num_attention_heads=c.int("num_heads"),
        kv_channels=c.int("d_kv"), ffn_hidden_size=c.int("d_ff"),
        seq_length=seq or 512, decoder_seq_length=dec or 128,
        vocab_size=c.int("vocab_size"), activation=act, normalization="layernorm",
        position_embedding="learned", tied_embeddings=c.bool("tie_word_embeddings", True),
        add_bias_linear=True, params_dtype=dtype,
        attention_dropout=c.float("dropout_rate", default=0.1), hidden_dropout=c.float("dropout_rate", default=0.1))


def hf_to_spec(cfg: dict, source: str = "config.json", name: str | None = None, seq_length: int | None = None,
               decoder_seq_length: int | None = None, notes: list[str] | None = None) -> ModelSpec:
    """The spec of a config.json's model (``notes`` collects what the reader chose, e.g. the sequence length)."""
    notes = [] if notes is None else notes
    c = HFConfig(cfg, source)
    mtype = c.str("model_type").lower()
    if not mtype:
        raise AcesoError(f"{source}: field model_type is missing; this does not look like a complete config.json")
    refusal = refuse_type(c, mtype)
    if refusal is not None:
        raise refusal
    dtype = _DTYPES.get(c.str("torch_dtype") or c.str("dtype"), "bf16")
    name = name or c.str("_name_or_path") or mtype or "hf-model"
    if mtype in ("gpt2",):
        data = _gpt2(c, seq_length, notes)
    elif mtype in LLAMA_TYPES:
        data = _llama(c, mtype, dtype, seq_length, notes)
    elif mtype in ("t5", "mt5"):
        data = _t5(c, dtype, seq_length, decoder_seq_length, notes)
    elif mtype == "nemotron_h":
        data = {**nemotron_h_fields(c, _seq(c, ("max_position_embeddings",), seq_length, notes)),
                "params_dtype": dtype}
    else:
        raise AcesoError(
            f"{source}: model_type '{mtype}' is not supported; supported: gpt2, {', '.join(LLAMA_TYPES)}, t5, mt5, "
            "nemotron_h")
    c.check_all_read(f"model_type {mtype}")
    data["name"] = str(name)[:200]
    try:
        return ModelSpec.model_validate({k: v for k, v in data.items() if v is not None})
    except pydantic.ValidationError as e:
        raise AcesoError(f"{source}: " + format_validation_error(
            e, names=lambda path: next((k for k in CONFIG_KEYS.get(path, ()) if k in cfg), None))) from None


def convert_to_file(config_path: str, output: str, prog: str = "aceso import-hf", **kw) -> int:
    path = Path(config_path)
    check_output(output)
    cfg = read_json(path)
    if not isinstance(cfg, dict):
        raise AcesoError(f"{path}: a config.json must be a JSON object")
    kw.setdefault("name", path.parent.name or None)
    notes: list[str] = []
    spec = hf_to_spec(cfg, source=str(path), notes=notes, **kw)
    write_output(spec.model_dump_json(indent=2, exclude_none=True) + "\n", output)
    for note in notes:
        print(f"{prog}: note: {note}", file=sys.stderr)
    return 0


def run(args: argparse.Namespace) -> int:
    return convert_to_file(args.config, args.output, name=args.name, seq_length=args.seq_length,
                           decoder_seq_length=args.decoder_seq_length)
