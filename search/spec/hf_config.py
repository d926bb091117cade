"""Typed, accounted reads of a Hugging Face ``config.json`` (``search.cli.import_hf`` and its helpers).

Every read names the config's own key when the value is wrong (``"n_layer": "12"``, ``"rope_theta": "fast"``,
``NaN``, an enum value aceso does not know such as ``"scoring_func": "sqrtsoftplus"``): one ``AcesoError`` line.
The reader records the keys it reads; ``check_all_read`` refuses a key nobody read unless it is in ``BENIGN``
(token ids, generation and inference settings, weight storage: fields that do not change the architecture a
training run builds). A field aceso does not know might change the architecture, so the import stops and names it
rather than converting a different model.
"""

from __future__ import annotations

import json
import math

from search.io.errors import AcesoError

# transformers' PretrainedConfig attributes and model-card fields that do not change the trained architecture
BENIGN = frozenset({
    "architectures", "auto_map", "_name_or_path", "transformers_version", "torch_dtype", "dtype", "model_type",
    "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id", "use_cache",
    "initializer_range", "initializer_factor", "output_router_logits", "quantization_config",
    "_attn_implementation_autoset", "_attn_implementation", "attn_implementation", "return_dict",
    "output_hidden_states", "output_attentions", "torchscript", "use_bfloat16", "id2label", "label2id",
    "problem_type", "task_specific_params", "finetuning_task", "tokenizer_class", "prefix", "chunk_size_feed_forward",
    "pruned_heads", "is_decoder", "add_cross_attention", "tie_encoder_decoder", "cache_implementation",
    "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups", "diversity_penalty",
    "temperature", "top_k", "top_p", "typical_p", "repetition_penalty", "length_penalty", "no_repeat_ngram_size",
    "encoder_no_repeat_ngram_size", "bad_words_ids", "num_return_sequences", "output_scores",
    "return_dict_in_generate", "forced_bos_token_id", "forced_eos_token_id", "remove_invalid_values",
    "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens", "use_return_dict",
    "pretraining_tp",            # Llama 2's sliced matmuls of the same weights (an inference detail)
    "ep_size",                   # DeepSeek's inference expert parallelism
    "for_llm_compressor",
})


class HFConfig:
    """Reads of one config object (``prefix``: ``"text_config."`` for a multimodal wrapper's language model)."""

    def __init__(self, cfg: dict, source: str, prefix: str = "") -> None:
        self.cfg, self.source, self.prefix = cfg, source, prefix
        self.seen: set[str] = set()

    # ----- errors
    def bad(self, key: str, value, want: str) -> AcesoError:
        return AcesoError(f"{self.source}: {self.prefix}{key} is {json.dumps(value)[:40]}; it must be {want}")

    def refuse(self, key: str, why: str, shown: str | None = None) -> AcesoError:
        """A field aceso cannot build or price, named with its value (or ``shown``)."""
        value = shown or json.dumps(self.cfg.get(key))[:60]
        return AcesoError(f"{self.source}: {self.prefix}{key} {value}: {why}")

    # ----- reads (each marks its keys as read)
    def has(self, key: str) -> bool:
        return self.cfg.get(key) is not None

    def raw(self, key: str, default=None):
        self.seen.add(key)
        v = self.cfg.get(key)
        return default if v is None else v

    def _find(self, keys: tuple[str, ...]):
        self.seen.update(keys)
        for k in keys:
            if self.cfg.get(k) is not None:
                return k, self.cfg[k]
        return keys[0], None

    def int(self, *keys: str, default: int | None = None, required: bool = True, minimum: int = 1) -> int | None:
        key, v = self._find(keys)
        if v is None:
            if default is None and required:
                raise AcesoError(f"{self.source}: field {self.prefix}{keys[0]} is missing; this does not look like "
                                 "a complete config.json")
            return default
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
            raise self.bad(key, v, "a positive integer" if minimum == 1 else f"an integer of at least {minimum}")
        return v

    def float(self, *keys: str, default: float) -> float:
        key, v = self._find(keys)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise self.bad(key, v, "a finite number")
        return float(v)

    def bool(self, key: str, default: bool) -> bool:
        v = self.raw(key)
        if v is None:
            return default
        if not isinstance(v, bool):
            raise self.bad(key, v, "true or false")
        return v

    def str(self, key: str, default: str = "") -> str:
        v = self.raw(key)
        if v is None:
            return default
        if not isinstance(v, str):
            raise self.bad(key, v, "a string")
        return v

    def choice(self, key: str, known: tuple[str, ...], default: str) -> str:
        """An enum value: one of ``known`` (``default`` when absent); any other value is refused, never read as the
        default."""
        v = self.str(key, default)
        if v not in known:
            raise AcesoError(f"{self.source}: {self.prefix}{key} '{v[:40]}' is not one aceso's import knows "
                             f"({', '.join(known)}); the model is not supported")
        return v

    def dict(self, key: str) -> dict | None:
        v = self.raw(key)
        if v is not None and not isinstance(v, dict):
            raise self.bad(key, v, "an object")
        return v

    def expect(self, key: str, ok, why: str) -> None:
        """Refuse ``key`` unless it is absent or ``ok(value)``."""
        v = self.raw(key)
        if v is not None and not ok(v):
            raise self.refuse(key, why)

    def ignore(self, *keys: str) -> None:
        """Fields read and deliberately not used (each documented where it is called)."""
        self.seen.update(keys)

    def nested(self, key: str) -> "HFConfig":
        """The reader of a nested config object (``text_config``)."""
        sub = self.dict(key)
        if sub is None:
            raise AcesoError(f"{self.source}: field {self.prefix}{key} is missing; this does not look like a complete "
                             "config.json")
        return HFConfig(sub, self.source, f"{self.prefix}{key}.")

    def check_all_read(self, what: str) -> None:
        """Refuse the first key nobody read that is not ``BENIGN`` (``what``: "model_type qwen2", ...)."""
        unknown = sorted(k for k in self.cfg if k not in self.seen and k not in BENIGN)
        if unknown:
            more = f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""
            raise AcesoError(f"{self.source}: {self.prefix}{unknown[0]}{more}: a field aceso's import does not know "
                             f"for {what}; it may change the architecture, so nothing is converted "
                             "(delete it from a copy of the config if it does not)")
