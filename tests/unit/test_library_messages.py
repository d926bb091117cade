"""No library message ever reaches the user (issue 32): a pydantic ``ValidationError`` that gets to a CLI entry point
is one line naming the field, exit 2 (``search.cli.main``); and a published Megatron FSDP command line
(``--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params --fp8-param-gather``) is priced, where
explain stopped with pydantic's text ("For further information visit https://errors.pydantic.dev/...")."""

from __future__ import annotations

import json
from pathlib import Path

import pydantic
import pytest

from search.cli import PLANNER_SUBCOMMANDS, RUNTIME_SUBCOMMANDS, _entry_points, _load, main

LIBRARY_TEXT = ("pydantic", "validation error for", "input_value=", "[type=", "Traceback", "internal error")
FSDP_FP8 = ("--num-layers 4 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024 --max-position-embeddings "
            "1024 --micro-batch-size 1 --global-batch-size 64 --tokenizer-type NullTokenizer --vocab-size 32000 "
            "--bf16 --use-megatron-fsdp --ckpt-format fsdp_dtensor --data-parallel-sharding-strategy optim_grads_params "
            "--overlap-grad-reduce --overlap-param-gather --fp8-format e4m3 --fp8-recipe blockwise --fp8-param-gather")
PUBLISHED = Path(__file__).resolve().parents[3] / "shared" / "published" / "megatron-bridge-25.09-25.11.json"
# the least each subcommand parses (its run replaced below): the walk covers every entry point
MINIMAL = {"models": [], "clusters": [], "validate": ["p.json"], "import-hf": ["h.json"], "explain": ["p.json"],
           "search": ["--model", "m", "--cluster", "c", "--global-batch-size", "8"],
           "baseline": ["--model", "m", "--cluster", "c", "--global-batch-size", "8"], "export": ["p.json"],
           "import": ["f"], "plot": ["log"], "calibrate": ["--run", "s.sh", "l.log"],
           "profile": ["--model", "m", "-o", "db.json"], "train": ["p.json"], "launch": ["p.json", "--"],
           "data": ["prepare", "c.jsonl", "-o", "out"]}


def _clean(err: str) -> bool:
    return not any(t in err for t in LIBRARY_TEXT) and err.count("\n") == 1


@pytest.mark.parametrize("name", [*PLANNER_SUBCOMMANDS, *RUNTIME_SUBCOMMANDS])
def test_a_schema_refusal_reaching_any_entry_point_is_one_line(name, monkeypatch, capsys):
    """Every subcommand's ``run`` replaced by one a schema refuses a value in (a TrainingSpec with global batch 0,
    as an internal construction with a value the user gave would): one line naming the field, exit 2."""
    mod = _load(name, _entry_points())
    if mod is None:
        pytest.skip(f"{name}: the runtime is not installed here")

    def refuse(args):
        from search.spec.training import TrainingSpec
        TrainingSpec(global_batch_size=0)
    monkeypatch.setattr(mod, "run", refuse)
    assert main([name, *MINIMAL[name]]) == 2
    err = capsys.readouterr().err
    assert _clean(err) and err.startswith(f"aceso {name}: error: global_batch_size: "), err


def test_the_walk_covers_every_subcommand():
    assert set(MINIMAL) == set(PLANNER_SUBCOMMANDS) | set(RUNTIME_SUBCOMMANDS)
    with pytest.raises(pydantic.ValidationError):
        from search.spec.training import TrainingSpec
        TrainingSpec(global_batch_size=0)


def test_a_megatron_fsdp_fp8_param_gather_command_line_is_priced(capsys):
    """Megatron FSDP shards on its own: with --fp8-param-gather the plan has no distributed optimizer and needs none
    (explain built a TrainingSpec that refused that pair)."""
    assert main(["explain", "--megatron-args", FSDP_FP8, "--cluster", "1x8-h100", "--search-budget-evals", "0",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["iteration_time_ms"] > 0 and "megatron-fsdp optim_grads_params" in out["features"]["fsdp_offload"]
    assert out["settings"]["low_precision"]["param_gather"] is True


def test_explain_and_validate_of_an_fsdp_fp8_param_gather_plan(tmp_path, capsys):
    """The plan a --target megatron-lm search writes under --megatron-fsdp on --precision fp8-blockwise
    --fp8-param-gather: explain and validate price it (explain failed: 'fp8_param_gather needs the distributed
    optimizer or Megatron FSDP')."""
    p = tmp_path / "p.json"
    assert main(["search", "--model", "llama3-8b", "--num-layers", "4", "--cluster", "1x8-h100", "--global-batch-size",
                 "64", "--precision", "fp8-blockwise", "--fp8-param-gather", "--target", "megatron-lm",
                 "--megatron-fsdp", "on", "--budget-evals", "60", "--workers", "1", "-o", str(p)]) == 0
    capsys.readouterr()
    plan = json.loads(p.read_text())
    assert plan["settings"]["megatron_fsdp"] and not plan["settings"]["distributed_optimizer"]
    assert plan["settings"]["low_precision"]["param_gather"] is True
    assert main(["explain", str(p), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)["iteration_time_ms"]
    assert got == pytest.approx(plan["predicted"]["iteration_time_ms"], abs=1e-5)
    assert main(["validate", str(p)]) == 0, capsys.readouterr().err


@pytest.mark.skipif(not PUBLISHED.exists(), reason="needs ../shared/published (Megatron-Bridge's published runs)")
def test_the_published_llama3_70b_fsdp_row_is_priced(capsys):
    rows = json.loads(PUBLISHED.read_text())["rows"]
    row = next(r for r in rows if r["model"] == "llama3-70b" and r.get("fsdp") and r["cluster"] == "1x64-gb300"
               and r.get("args"))
    assert "--use-megatron-fsdp" in row["args"] and "optim_grads_params" in row["args"]
    assert main(["explain", "--megatron-args", row["args"], "--cluster", row["cluster"], "--search-budget-evals", "0",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["fits"] and out["iteration_time_ms"] > 0 and len(out["stages"]) == 1
