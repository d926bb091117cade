"""A hybrid model Megatron-LM cannot build (a Mamba-2 ``chunk_size`` other than 128: core_v0.19's ``arguments.py``
has no flag for it and ``MambaMixer`` defaults to 128) gets no Megatron-LM line: before, ``aceso search`` printed
a "uniform Megatron-LM" and a "Megatron-LM plan" line (41.96 ms, pp 2, on 1x2-cpu) that ``--target megatron-lm`` itself then
refused ("the search found no plan Megatron-LM runs"), and measured the heterogeneous plan's speedup (1.768x)
against it; ``aceso baseline`` called that pp 2 configuration the best uniform one although pp 1 x dp 2 (23.74 ms)
is uniform too and faster. docs/search.md: a target that runs no plan of the model is refused before any search
and its report line says ``not offered``."""

import json

import pytest

from search.cli import main

SPEC = {"name": "tiny-hyb", "family": "gpt", "num_layers": 8, "hidden_size": 64, "num_attention_heads": 4,
        "num_query_groups": 2, "ffn_hidden_size": 128, "seq_length": 32, "vocab_size": 512,
        "activation": "squared_relu", "normalization": "rmsnorm", "position_embedding": "none",
        "tied_embeddings": False, "add_bias_linear": False, "params_dtype": "fp32",
        "hybrid_layer_pattern": "M*-MM-M-",
        "mamba": {"mamba_state_dim": 16, "mamba_head_dim": 16, "mamba_num_groups": 2, "mamba_num_heads": 8,
                  "expand": 2, "d_conv": 4, "chunk_size": 16}}
PROBLEM = ["--cluster", "1x2-h100", "--global-batch-size", "8", "--precision", "fp32"]


@pytest.fixture
def spec(tmp_path):
    path = tmp_path / "tiny-hyb.json"
    path.write_text(json.dumps(SPEC))
    return str(path)


def _json(argv, capsys) -> dict:
    assert main(argv + ["--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_no_megatron_lm_line_for_a_model_megatron_lm_cannot_build(spec, capsys):
    out = _json(["search", "--model", spec, *PROBLEM, "--budget-evals", "200"], capsys)
    for key in ("uniform", "megatron_lm", "megatron_lm_pattern"):
        assert out["lines"][key] is None and "model.mamba.chunk_size 16" in out["not_offered"][key], key
    assert "baseline" not in out and "speedup" not in out
    assert out["lines"]["aceso"]["iteration_ms"] == out["iteration_ms"]


@pytest.mark.parametrize("target", ["megatron-lm", "megatron-bridge"])
def test_a_megatron_target_is_refused_before_searching(spec, tmp_path, capsys, target):
    out = tmp_path / "plan.json"
    assert main(["search", "--model", spec, *PROBLEM, "--target", target, "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--target {target}: model.mamba.chunk_size 16" in err, err
    assert "--target megatron-lm (" not in err        # no advice to search for a target that refuses it too
    assert not out.exists()


def test_baseline_is_the_best_uniform_configuration(spec, capsys):
    """The aceso runtime's uniform baseline is the fastest of the grid: the best of each pipeline depth's own."""
    best = _json(["baseline", "--model", spec, *PROBLEM], capsys)["iteration_ms"]
    per_pp = [_json(["baseline", "--model", spec, *PROBLEM, "--pp", pp], capsys)["iteration_ms"] for pp in "12"]
    assert best == min(per_pp)
