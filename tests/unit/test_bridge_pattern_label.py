"""``aceso search --target megatron-bridge`` of a hybrid model: the ``|``-pattern line is priced as Megatron-LM runs
it (``api._pattern_line``: a ``megatron-lm`` Evaluator at the Megatron-LM release), so the report says so, as a
Megatron-LM alternative to the Bridge lines (before, it stood among the Bridge lines as "Megatron-LM |-pattern"
with no word that it is not a Bridge plan, and its JSON line named no framework)."""

from __future__ import annotations

import json

import pytest

from search.cli import main

SPEC = {"name": "tiny-hyb", "family": "gpt", "num_layers": 8, "hidden_size": 64, "num_attention_heads": 4,
        "num_query_groups": 2, "ffn_hidden_size": 128, "seq_length": 256, "vocab_size": 512,
        "activation": "squared_relu", "normalization": "rmsnorm", "position_embedding": "none",
        "tied_embeddings": False, "add_bias_linear": False, "params_dtype": "bf16",
        "hybrid_layer_pattern": "M*-MM-M-",
        "mamba": {"mamba_state_dim": 16, "mamba_head_dim": 16, "mamba_num_groups": 2, "mamba_num_heads": 8,
                  "expand": 2, "d_conv": 4, "chunk_size": 128}}
PROBLEM = ["--cluster", "1x4-h100", "--global-batch-size", "64", "--budget-evals", "100"]


@pytest.fixture
def spec(tmp_path):
    path = tmp_path / "tiny-hyb.json"
    path.write_text(json.dumps(SPEC))
    return str(path)


def test_a_bridge_search_labels_the_pattern_line_megatron_lm(spec, capsys):
    assert main(["search", "--model", spec, *PROBLEM, "--target", "megatron-bridge"]) == 0
    out = capsys.readouterr().out
    assert "Megatron-Bridge plan" in out
    assert any(line.startswith("Megatron-LM alternative |-pattern ") for line in out.splitlines()), out
    assert main(["search", "--model", spec, *PROBLEM, "--target", "megatron-bridge", "--json"]) == 0
    lines = json.loads(capsys.readouterr().out)["lines"]
    assert lines["megatron_lm_pattern"]["framework"] == "megatron-lm"


def test_a_megatron_lm_search_keeps_its_label(spec, capsys):
    assert main(["search", "--model", spec, *PROBLEM, "--target", "megatron-lm"]) == 0
    assert any(line.startswith("Megatron-LM |-pattern ") for line in capsys.readouterr().out.splitlines())
