"""Turn a Hugging Face config.json (GPT-2, Llama/Mistral, T5 styles) into a model spec file.

Reads the file only: no download, no transformers import. Fields map as follows:
GPT-2 (``model_type`` gpt2): n_layer, n_embd, n_head, n_inner (default 4h), n_positions, vocab_size; gelu,
layernorm, learned positions, tied embeddings, biases.
Llama-style (llama, mistral, qwen2; with experts/MLA/MTP, search.hf_moe: mixtral, qwen3, qwen3_moe, deepseek_v3,
kimi_k2, gpt_oss): num_hidden_layers, hidden_size, num_attention_heads, num_key_value_heads,
intermediate_size, max_position_embeddings, vocab_size, rope_theta, tie_word_embeddings; swiglu, rmsnorm, rope,
no biases.
T5 (t5, mt5): num_layers, num_decoder_layers, d_model, num_heads, d_kv, d_ff, vocab_size; the sequence lengths
are not in a T5 config: --seq-length (encoder, default 512) and --decoder-seq-length (default 128).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import pydantic

from ..argtypes import positive_int
from ..errors import AcesoError, format_validation_error, read_json
from ..hf_moe import MOE_TYPES, moe_fields
from ..model import ModelSpec
from .common import check_output, write_output

_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="a Hugging Face config.json")
    p.add_argument("-o", "--output", default="-", help="spec file to write (.json), or - for stdout")
    p.add_argument("--name", default=None, help="model name in the spec (default: the folder or model_type)")
    p.add_argument("--seq-length", type=positive_int, default=None, help="sequence length (T5: encoder length)")
    p.add_argument("--decoder-seq-length", type=positive_int, default=None, help="T5 decoder length (default 128)")


class _Config:
    """Typed reads of a config.json: a wrong type (``"n_layer": "12"``, ``"rope_theta": "fast"``, ``NaN``) is one
    ``AcesoError`` line naming the config's own key."""

    def __init__(self, cfg: dict, source: str) -> None:
        self.cfg, self.source = cfg, source

    def _find(self, keys: tuple[str, ...]):
        for k in keys:
            if self.cfg.get(k) is not None:
                return k, self.cfg[k]
        return keys[0], None

    def _bad(self, key: str, value, want: str) -> AcesoError:
        return AcesoError(f"{self.source}: {key} is {json.dumps(value)[:40]}; it must be {want}")

    def int(self, *keys: str, default: int | None = None, required: bool = True) -> int | None:
        key, v = self._find(keys)
        if v is None:
            if default is None and required:
                raise AcesoError(f"{self.source}: field {keys[0]} is missing; this does not look like a complete "
                                 "config.json")
            return default
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise self._bad(key, v, "a positive integer")
        return v

    def float(self, *keys: str, default: float) -> float:
        key, v = self._find(keys)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise self._bad(key, v, "a finite number")
        return float(v)

    def bool(self, key: str, default: bool) -> bool:
        v = self.cfg.get(key)
        if v is None:
            return default
        if not isinstance(v, bool):
            raise self._bad(key, v, "true or false")
        return v

    def str(self, key: str, default: str = "") -> str:
        v = self.cfg.get(key)
        if v is None:
            return default
        if not isinstance(v, str):
            raise self._bad(key, v, "a string")
        return v


def hf_to_spec(cfg: dict, source: str = "config.json", name: str | None = None, seq_length: int | None = None,
               decoder_seq_length: int | None = None) -> ModelSpec:
    c = _Config(cfg, source)
    mtype = c.str("model_type").lower()
    dtype = _DTYPES.get(c.str("torch_dtype"), "bf16")
    name = name or c.str("_name_or_path") or mtype or "hf-model"
    if mtype in ("gpt2",):
        h = c.int("n_embd", "hidden_size")
        data = dict(
            family="gpt", num_layers=c.int("n_layer", "num_hidden_layers"), hidden_size=h,
            num_attention_heads=c.int("n_head", "num_attention_heads"),
            ffn_hidden_size=c.int("n_inner", default=4 * h),
            seq_length=seq_length or c.int("n_positions", "n_ctx"),
            vocab_size=c.int("vocab_size"), activation="gelu", normalization="layernorm",
            position_embedding="learned", tied_embeddings=True, add_bias_linear=True, params_dtype="fp16",
            attention_dropout=c.float("attn_pdrop", default=0.1), hidden_dropout=c.float("resid_pdrop", default=0.1))
    elif mtype in ("llama", "mistral", "qwen2") + MOE_TYPES:
        heads = c.int("num_attention_heads")
        data = dict(
            family="llama", num_layers=c.int("num_hidden_layers"),
            hidden_size=c.int("hidden_size"), num_attention_heads=heads,
            num_query_groups=c.int("num_key_value_heads", default=heads), kv_channels=c.int("head_dim", required=False),
            ffn_hidden_size=c.int("intermediate_size"),
            seq_length=seq_length or c.int("max_position_embeddings"),
            vocab_size=c.int("vocab_size"), activation="swiglu", normalization="rmsnorm",
            position_embedding="rope", rotary_base=c.float("rope_theta", default=10000.0),
            tied_embeddings=c.bool("tie_word_embeddings", False),
            add_bias_linear=c.bool("attention_bias", False), params_dtype=dtype,
            attention_dropout=c.float("attention_dropout", default=0.0),
            hidden_dropout=c.float("hidden_dropout", default=0.0))
        data.update(moe_fields(c, mtype, data["num_layers"]))      # experts, MLA, MTP (search.hf_moe)
    elif mtype in ("t5", "mt5"):
        act = "swiglu" if c.str("feed_forward_proj", "relu").startswith("gated") else "gelu"
        layers = c.int("num_layers")
        data = dict(
            family="t5", num_layers=layers, num_decoder_layers=c.int("num_decoder_layers", default=layers),
            hidden_size=c.int("d_model"), num_attention_heads=c.int("num_heads"),
            kv_channels=c.int("d_kv"), ffn_hidden_size=c.int("d_ff"),
            seq_length=seq_length or 512, decoder_seq_length=decoder_seq_length or 128,
            vocab_size=c.int("vocab_size"), activation=act, normalization="layernorm",
            position_embedding="learned", tied_embeddings=c.bool("tie_word_embeddings", True),
            add_bias_linear=True, params_dtype=dtype,
            attention_dropout=c.float("dropout_rate", default=0.1), hidden_dropout=c.float("dropout_rate", default=0.1))
    else:
        raise AcesoError(
            f"{source}: model_type '{mtype}' is not supported; supported: gpt2, llama, mistral, qwen2, "
            f"{', '.join(MOE_TYPES)}, t5, mt5"
        )
    data["name"] = str(name)[:200]
    try:
        return ModelSpec.model_validate({k: v for k, v in data.items() if v is not None})
    except pydantic.ValidationError as e:
        raise AcesoError(f"{source}: " + format_validation_error(e)) from None


def convert_to_file(config_path: str, output: str, **kw) -> int:
    path = Path(config_path)
    check_output(output)
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
