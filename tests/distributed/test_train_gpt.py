"""End to end on CPU: `aceso data prepare` -> `aceso launch --cpu` of a 3-stage (TP 2/1/1) GPT plan on 4 gloo
processes -> the same losses as one process training the same model on the same data; checkpoint and resume.

The reference is a single-process run of the same model (a 1-GPU plan: no pipeline, no TP), fed the same
samples in the same micro-batches; the runtime's plan-independent initialisation gives both the same weights.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys

import pytest

from aceso_megatron.testing import run_fresh, spawn
from aceso_megatron.training.train import main as train_main
from search.cli import main
from search.spec.model import ModelSpec
from search.spec.plan import ParallelPlan, StageSpec
from tests.conftest import ROOT
from tests.distributed.test_build_steps import _train

ITERS = 30
TINY = ModelSpec(name="tiny-gpt", family="gpt", num_layers=2, hidden_size=64, num_attention_heads=4,
                 ffn_hidden_size=128, seq_length=32, vocab_size=363, params_dtype="fp32", add_bias_linear=False)
ONE = ParallelPlan(model=TINY, micro_batch_size=2, global_batch_size=8, stages=[
    StageSpec(num_gpus=1, tp=1, dp=1, start_unit=0, end_unit=4, recompute=["none"] * 4)])
THREE = ParallelPlan(model=TINY, micro_batch_size=2, global_batch_size=8, stages=[
    StageSpec(num_gpus=2, tp=2, dp=1, start_unit=0, end_unit=1, recompute=["none"]),
    StageSpec(num_gpus=1, tp=1, dp=1, start_unit=1, end_unit=3, recompute=["selective", "full"]),
    StageSpec(num_gpus=1, tp=1, dp=1, start_unit=3, end_unit=4, recompute=["none"])])
TRAIN = ["--lr", "3e-3", "--min-lr", "3e-4", "--lr-warmup-iters", "3", "--lr-decay-style", "cosine",
         "--train-iters", str(ITERS), "--log-interval", "1", "--seed", "7", "--split", "90,10,0",
         "--eval-interval", "15", "--eval-iters", "1"]


def env() -> dict:
    e = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    e.setdefault("OMP_NUM_THREADS", "1")
    return e


def run(argv: list[str], timeout: int = 600) -> subprocess.CompletedProcess:
    r = subprocess.run(argv, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    return r


def records(path, kind="train") -> dict[int, dict]:
    rows = [json.loads(line) for line in open(path)]
    return {r["iteration"]: r for r in rows if r["kind"] == kind}


def make_corpus(path) -> list[str]:
    """Sentences from a tiny grammar: learnable structure, so the loss falls within a few dozen steps."""
    rng = random.Random(0)
    nouns, verbs = ["cat", "dog", "bird", "fish", "cow"], ["sees", "likes", "chases", "finds"]
    docs = [" ".join(f"the {rng.choice(nouns)} {rng.choice(verbs)} the {rng.choice(nouns)}."
                     for _ in range(rng.randint(3, 8))) for _ in range(120)]
    with open(path, "w") as f:
        for d in docs:
            f.write(json.dumps({"body": d}) + "\n")
    return docs


def prepare_and_train(d, one: ParallelPlan, three: ParallelPlan, prepare_args: list[str],
                      train_args: list[str], launch: bool = True) -> dict:
    """`aceso data prepare`, then a single-process run of ``one``, a 4-process `aceso launch --cpu` of ``three``
    saving at step 15, and a 4-process run resumed from a copy of the step-15 checkpoint. ``launch=False``: the
    4-process runs are `aceso train`'s ranks forked from the preloaded server (``testing.spawn``, as
    test_build_steps.py runs them) instead of `aceso launch` -> torchrun, which this file's GPT runs check."""
    docs = make_corpus(d / "corpus.jsonl")
    # `aceso data prepare`'s main in a fresh process from the preloaded server (its megatron-core import paid once;
    # the `python -m search` entry of the command runs as written in tests/distributed/test_readme.py)
    run_fresh(main, ["data", "prepare", str(d / "corpus.jsonl"), "--tokenizer", "byte", "-o", str(d / "corpus"),
                     "--json-key", "body", *prepare_args], cwd=ROOT)
    (d / "one.json").write_text(one.to_json())
    (d / "three.json").write_text(three.to_json())
    args = ["--data-path", str(d / "corpus"), "--data-cache-path", str(d / "cache"), *train_args]
    # the one-process runs: `python -m aceso_megatron.training.train`'s main in a fresh process that skips the
    # torch import (with ``launch`` the 4-process runs below go through the real `aceso launch` -> torchrun path)
    run_fresh(train_main, [str(d / "one.json"), "--cpu", *args, "--log-file", str(d / "single.jsonl")], cwd=ROOT)

    def four(*extra: str):
        if launch:
            return run([sys.executable, "-m", "search", "launch", str(d / "three.json"), "--cpu", "--", *args, *extra])
        spawn(4, _train, [str(d / "three.json"), "--cpu", *args, *extra])

    launched = four("--save", str(d / "ckpt"), "--save-interval", "15", "--log-file", str(d / "multi.jsonl"))
    # a run that died after step 15: its folder holds iteration 15 only
    (d / "crashed").mkdir()
    shutil.copytree(d / "ckpt" / "iter_0000015", d / "crashed" / "iter_0000015")
    (d / "crashed" / "latest_checkpointed_iteration.txt").write_text("15\n")
    four("--load", str(d / "crashed"), "--log-file", str(d / "resumed.jsonl"))
    # the same checkpoint resumed by one process: dist_checkpointing re-shards it for the other plan
    run_fresh(train_main, [str(d / "one.json"), "--cpu", *args, "--load", str(d / "crashed"), "--log-file",
                           str(d / "resharded.jsonl")], cwd=ROOT)
    return {"dir": d, "docs": docs, "launch_stdout": launched.stdout if launch else None}


def assert_matches_single_process(d, tol: float = 1e-4) -> None:
    single, multi = records(d / "single.jsonl"), records(d / "multi.jsonl")
    assert sorted(single) == sorted(multi) == list(range(1, ITERS + 1))
    for it in range(1, ITERS + 1):
        assert abs(single[it]["loss"] - multi[it]["loss"]) <= tol, (it, single[it]["loss"], multi[it]["loss"])
        assert multi[it]["grad_norm"] == pytest.approx(single[it]["grad_norm"], rel=1e-3)
        assert multi[it]["lr"] == pytest.approx(single[it]["lr"], rel=1e-12)
    ev_s, ev_m = records(d / "single.jsonl", "eval"), records(d / "multi.jsonl", "eval")
    assert sorted(ev_m) == [15, 30]
    for it in ev_m:
        assert abs(ev_s[it]["loss"] - ev_m[it]["loss"]) <= tol


def assert_resume_repeats_steps(d) -> None:
    multi, resumed = records(d / "multi.jsonl"), records(d / "resumed.jsonl")
    assert sorted(resumed) == list(range(16, ITERS + 1))
    for it in resumed:
        assert resumed[it]["loss"] == pytest.approx(multi[it]["loss"], abs=1e-6), it
        assert resumed[it]["grad_norm"] == pytest.approx(multi[it]["grad_norm"], rel=1e-6), it
    # another plan (one process) resuming the 3-stage checkpoint: the single-process run's steps 16-30
    single, resharded = records(d / "single.jsonl"), records(d / "resharded.jsonl")
    assert sorted(resharded) == list(range(16, ITERS + 1))
    for it in resharded:
        assert abs(resharded[it]["loss"] - single[it]["loss"]) <= 1e-4, it


def loss_drop(d) -> tuple[float, float]:
    """Mean loss of the first three and of the last three steps of the 4-process run."""
    multi = records(d / "multi.jsonl")
    first = sum(multi[i]["loss"] for i in range(1, 4)) / 3
    return first, sum(multi[i]["loss"] for i in range(ITERS - 2, ITERS + 1)) / 3


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return prepare_and_train(tmp_path_factory.mktemp("train_gpt"), ONE, THREE, [], TRAIN)


def test_prepare_writes_utf8_bytes_plus_end_of_document(work):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from aceso_megatron.training.tokenizer import ByteTokenizer

    ds = IndexedDataset(str(work["dir"] / "corpus"))
    eod = ByteTokenizer().eod
    assert len(ds) == len(work["docs"])
    for i in (0, 1, len(ds) - 1):
        assert ds[i].tolist() == list(work["docs"][i].encode("utf-8")) + [eod]


def test_four_process_plan_matches_single_process_at_every_step(work):
    assert_matches_single_process(work["dir"])


def test_loss_falls_clearly(work):
    first, last = loss_drop(work["dir"])
    assert last < first - 2.5, (first, last)  # from ~ln(384) = 5.95 (uniform over the padded vocab) to ~2.3


def test_schedule_is_megatron_warmup_then_cosine(work):
    lr = {it: r["lr"] for it, r in records(work["dir"] / "multi.jsonl").items()}
    import math

    for it in range(1, ITERS + 1):  # step `it` runs with the scheduler at it - 1 steps, as in Megatron-LM
        n = it - 1
        want = 3e-3 * n / 3 if n <= 3 else 3e-4 + 0.5 * (1 + math.cos(math.pi * (n - 3) / (ITERS - 3))) * 2.7e-3
        assert lr[it] == pytest.approx(want, rel=1e-9, abs=1e-15)


def test_resume_from_step_15_repeats_steps_16_to_30(work):
    assert_resume_repeats_steps(work["dir"])


def test_checkpoints_are_complete_and_marked(work):
    from patches.compat import at_least

    ckpt = work["dir"] / "ckpt"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == str(ITERS)
    for it in (15, ITERS):
        files = {p.name for p in (ckpt / f"iter_{it:07d}").iterdir()}
        assert "metadata.json" in files   # a megatron-core dist_checkpointing folder; its non-tensor state in
        # common.pt (0.16.1) or, from 0.19 on, in the torch_dist files themselves
        assert ("common.pt" in files) == (not at_least("0.19")), files
        assert {f"extra_rank_{r:05d}.pt" for r in range(4)} <= files
        assert any(f.endswith(".distcp") for f in files)
    assert not [p for p in ckpt.iterdir() if p.name.startswith(".")]


def test_launch_printed_command_and_summary(work):
    out = work["launch_stdout"]
    assert "-m torch.distributed.run --nproc-per-node 4 --standalone -m aceso_megatron.training.train" in out
    assert "predicted" in out and "measured" in out and "stage 2 max memory" in out
    summary = [json.loads(x) for x in open(work["dir"] / "multi.jsonl") if '"summary"' in x][0]
    assert len(summary["measured_stage_memory_mib"]) == 3 and summary["measured_iteration_time_ms"] > 0


def test_world_size_mismatch_is_one_line_before_any_process_group(tmp_path):
    (tmp_path / "three.json").write_text(THREE.to_json())
    r = subprocess.run([sys.executable, "-m", "search", "train", str(tmp_path / "three.json"), "--cpu",
                        "--mock-data", "--train-iters", "1"], cwd=ROOT, env=env(), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 2
    err = [ln for ln in r.stderr.splitlines() if "Warning" not in ln and "warnings.warn" not in ln]
    assert len(err) == 1 and "needs 4 processes" in err[0] and "has 1" in err[0], r.stderr


def test_data_prepare_names_the_line_without_the_key(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"content": "no text key"}\n')
    assert main(["data", "prepare", str(bad), "-o", str(tmp_path / "x")]) == 2
    assert f"{bad}:2: no 'text' field" in capsys.readouterr().err
    assert not list(tmp_path.glob("x*")) and not list(tmp_path.glob(".x*"))  # nothing half-written


def test_resume_with_another_global_batch_is_refused(work):
    """The data position is iteration x global batch: a plan with another global batch cannot continue it."""
    from types import SimpleNamespace

    from aceso_megatron.training import checkpoint
    from search.io.errors import AcesoError

    other = ONE.model_copy(update={"global_batch_size": 16})
    with pytest.raises(AcesoError, match="global_batch_size 8"):
        checkpoint.load(str(work["dir"] / "crashed"), SimpleNamespace(plan=other), None)
