"""Turn a Hugging Face config.json (GPT-2, Llama/Mistral, T5 styles) into a model spec file.

Reads the file only: no download, no transformers import. Fields map as follows:
GPT-2 (``model_type`` gpt2): n_layer, n_embd, n_head, n_inner (default 4h), n_positions, vocab_size; gelu,
layernorm, learned positions, tied embeddings, biases.
Llama-style (llama, mistral, qwen2): num_hidden_layers, hidden_size, num_attention_heads, num_key_value_heads,
intermediate_size, max_position_embeddings, vocab_size, rope_theta, tie_word_embeddings; swiglu, rmsnorm, rope,
no biases.
T5 (t5, mt5): num_layers, num_decoder_layers, d_model, num_heads, d_kv, d_ff, vocab_size; the sequence lengths
are not in a T5 config: --seq-length (encoder, default 512) and --decoder-seq-length (default 128).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pydantic

from ..errors import AcesoError, format_validation_error, read_json
from ..model import ModelSpec
from .common import write_output

_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="a Hugging Face config.json")
    p.add_argument("-o", "--output", default="-", help="spec file to write (.json), or - for stdout")
    p.add_argument("--name", default=None, help="model name in the spec (default: the folder or model_type)")
    p.add_argument("--seq-length", type=int, default=None, help="sequence length (T5: encoder length)")
    p.add_argument("--decoder-seq-length", type=int, default=None, help="T5 decoder length (default 128)")


def _get(cfg: dict, source: str, *keys: str, default=None):
    for k in keys:
        if k in cfg and cfg[k] is not None:
            return cfg[k]
    if default is not None:
        return default
    raise AcesoError(f"{source}: field {keys[0]} is missing; this does not look like a complete config.json")


def hf_to_spec(cfg: dict, source: str = "config.json", name: str | None = None, seq_length: int | None = None,
               decoder_seq_length: int | None = None) -> ModelSpec:
    mtype = str(cfg.get("model_type", "")).lower()
    dtype = _DTYPES.get(str(cfg.get("torch_dtype", "")), "bf16")
    name = name or cfg.get("_name_or_path") or mtype or "hf-model"
    if mtype in ("gpt2",):
        h = _get(cfg, source, "n_embd", "hidden_size")
        data = dict(
            family="gpt", num_layers=_get(cfg, source, "n_layer", "num_hidden_layers"), hidden_size=h,
            num_attention_heads=_get(cfg, source, "n_head", "num_attention_heads"),
            ffn_hidden_size=cfg.get("n_inner") or 4 * h,
            seq_length=seq_length or _get(cfg, source, "n_positions", "n_ctx"),
            vocab_size=_get(cfg, source, "vocab_size"), activation="gelu", normalization="layernorm",
            position_embedding="learned", tied_embeddings=True, add_bias_linear=True, params_dtype="fp16",
            attention_dropout=cfg.get("attn_pdrop", 0.1), hidden_dropout=cfg.get("resid_pdrop", 0.1))
    elif mtype in ("llama", "mistral", "qwen2"):
        heads = _get(cfg, source, "num_attention_heads")
        data = dict(
            family="llama", num_layers=_get(cfg, source, "num_hidden_layers"),
            hidden_size=_get(cfg, source, "hidden_size"), num_attention_heads=heads,
            num_query_groups=cfg.get("num_key_value_heads") or heads, kv_channels=cfg.get("head_dim"),
            ffn_hidden_size=_get(cfg, source, "intermediate_size"),
            seq_length=seq_length or _get(cfg, source, "max_position_embeddings"),
            vocab_size=_get(cfg, source, "vocab_size"), activation="swiglu", normalization="rmsnorm",
            position_embedding="rope", rotary_base=float(cfg.get("rope_theta", 10000.0)),
            tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            add_bias_linear=bool(cfg.get("attention_bias", False)), params_dtype=dtype,
            attention_dropout=cfg.get("attention_dropout", 0.0), hidden_dropout=cfg.get("hidden_dropout", 0.0))
    elif mtype in ("t5", "mt5"):
        if str(cfg.get("feed_forward_proj", "relu")).startswith("gated"):
            act = "swiglu"
        else:
            act = "gelu"
        layers = _get(cfg, source, "num_layers")
        data = dict(
            family="t5", num_layers=layers, num_decoder_layers=cfg.get("num_decoder_layers") or layers,
            hidden_size=_get(cfg, source, "d_model"), num_attention_heads=_get(cfg, source, "num_heads"),
            kv_channels=_get(cfg, source, "d_kv"), ffn_hidden_size=_get(cfg, source, "d_ff"),
            seq_length=seq_length or 512, decoder_seq_length=decoder_seq_length or 128,
            vocab_size=_get(cfg, source, "vocab_size"), activation=act, normalization="layernorm",
            position_embedding="learned", tied_embeddings=bool(cfg.get("tie_word_embeddings", True)),
            add_bias_linear=True, params_dtype=dtype,
            attention_dropout=cfg.get("dropout_rate", 0.1), hidden_dropout=cfg.get("dropout_rate", 0.1))
    else:
        raise AcesoError(
            f"{source}: model_type '{mtype}' is not supported; supported: gpt2, llama, mistral, qwen2, t5, mt5"
        )
    data["name"] = str(name)
    try:
        return ModelSpec.model_validate({k: v for k, v in data.items() if v is not None})
    except pydantic.ValidationError as e:
        raise AcesoError(f"{source}: " + format_validation_error(e)) from None


def convert_to_file(config_path: str, output: str, **kw) -> int:
    path = Path(config_path)
    cfg = read_json(path)
    if not isinstance(cfg, dict):
        raise AcesoError(f"{path}: a config.json must be a JSON object")
    kw.setdefault("name", path.parent.name or None)
    spec = hf_to_spec(cfg, source=str(path), **kw)
    write_output(spec.model_dump_json(indent=2, exclude_none=True) + "\n", output)
    return 0


def run(args: argparse.Namespace) -> int:
    return convert_to_file(args.config, args.output, name=args.name, seq_length=args.seq_length,
                           decoder_seq_length=args.decoder_seq_length)
