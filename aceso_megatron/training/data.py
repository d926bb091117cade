"""Training data through megatron-core's dataset stack, and ``aceso data prepare``.

``prepare`` turns a JSON-lines corpus into a megatron-core indexed dataset (``PREFIX.bin``/``PREFIX.idx``, written
by ``IndexedDatasetBuilder``) the way Megatron-LM's ``tools/preprocess_data.py`` does: one document per line, an
end-of-document token appended (GPT), or one item per sentence (``split_sentences``, which T5's masked datasets
need).

torch and megatron-core are imported inside the functions, so ``aceso data prepare`` reports bad input without
loading them. ``build_datasets`` builds the train/valid/test splits with ``BlendedMegatronDatasetBuilder``:
``GPTDataset`` (``MockGPTDataset`` for ``--mock-data``) for GPT/Llama, ``T5MaskedWordPieceDataset`` for T5 (mock:
``MockT5Dataset`` below; megatron-core 0.16 has no mock T5). Data order is a pure function of the step: step ``i``
of the training run consumes samples ``[i * global_batch, (i + 1) * global_batch)`` of the train split, micro-batch
``m`` the ``m``-th run of ``micro_batch_size`` of them. So resuming needs only the iteration count, and every plan
(and a single process) sees the same samples in the same micro-batches. """

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy

from search.io.errors import AcesoError
from search.spec.model import ModelSpec

from .tokenizer import load_tokenizer

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+|\n+")


# ----- aceso data prepare -----------------------------------------------------------------------------------------
def prepare(input_path: str, tokenizer_spec: str, output_prefix: str, json_key: str = "text",
            split_sentences: bool = False) -> dict:
    """Tokenize ``input_path`` (JSON lines) into ``output_prefix.bin/.idx``; returns counts for the report."""
    src = Path(input_path)
    if not src.is_file():
        raise AcesoError(f"{input_path}: no such input file; give a .jsonl file with one JSON object per line")
    out = Path(output_prefix)
    if not out.parent.exists():
        raise AcesoError(f"-o {output_prefix}: folder {out.parent} does not exist; create it first")
    tok = load_tokenizer(tokenizer_spec)
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    dtype = DType.optimal_dtype(tok.vocab_size)
    tmp = str(out.parent / f".{out.name}.tmp{os.getpid()}")
    builder = IndexedDatasetBuilder(tmp + ".bin", dtype=dtype)
    docs = tokens = 0
    try:
        with open(src, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                text = _text_of(line, json_key, input_path, lineno)
                items = _items(tok, text, split_sentences)
                if not items:
                    continue
                if not split_sentences:
                    items[-1].append(tok.eod)
                flat = [t for it in items for t in it]
                builder.add_document(numpy.array(flat, dtype=dtype), [len(it) for it in items])
                docs += 1
                tokens += len(flat)
        if docs == 0:
            raise AcesoError(f"{input_path}: no documents with a non-empty '{json_key}'; nothing to write")
        builder.finalize(tmp + ".idx")
        os.replace(tmp + ".bin", str(out) + ".bin")
        os.replace(tmp + ".idx", str(out) + ".idx")
    finally:
        builder.data_file.close()
        for ext in (".bin", ".idx"):
            if os.path.exists(tmp + ext):
                os.unlink(tmp + ext)
    return {"documents": docs, "tokens": tokens, "vocab_size": tok.vocab_size, "dtype": numpy.dtype(dtype).name,
            "prefix": str(out), "tokenizer": tokenizer_spec}


def _text_of(line: str, key: str, path: str, lineno: int) -> str:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise AcesoError(f"{path}:{lineno}: not valid JSON ({e.msg}); one JSON object per line") from None
    if not isinstance(obj, dict) or key not in obj:
        raise AcesoError(f"{path}:{lineno}: no '{key}' field; choose the text field with --json-key")
    if not isinstance(obj[key], str):
        raise AcesoError(f"{path}:{lineno}: '{key}' is not a string")
    return obj[key]


def _items(tok, text: str, split_sentences: bool) -> list[list[int]]:
    parts = [p for p in _SENTENCE_END.split(text) if p.strip()] if split_sentences else [text]
    return [ids for ids in (tok.tokenize(p) for p in parts) if ids]


# ----- datasets for training --------------------------------------------------------------------------------------
@dataclass
class DataConfig:
    """Where samples come from: a blend of data prefixes (megatron ``--data-path`` form) or mock data."""

    data_path: list[str] | None
    split: str = "969,30,1"
    mock: bool = False
    tokenizer: str = "byte"
    seed: int = 1234
    cache_dir: str | None = None


class _MockTokenizer:
    """For mock GPT data: the model's vocabulary, the last id as end of document."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.eod = self.eos = vocab_size - 1
        self.pad = -1
        self.unique_identifiers = {"class": "mock", "vocab_size": vocab_size}


def _tokenizer_for(model: ModelSpec, cfg: DataConfig):
    if cfg.mock:
        return _MockTokenizer(model.vocab_size)
    tok = load_tokenizer(cfg.tokenizer)
    if tok.vocab_size > model.vocab_size:
        raise AcesoError(
            f"the plan's model has vocab_size {model.vocab_size} but tokenizer {cfg.tokenizer} has "
            f"{tok.vocab_size} ids; make a plan for a model with vocab_size >= {tok.vocab_size}"
        )
    return tok


def build_datasets(model: ModelSpec, cfg: DataConfig, num_samples: tuple[int, int, int]):
    """(train, valid, test) datasets; ``num_samples`` per split (None: one epoch). Call on every rank (the builder
    synchronises)."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.utils import get_blend_from_list

    if not cfg.mock and not cfg.data_path:
        raise AcesoError("no training data: give --data-path PREFIX (from `aceso data prepare`) or --mock-data")
    if not cfg.mock:
        for p in get_blend_from_list(cfg.data_path)[0]:
            if not (os.path.exists(p + ".bin") and os.path.exists(p + ".idx")):
                raise AcesoError(f"--data-path {p}: no {p}.bin/.idx; create them with `aceso data prepare`")
    if not cfg.mock:
        _check_splits(cfg, need_valid=bool(num_samples[1]))
    else:  # "Unable to save MockGPTDataset indexes because path_to_cache is None", once per split and rank
        logging.getLogger("megatron.core.datasets").setLevel(logging.ERROR)
    if model.is_t5 and cfg.mock:
        return tuple(MockT5Dataset(model, n or 1000, cfg.seed + i) for i, n in enumerate(num_samples))
    tok = _tokenizer_for(model, cfg)
    common = dict(random_seed=cfg.seed, sequence_length=model.seq_length, tokenizer=tok,
                  path_to_cache=cfg.cache_dir)
    if not cfg.mock:
        common.update(blend=get_blend_from_list(cfg.data_path), split=cfg.split)
    if model.is_t5:
        from megatron.core.datasets.t5_dataset import T5MaskedWordPieceDataset, T5MaskedWordPieceDatasetConfig

        config = T5MaskedWordPieceDatasetConfig(
            **common, sequence_length_decoder=model.decoder_seq_length, masking_probability=0.15,
            short_sequence_probability=0.1, masking_max_ngram=10, masking_do_full_word=False,
            masking_do_permutation=False, masking_use_longer_ngrams=False, masking_use_geometric_distribution=True)
        cls = T5MaskedWordPieceDataset
    else:
        from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset

        config = GPTDatasetConfig(**common, reset_position_ids=False, reset_attention_mask=False,
                                  eod_mask_loss=False, create_attention_mask=False)
        cls = MockGPTDataset if cfg.mock else GPTDataset
    return tuple(BlendedMegatronDatasetBuilder(cls, list(num_samples), lambda: True, config).build())


def _check_splits(cfg: DataConfig, need_valid: bool) -> None:
    """Every split we draw from must hold documents (megatron-core loops forever on an empty one)."""
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix, parse_and_normalize_split)
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from megatron.core.datasets.utils import get_blend_from_list

    try:
        matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(cfg.split))
    except (AssertionError, ValueError, ZeroDivisionError):
        raise AcesoError(f"--split {cfg.split}: give three non-negative weights, e.g. 969,30,1") from None
    for prefix in get_blend_from_list(cfg.data_path)[0]:
        docs = IndexedDataset(prefix).document_indices.shape[0] - 1
        for i, name in ((0, "train"), (1, "valid")):
            if i == 1 and not need_valid:
                continue
            bounds = matrix[i]
            n = 0 if bounds is None else int(round(bounds[1] * docs)) - int(round(bounds[0] * docs))
            if n <= 0:
                raise AcesoError(
                    f"--split {cfg.split} leaves the {name} split of {prefix} without documents (it has {docs}); "
                    "use a bigger corpus or give that split more weight, e.g. --split 90,10,0"
                )


class MockT5Dataset:
    """Deterministic synthetic T5 samples in megatron-core's T5 format (megatron-core 0.16 has no mock T5).

    Like megatron-core's mock GPT data, runs of consecutive ids: the encoder reads ``start .. start+s_enc-1``,
    the decoder continues the run, so the loss falls quickly.
    """

    def __init__(self, model: ModelSpec, num_samples: int, seed: int) -> None:
        self.model, self.num_samples, self.seed = model, num_samples, seed

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, idx: int) -> dict[str, numpy.ndarray]:
        m = self.model
        start = int(numpy.random.default_rng((self.seed, idx)).integers(m.vocab_size))
        enc = (start + numpy.arange(m.seq_length, dtype=numpy.int64)) % m.vocab_size
        dec = (start + m.seq_length + numpy.arange(m.decoder_seq_length + 1, dtype=numpy.int64)) % m.vocab_size
        ones = numpy.ones(m.decoder_seq_length, dtype=numpy.int64)
        return {"text_enc": enc, "text_dec": dec[:-1], "labels": dec[1:], "loss_mask": ones, "truncated": 0,
                "enc_mask": numpy.ones(m.seq_length, dtype=numpy.int64), "dec_mask": ones}


# ----- batches ----------------------------------------------------------------------------------------------------
def collate(samples: list[dict]) -> dict:
    """Stack samples into a batch of tensors (``[n, ...]``)."""
    import torch

    out = {}
    for key in samples[0]:
        vals = [s[key] for s in samples]
        out[key] = torch.stack([torch.as_tensor(numpy.asarray(v)) for v in vals])
    return out


#: runtime micro-batch key -> dataset sample key (megatron-core's GPT and T5 datasets)
GPT_KEYS = {"tokens": "tokens", "labels": "labels", "loss_mask": "loss_mask"}
T5_KEYS = {"enc_tokens": "text_enc", "dec_tokens": "text_dec", "labels": "labels", "loss_mask": "loss_mask"}


def batch_keys(model: ModelSpec) -> dict[str, str]:
    return T5_KEYS if model.is_t5 else GPT_KEYS


class BatchSource:
    """The micro-batches of a training step or of an evaluation, a pure function of the step index.

    Micro-batches carry the keys the runtime reads (``batch_keys``), full pipeline micro-batches: every rank
    gets the same ones and the runtime takes its DP replica's slice.
    """

    def __init__(self, dataset, global_batch_size: int, micro_batch_size: int, keys: dict[str, str]) -> None:
        self.dataset = dataset
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.keys = keys

    def _sample(self, i: int) -> dict:
        s = self.dataset[i % len(self.dataset)]
        out = {k: s[src] for k, src in self.keys.items()}
        out["labels"] = numpy.maximum(numpy.asarray(out["labels"]), 0)  # T5 pads labels with -1
        return out

    def micro_batches(self, step: int) -> list[dict]:
        """The full pipeline micro-batches of global batch ``step`` (samples wrap around the dataset)."""
        start = step * self.global_batch_size
        return [collate([self._sample(i) for i in range(lo, lo + self.micro_batch_size)])
                for lo in range(start, start + self.global_batch_size, self.micro_batch_size)]


def num_samples_needed(train_iters: int, eval_iters: int, global_batch_size: int) -> tuple[int, int, int]:
    """Samples per split for the builder: every training step, and the fixed evaluation batches."""
    return (train_iters * global_batch_size, eval_iters * global_batch_size if eval_iters else None, None)
