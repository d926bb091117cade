"""`aceso train` (one gloo process, a tiny GPT) with --tensorboard-dir and --wandb-project: the event files hold
Megatron-LM's scalar names with the values of the JSON log (read back with ``tensorboard.backend.event_processing``;
skipped without tensorboard), a fake ``wandb`` module on the path receives the same scalars, and every JSON record
carries its wall-clock time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import datetime, timezone

import pytest

from search.spec.model import ModelSpec
from search.spec.plan import ParallelPlan, StageSpec
from tests.conftest import ROOT

TINY = ModelSpec(name="tiny-gpt", family="gpt", num_layers=2, hidden_size=32, num_attention_heads=4,
                 ffn_hidden_size=64, seq_length=32, vocab_size=363, params_dtype="fp32")
ONE = ParallelPlan(model=TINY, micro_batch_size=2, global_batch_size=4, stages=[
    StageSpec(num_gpus=1, tp=1, dp=1, start_unit=0, end_unit=4, recompute=["none"] * 4)])
FAKE_WANDB = '''
import json, os
def _w(kind, **kw):
    with open(os.environ["FAKE_WANDB_LOG"], "a") as f:
        f.write(json.dumps({"call": kind, **kw}) + "\\n")
def init(**kw): _w("init", project=kw["project"], name=kw["name"], dir=kw["dir"], has_config="lr" in kw["config"])
def log(values, step=None): _w("log", values=values, step=step)
def finish(): _w("finish")
'''
NAMES = {"lm loss": "loss", "learning-rate": "lr", "grad-norm": "grad_norm"}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One ``aceso train`` run with --tensorboard-dir, --wandb-project and --log-file, read by both tests (one
    torch and megatron-core start instead of two): (its folder, the time it started, the finished process).
    Without tensorboard the run writes no event files (that test skips) and the log is still checked."""
    tmp_path = tmp_path_factory.mktemp("writers")
    try:
        import tensorboard
    except ImportError:
        tensorboard = None
    (tmp_path / "fake").mkdir()
    (tmp_path / "fake" / "wandb.py").write_text(FAKE_WANDB)
    (tmp_path / "one.json").write_text(ONE.to_json())
    path = [str(tmp_path / "fake"), str(ROOT), tensorboard and os.path.dirname(os.path.dirname(tensorboard.__file__)),
            os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in path if p), OMP_NUM_THREADS="1",
               FAKE_WANDB_LOG=str(tmp_path / "wandb.jsonl"))
    before = datetime.now(timezone.utc)
    r = subprocess.run([sys.executable, "-m", "aceso_megatron.training.train", str(tmp_path / "one.json"), "--cpu",
                        "--mock-data", "--train-iters", "4", "--log-interval", "2", "--eval-interval", "4",
                        "--eval-iters", "1", "--log-file", str(tmp_path / "log.jsonl"), "--wandb-project", "p",
                        "--wandb-exp-name", "run1", "--save", str(tmp_path / "ckpt")]
                       + (["--tensorboard-dir", str(tmp_path / "tb")] if tensorboard else []),
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    return tmp_path, before, r


def test_tensorboard_and_wandb_scalars_match_the_json_log(run):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tmp_path, before, r = run
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    rows = [json.loads(line) for line in open(tmp_path / "log.jsonl")]
    for row in rows:   # wall-clock time, UTC, within the run
        assert before <= datetime.fromisoformat(row["time"]) <= datetime.now(timezone.utc), row
    train = {row["iteration"]: row for row in rows if row["kind"] == "train"}
    valid = next(row for row in rows if row["kind"] == "eval")
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"lm loss", "learning-rate", "grad-norm", "iteration-time", "throughput", "batch-size",
            "mem-max-rss-bytes/stage-0", "lm loss validation", "lm loss validation ppl"} <= tags, tags
    for tag, key in NAMES.items():
        events = acc.Scalars(tag)
        assert [e.step for e in events] == [2, 4]
        for e in events:
            assert e.value == pytest.approx(train[e.step][key], rel=1e-6)
    it_time = acc.Scalars("iteration-time")[-1]
    assert it_time.value == pytest.approx(train[4]["iteration_time_ms"] / 1e3, rel=1e-6)
    assert acc.Scalars("lm loss validation")[0].value == pytest.approx(valid["loss"], rel=1e-6)
    calls = [json.loads(line) for line in open(tmp_path / "wandb.jsonl")]
    assert calls[0] == {"call": "init", "project": "p", "name": "run1", "dir": str(tmp_path / "ckpt" / "wandb"),
                        "has_config": True}
    logged = [c for c in calls if c["call"] == "log" and "lm loss" in c["values"]]
    assert [c["step"] for c in logged] == [2, 4]
    assert all(c["values"]["lm loss"] == train[c["step"]]["loss"] for c in logged)
    assert calls[-1] == {"call": "finish"}


def test_the_log_has_tokens_per_gpu_as_every_report_computes_it(run):
    """Issue 32: tokens/s per GPU (NVIDIA's tables) beside samples/s in the training log, from the same function as
    search / explain / baseline: global batch x sequence / iteration time / GPUs, checked by hand on each record
    (the writers' run: its two logged iterations; the writers only add outputs, the log's records are the same)."""
    tmp_path, _, r = run
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    train = [row for row in map(json.loads, open(tmp_path / "log.jsonl")) if row["kind"] == "train"]
    assert len(train) == 2
    for row in train:
        seconds = row["iteration_time_ms"] / 1e3
        assert row["samples_per_s"] == pytest.approx(4 / seconds)
        assert row["tokens_per_s_per_gpu"] == pytest.approx(4 * 32 / seconds / 1) == row["tokens_per_s"]
        assert "mfu" not in row                              # a CPU run: no GPU peak to compare with
    assert "samples/s |" in r.stdout and "tokens/s per process" in r.stdout
