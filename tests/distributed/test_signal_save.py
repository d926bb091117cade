"""SIGTERM mid-run through `aceso launch --cpu` (2 gloo processes, a 2-stage pipeline of a tiny GPT): the workers
finish the step, save a complete checkpoint, say how to resume and the launch exits 143; resuming from it repeats
the uninterrupted run's later steps bit for bit. The same runs check ``--keep-last`` rotation in a real job: only
the newest N checkpoints stay, and never the one a run resumed from.

SIGTERM *during* a save (``ACESO_TEST_SIGNAL_IN_SAVE``: the ranks wait inside the save, after writing and before
the rename, until the signal has reached them): the save completes, the marker names a complete checkpoint, no
``.tmp_iter_*`` folder stays (nor one a killed save left before) and the run exits 143 -- through `aceso launch`
at an interval save, and through `aceso train` at the final save (it exited 0) and without the signal handler
(the default action after the save)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from aceso_megatron.training.checkpoint_files import damaged_file, damaged_index
from search.spec.model import ModelSpec
from search.spec.plan import ParallelPlan, StageSpec
from tests.conftest import ROOT

ITERS = 8
TINY = ModelSpec(name="tiny-gpt", family="gpt", num_layers=2, hidden_size=32, num_attention_heads=4,
                 ffn_hidden_size=64, seq_length=32, vocab_size=363, params_dtype="fp32")
TWO = ParallelPlan(model=TINY, micro_batch_size=2, global_batch_size=4, stages=[
    StageSpec(num_gpus=1, tp=1, dp=1, start_unit=0, end_unit=2, recompute=["none"] * 2),
    StageSpec(num_gpus=1, tp=1, dp=1, start_unit=2, end_unit=4, recompute=["none"] * 2)])
ONE = ParallelPlan(model=TINY, micro_batch_size=2, global_batch_size=4, stages=[
    StageSpec(num_gpus=1, tp=1, dp=1, start_unit=0, end_unit=4, recompute=["none"] * 4)])
TRAIN = ["--mock-data", "--train-iters", str(ITERS), "--log-interval", "1", "--lr", "3e-3", "--lr-warmup-iters", "2",
         "--seed", "3"]


def _env() -> dict:
    e = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    e.setdefault("OMP_NUM_THREADS", "1")
    return e


def _launch(d, *extra: str) -> list[str]:
    return [sys.executable, "-m", "search", "launch", str(d / "two.json"), "--cpu", "--", *TRAIN, *extra]


def _losses(path) -> dict[int, tuple[float, float]]:
    rows = [json.loads(line) for line in open(path)]
    return {r["iteration"]: (r["loss"], r["grad_norm"]) for r in rows if r["kind"] == "train"}


def _run(argv) -> subprocess.CompletedProcess:
    r = subprocess.run(argv, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


def _interrupted(d, at: int) -> tuple[int, str]:
    """Run until the log shows iteration ``at``, then SIGTERM the launch; its exit status and stdout."""
    p = subprocess.Popen(_launch(d, "--save", str(d / "ckpt"), "--log-file", str(d / "cut.jsonl")), cwd=ROOT,
                         env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out = []
    for line in p.stdout:
        out.append(line)
        if f"iteration {at:>6}/" in line:
            p.send_signal(signal.SIGTERM)
    p.wait(timeout=300)
    return p.returncode, "".join(out) + p.stderr.read()


def test_sigterm_saves_and_resumes_bit_exact_and_keep_last_rotates(tmp_path):
    d = tmp_path
    (d / "two.json").write_text(TWO.to_json())
    _run(_launch(d, "--save", str(d / "ref"), "--save-interval", "2", "--keep-last", "2", "--log-file",
                 str(d / "ref.jsonl")))
    assert sorted(p.name for p in (d / "ref").iterdir()) == ["iter_0000006", "iter_0000008",
                                                             "latest_checkpointed_iteration.txt"]
    rc, out = _interrupted(d, 2)
    assert rc == 143, out[-3000:]
    stop = int((d / "ckpt" / "latest_checkpointed_iteration.txt").read_text())
    assert 2 <= stop < ITERS   # the step under way when the signal came is finished first
    assert sorted(p.name for p in (d / "ckpt").iterdir()) == [f"iter_{stop:07d}", "latest_checkpointed_iteration.txt"]
    assert (f"stopped by SIGTERM after iteration {stop}/{ITERS}; saved {d / 'ckpt'}; resume with the same command "
            f"with --load {d / 'ckpt'} added") in out
    assert "Traceback" not in out
    ref, cut = _losses(d / "ref.jsonl"), _losses(d / "cut.jsonl")
    assert sorted(cut) == list(range(1, stop + 1))
    _run(_launch(d, "--save", str(d / "ckpt"), "--load", str(d / "ckpt"), "--keep-last", "1", "--log-file",
                 str(d / "resumed.jsonl")))
    resumed = _losses(d / "resumed.jsonl")
    assert sorted(resumed) == list(range(stop + 1, ITERS + 1))
    for it in range(1, ITERS + 1):   # bit for bit: the same plan resumes model, optimizer, scheduler, RNG, data
        assert (cut if it <= stop else resumed)[it] == ref[it], it
    # --keep-last 1 kept the newest and the one this run resumed from
    assert sorted(p.name for p in (d / "ckpt").glob("iter_*")) == [f"iter_{stop:07d}", f"iter_{ITERS:07d}"]


def _signal_in_save(argv, d) -> tuple[int, str]:
    """Run ``argv`` with the save pause on; SIGTERM it once a rank is inside the save; its status and output."""
    flag = d / "in-save"
    p = subprocess.Popen(argv, cwd=ROOT, env={**_env(), "ACESO_TEST_SIGNAL_IN_SAVE": str(flag)},
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    import threading

    out: list[str] = []
    reader = threading.Thread(target=lambda: out.extend(p.stdout), daemon=True)
    reader.start()
    deadline = time.monotonic() + 300
    while not flag.exists() and p.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert flag.exists(), "".join(out)[-3000:]
    p.send_signal(signal.SIGTERM)
    p.wait(timeout=300)
    reader.join(timeout=30)
    return p.returncode, "".join(out)


def _complete(ckpt, iteration: int) -> None:
    assert int((ckpt / "latest_checkpointed_iteration.txt").read_text()) == iteration
    assert sorted(p.name for p in ckpt.iterdir()) == [f"iter_{iteration:07d}", "latest_checkpointed_iteration.txt"]
    folder = ckpt / f"iter_{iteration:07d}"
    assert damaged_file(folder) is None and damaged_index(folder) is None


def test_sigterm_inside_an_interval_save_through_launch_completes_it_and_exits_143(tmp_path):
    d = tmp_path
    (d / "two.json").write_text(TWO.to_json())
    (d / "ckpt" / ".tmp_iter_0000099").mkdir(parents=True)    # what a save killed earlier left
    rc, out = _signal_in_save(_launch(d, "--save", str(d / "ckpt"), "--save-interval", "2"), d)
    assert rc == 143, out[-3000:]
    _complete(d / "ckpt", 2)
    assert f"stopped by SIGTERM after iteration 2/{ITERS}; saved {d / 'ckpt'}" in out and "Traceback" not in out


@pytest.mark.parametrize("handler", [True, False])
def test_sigterm_inside_the_final_save_of_aceso_train_completes_it_and_exits_143(tmp_path, handler):
    """One process, the save at the end of training: it exited 0 (the signal was recorded and never asked for);
    without the handler, the handler installed before (`aceso`'s: 143) acts once the save is complete."""
    d = tmp_path
    (d / "one.json").write_text(ONE.to_json())
    argv = [sys.executable, "-m", "search", "train", str(d / "one.json"), "--cpu", "--mock-data", "--train-iters",
            "2", "--save", str(d / "ckpt")] + ([] if handler else ["--no-exit-signal-handler"])
    rc, out = _signal_in_save(argv, d)
    assert rc == 143, out[-3000:]          # without the handler: the command's own SIGTERM exit, after the save
    _complete(d / "ckpt", 2)
    assert "Traceback" not in out
    if handler:
        assert f"stopped by SIGTERM after iteration 2/2 (the last); saved {d / 'ckpt'}" in out, out[-2000:]
