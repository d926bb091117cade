"""Prepare training data: tokenize a JSON-lines corpus into a megatron-core indexed dataset.

  aceso data prepare corpus.jsonl --tokenizer byte -o data/corpus
  aceso data prepare corpus.jsonl --tokenizer hf:/path/to/tokenizer -o data/corpus --json-key content

writes data/corpus.bin and data/corpus.idx (train with `aceso train PLAN --data-path data/corpus`); the folder is
created if needed. Tokenizers: `byte` (UTF-8 bytes + special tokens, 363 ids, no files needed) or `hf:PATH`, a
local Hugging Face tokenizer folder (needs `transformers` or `tokenizers`; nothing is downloaded).
"""

from __future__ import annotations

import argparse
import json
import os
import warnings

from search.io.errors import AcesoError


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="data_command", metavar="ACTION", required=True)
    prep = sub.add_parser("prepare", help="tokenize JSON lines into PREFIX.bin/.idx")
    prep.add_argument("input", help="JSON-lines file, one document per line")
    prep.add_argument("--tokenizer", default="byte", help="byte (default) or hf:PATH (local Hugging Face folder)")
    prep.add_argument("-o", "--output-prefix", required=True, help="output prefix: writes PREFIX.bin and PREFIX.idx")
    prep.add_argument("--json-key", default="text", help="field holding the text (default: text)")
    prep.add_argument("--split-sentences", action="store_true",
                      help="one item per sentence (for T5's masked datasets) instead of one per document")
    prep.add_argument("--json", action="store_true", help="print the summary as JSON")


def check(args: argparse.Namespace) -> None:
    """The arguments, before torch or megatron-core is imported (one line, exit 2)."""
    from search.io.files import check_output

    from ..training.args import _check_tokenizer

    if not os.path.exists(args.input):
        raise AcesoError(f"{args.input}: no such input file; give a .jsonl file with one JSON object per line")
    if os.path.isdir(args.input):
        raise AcesoError(f"{args.input}: is a folder; give a .jsonl file with one JSON object per line")
    _check_tokenizer(args.tokenizer)
    if not args.json_key:
        raise AcesoError("--json-key '': give the name of the field that holds the text")
    prefix = args.output_prefix
    if not prefix or prefix.endswith(("/", os.sep)) or os.path.isdir(prefix):
        raise AcesoError(f"-o {prefix!r}: give a prefix such as data/corpus (writes data/corpus.bin and .idx), "
                         "not a folder")
    for ext in (".bin", ".idx"):
        if prefix.endswith(ext):
            raise AcesoError(f"-o {prefix}: give the prefix without {ext}: -o {prefix[:-len(ext)]}")
    folder = os.path.dirname(prefix)
    if folder and os.path.exists(folder) and not os.path.isdir(folder):
        raise AcesoError(f"-o {prefix}: {folder} is not a folder")
    if not folder or os.path.isdir(folder):
        for ext in (".bin", ".idx"):
            target = prefix + ext
            if os.path.lexists(target) and not os.path.isfile(target):
                raise AcesoError(f"-o {prefix}: {target} exists and is not a regular file; choose another prefix")
            check_output(target, "-o")


def run(args: argparse.Namespace) -> int:
    check(args)
    folder = os.path.dirname(args.output_prefix)
    created = []
    if folder and not os.path.isdir(folder):
        parts = []
        while folder and not os.path.isdir(folder):
            parts.append(folder)
            folder = os.path.dirname(folder)
        try:
            for d in reversed(parts):
                os.mkdir(d)
                created.append(d)
        except OSError as e:
            _remove(created)
            raise AcesoError(f"-o {args.output_prefix}: cannot create folder {d} ({e.strerror})") from None
    try:
        stats = _prepare(args)
    except BaseException:
        _remove(created)
        raise
    if args.json:
        print(json.dumps(stats, indent=2))
    else:
        print(f"wrote {stats['prefix']}.bin/.idx: {stats['documents']} documents, {stats['tokens']} tokens "
              f"({stats['dtype']}, tokenizer {stats['tokenizer']}, vocab {stats['vocab_size']})")
    return 0


def _prepare(args: argparse.Namespace) -> dict:
    with warnings.catch_warnings():   # megatron-core's "Transformer Engine and Apex are not installed" notices
        warnings.simplefilter("ignore", UserWarning)
        import megatron.core.datasets.indexed_dataset  # noqa: F401

        from ..training.data import prepare  # torch and megatron-core only when the command runs

    return prepare(args.input, args.tokenizer, args.output_prefix, json_key=args.json_key,
                   split_sentences=args.split_sentences)


def _remove(folders: list[str]) -> None:
    """Folders this run created, innermost first, if still empty."""
    for d in reversed(folders):
        try:
            os.rmdir(d)
        except OSError:
            pass
