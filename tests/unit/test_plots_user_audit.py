"""`aceso search --plot` as a user meets it (issue "Right answers", user audit 2): a search with no accepted move
(one GPU: nothing to move; the profile cost model on the README's tiny CPU model did the same) still draws its
picture, which then says so (docs/pictures.md); it stopped with "internal error: ValueError: slice step cannot be
zero" and exit 1, after the plan was written."""

import json

import pytest

from search.cli import main

pytest.importorskip("matplotlib")

TINY = {"name": "tiny-gpt", "family": "gpt", "num_layers": 4, "hidden_size": 64, "num_attention_heads": 4,
        "ffn_hidden_size": 256, "seq_length": 64, "vocab_size": 512, "params_dtype": "fp32"}


def test_search_picture_without_accepted_moves(tmp_path, capsys):
    spec = tmp_path / "tiny.json"
    spec.write_text(json.dumps(TINY))
    plan, png = tmp_path / "plan.json", tmp_path / "search.png"
    rc = main(["search", "--model", str(spec), "--cluster", "1x1-cpu", "--global-batch-size", "8",
               "--precision", "fp32", "--budget-s", "2", "-o", str(plan), "--plot", str(png)])
    assert rc == 0, capsys.readouterr().err
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads(plan.read_text())["stages"]
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]   # no temporary file left
