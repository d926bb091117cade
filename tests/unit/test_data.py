"""Tokenizers and `aceso data prepare` input checks (torch-free; the indexed-dataset output itself is checked
end to end in tests/distributed/test_train_gpt.py)."""

from __future__ import annotations

import json
import sys
import types

import pytest

from aceso_megatron.training.tokenizer import NUM_SENTINELS, ByteTokenizer, HFTokenizer, load_tokenizer
from search.io.errors import AcesoError
from tests.unit.test_torch_free import run_blocked


def test_byte_tokenizer_is_utf8_bytes_with_distinct_specials():
    tok = ByteTokenizer()
    text = "Grüße, 世界!"
    assert tok.tokenize(text) == list(text.encode("utf-8"))
    assert tok.detokenize(tok.tokenize(text) + [tok.eod]) == text
    specials = [tok.eod, tok.pad, tok.bos, tok.eos, tok.cls, tok.sep, tok.mask, *tok.additional_special_tokens_ids]
    assert len(set(specials)) == len(specials) == 7 + NUM_SENTINELS
    assert min(specials) == 256 and max(specials) == tok.vocab_size - 1 == 362
    assert len(tok.inv_vocab) == tok.vocab_size


def test_tokenizer_spec_errors_are_one_line():
    with pytest.raises(AcesoError, match="unknown tokenizer"):
        load_tokenizer("gpt2")
    with pytest.raises(AcesoError, match="no such directory"):
        load_tokenizer("hf:/no/such/folder")


def test_hf_without_libraries_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    with pytest.raises(AcesoError, match="pip install tokenizers"):
        load_tokenizer(f"hf:{tmp_path}")


class _FakeEncoding:
    def __init__(self, ids):
        self.ids = ids


class _FakeTokenizer:
    """Stands in for ``tokenizers.Tokenizer``: a word-level vocabulary read from tokenizer.json."""

    def __init__(self, vocab):
        self.vocab = vocab

    @classmethod
    def from_file(cls, path):
        return cls(json.load(open(path))["model"]["vocab"])

    def get_vocab(self, with_added_tokens=True):
        return dict(self.vocab)

    def encode(self, text, add_special_tokens=True):
        return _FakeEncoding([self.vocab[w] for w in text.split()])

    def decode(self, ids):
        inv = {i: w for w, i in self.vocab.items()}
        return " ".join(inv[i] for i in ids)


def test_hf_tokenizer_folder_through_the_tokenizers_library(tmp_path, monkeypatch):
    vocab = {"<pad>": 0, "</s>": 1, "<s>": 2, "hello": 3, "world": 4, "<extra_id_1>": 6, "<extra_id_0>": 5}
    (tmp_path / "tokenizer.json").write_text(json.dumps({"model": {"vocab": vocab}}))
    monkeypatch.setitem(sys.modules, "transformers", None)
    monkeypatch.setitem(sys.modules, "tokenizers", types.SimpleNamespace(Tokenizer=_FakeTokenizer))
    tok = load_tokenizer(f"hf:{tmp_path}")
    assert isinstance(tok, HFTokenizer)
    assert (tok.vocab_size, tok.eod, tok.bos, tok.pad) == (7, 1, 2, 0)
    assert tok.additional_special_tokens_ids == [5, 6]
    assert tok.tokenize("hello world hello") == [3, 4, 3]
    assert tok.detokenize([3, 4]) == "hello world"


def test_hf_tokenizer_real_library(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    t = tokenizers.Tokenizer(WordLevel({"<unk>": 0, "</s>": 1, "a": 2, "b": 3}, unk_token="<unk>"))
    t.pre_tokenizer = Whitespace()
    t.save(str(tmp_path / "tokenizer.json"))
    tok = HFTokenizer(str(tmp_path))
    assert tok.tokenize("a b a") == [2, 3, 2] and tok.eod == 1


def test_data_prepare_bad_input_exits_2_without_torch(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"content": "no text key"}\n')
    r = run_blocked(f"""
        from search.cli import main
        codes = [main(['data', 'prepare', {str(tmp_path / 'missing.jsonl')!r}, '-o', {str(tmp_path / 'x')!r}]),
                 main(['data', 'prepare', {str(bad)!r}, '-o', {str(tmp_path / 'x.bin')!r}]),
                 main(['data', 'prepare', {str(bad)!r}, '-o', {str(tmp_path / 'x')!r}, '--tokenizer', 'sp:x'])]
        print(codes)
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[2, 2, 2]"
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 3
    assert "no such input file" in lines[0] and "without .bin" in lines[1] and "unknown tokenizer" in lines[2]
