"""Prepare training data: tokenize a JSON-lines corpus into a megatron-core indexed dataset.

  aceso data prepare corpus.jsonl --tokenizer byte -o data/corpus
  aceso data prepare corpus.jsonl --tokenizer hf:/path/to/tokenizer -o data/corpus --json-key content

writes data/corpus.bin and data/corpus.idx (train with `aceso train PLAN --data-path data/corpus`).
Tokenizers: `byte` (UTF-8 bytes + special tokens, 363 ids, no files needed) or `hf:PATH`, a local Hugging Face
tokenizer folder (needs `transformers` or `tokenizers`; nothing is downloaded).
"""

from __future__ import annotations

import argparse
import json


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


def run(args: argparse.Namespace) -> int:
    from ..training.data import prepare  # torch and megatron-core only when the command runs

    stats = prepare(args.input, args.tokenizer, args.output_prefix, json_key=args.json_key,
                    split_sentences=args.split_sentences)
    if args.json:
        print(json.dumps(stats, indent=2))
    else:
        print(f"wrote {stats['prefix']}.bin/.idx: {stats['documents']} documents, {stats['tokens']} tokens "
              f"({stats['dtype']}, tokenizer {stats['tokenizer']}, vocab {stats['vocab_size']})")
    return 0
