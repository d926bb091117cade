"""Tokenizers for ``aceso data prepare`` and training: a file-free byte tokenizer and local Hugging Face ones.

``byte``: ids 0-255 are the UTF-8 bytes; special tokens follow (eod, pad, bos, eos, cls, sep, mask and
``NUM_SENTINELS`` T5 sentinels), so the vocabulary is 256 + 7 + 100 = 363 ids. It needs no files, which makes
it the tokenizer of tests and quick runs.

``hf:PATH``: a Hugging Face tokenizer saved in a local directory (``tokenizer.json`` or a full
``save_pretrained`` folder). ``transformers`` is used when installed, otherwise the ``tokenizers`` library reads
``PATH/tokenizer.json``. Nothing is downloaded: both are called with local files only.

Both expose what megatron-core's datasets read from a tokenizer (``vocab_size``, ``eod``, ``pad``, ``bos``,
``eos``, ``cls``, ``sep``, ``mask``, ``inv_vocab``, ``additional_special_tokens_ids``) plus ``tokenize`` /
``detokenize``.
"""

from __future__ import annotations

from pathlib import Path

from search.io.errors import AcesoError

NUM_SENTINELS = 100
_SPECIALS = ("eod", "pad", "bos", "eos", "cls", "sep", "mask")


class ByteTokenizer:
    """UTF-8 bytes as ids 0-255, then the special tokens."""

    name = "byte"

    def __init__(self) -> None:
        for i, s in enumerate(_SPECIALS):
            setattr(self, s, 256 + i)
        first = 256 + len(_SPECIALS)
        self.additional_special_tokens_ids = list(range(first, first + NUM_SENTINELS))
        self.vocab_size = first + NUM_SENTINELS
        self.unique_identifiers = {"class": "ByteTokenizer", "vocab_size": self.vocab_size}  # dataset cache key

    def tokenize(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def detokenize(self, ids) -> str:
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")

    @property
    def inv_vocab(self) -> dict[int, str]:
        inv = {i: bytes([i]).decode("latin-1") for i in range(256)}
        inv.update({getattr(self, s): f"<{s}>" for s in _SPECIALS})
        inv.update({t: f"<extra_id_{k}>" for k, t in enumerate(self.additional_special_tokens_ids)})
        return inv

    @property
    def special_tokens_dict(self) -> dict[str, int]:
        return {f"{s}_token": getattr(self, s) for s in _SPECIALS}


class HFTokenizer:
    """A local Hugging Face tokenizer; the end-of-document token is its EOS (or an added ``<|endoftext|>``)."""

    def __init__(self, path: str) -> None:
        self.name = f"hf:{path}"
        folder = Path(path)
        if not folder.exists():
            raise AcesoError(f"--tokenizer hf:{path}: no such directory; give a local tokenizer folder")
        self._tok, self._vocab = _load_hf(folder)
        v = self._vocab
        self.vocab_size = max(v.values()) + 1
        self.eod = _first(v, ["<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "[SEP]"])
        if self.eod is None:
            raise AcesoError(f"--tokenizer hf:{path}: no end-of-document token (</s>, <|endoftext|>) in its vocab")
        self.eos = self.eod
        self.bos = _first(v, ["<s>", "<bos>", "<|begin_of_text|>", "[CLS]"], default=self.eod)
        self.pad = _first(v, ["<pad>", "[PAD]"], default=-1)
        self.cls = _first(v, ["[CLS]", "<cls>"], default=self.bos)
        self.sep = _first(v, ["[SEP]", "<sep>"], default=self.eod)
        self.mask = _first(v, ["[MASK]", "<mask>"], default=self.eod)
        self.additional_special_tokens_ids = sorted(i for t, i in v.items() if t.startswith("<extra_id_"))
        self.unique_identifiers = {"class": "HFTokenizer", "path": str(folder.resolve()), "vocab_size": self.vocab_size}

    def tokenize(self, text: str) -> list[int]:
        enc = self._tok.encode(text, add_special_tokens=False)
        return list(enc.ids) if hasattr(enc, "ids") else list(enc)

    def detokenize(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids])

    @property
    def inv_vocab(self) -> dict[int, str]:
        return {i: t for t, i in self._vocab.items()}


def _first(vocab: dict[str, int], names: list[str], default: int | None = None) -> int | None:
    for n in names:
        if n in vocab:
            return vocab[n]
    return default


def _load_hf(folder: Path):
    """(tokenizer, vocab) from local files only: transformers if installed, else the tokenizers library."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        AutoTokenizer = None
    if AutoTokenizer is not None:
        try:
            tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        except (OSError, ValueError) as e:
            raise AcesoError(f"--tokenizer hf:{folder}: cannot load it locally ({str(e).splitlines()[0]})") from None
        return tok, dict(tok.get_vocab())
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise AcesoError(
            f"--tokenizer hf:{folder}: needs `transformers` or `tokenizers` (pip install tokenizers); "
            "or use --tokenizer byte"
        ) from None
    path = folder / "tokenizer.json" if folder.is_dir() else folder
    if not path.is_file():
        raise AcesoError(f"--tokenizer hf:{folder}: no tokenizer.json there (install transformers for other formats)")
    tok = Tokenizer.from_file(str(path))
    return tok, dict(tok.get_vocab(with_added_tokens=True))


def load_tokenizer(spec: str):
    """``byte`` or ``hf:PATH`` -> a tokenizer object."""
    if spec == "byte":
        return ByteTokenizer()
    if spec.startswith("hf:"):
        return HFTokenizer(spec[3:])
    raise AcesoError(f"--tokenizer {spec}: unknown tokenizer; use `byte` or `hf:PATH` (a local Hugging Face folder)")
