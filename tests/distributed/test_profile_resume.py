"""A profiling run killed part-way (SIGKILL to its whole process group: launcher, torchrun, workers) resumes:
the rerun reports the finished measurements, skips them (their results in the database are exactly the ones
recorded before the kill, not new measurements) and measures only the rest."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TINY = {"name": "tiny-gpt", "family": "gpt", "num_layers": 2, "hidden_size": 32, "num_attention_heads": 4,
        "ffn_hidden_size": 64, "seq_length": 16, "vocab_size": 128, "params_dtype": "fp32"}


def test_kill_and_resume(tmp_path):
    spec = tmp_path / "tiny.json"
    spec.write_text(json.dumps(TINY))
    db = tmp_path / "db.json"
    part = tmp_path / "db.json.partial.jsonl"
    cmd = [sys.executable, "-m", "search", "profile", "--model", str(spec), "--tp", "1", "--micro-batch-sizes",
           "1", "2", "4", "-o", str(db), "--cpu", "--nproc", "1", "--no-comm", "--warmup", "1", "--repeats", "40",
           "--quiet"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.time() + 240
    try:
        while time.time() < deadline:
            if part.exists() and len(part.read_text().splitlines()) >= 3:   # header + 2 measurements
                break
            assert proc.poll() is None, "the profiler finished before it could be killed"
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    # the workers run in torchrun's own sessions: they die with it (PR_SET_PDEATHSIG) a moment later, and may
    # finish the line they were writing; wait until the file is still
    size, still_since = -1, time.time()
    while time.time() - still_since < 1.5:
        now = part.stat().st_size
        if now != size:
            size, still_since = now, time.time()
        time.sleep(0.1)
    assert not db.exists()
    before = {}
    for ln in part.read_text().splitlines()[1:]:
        try:
            rec = json.loads(ln)
            before[rec["key"]] = rec["result"]
        except json.JSONDecodeError:
            pass   # torn by the kill
    assert len(before) >= 2
    total = 3 * 4 + 1   # 3 batches x (attention, mlp, embedding, head) + optimizer
    assert len(before) < total

    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"resuming: {len(before)} of {total} measurements already done" in r.stderr, r.stderr[-2000:]
    d = json.loads(db.read_text())
    rows = {f"unit/decoder/{u['kind']}/tp{u['tp']}/b{u['batch']}": u for u in d["units"]}
    rows.update({f"{p}/tp{e['tp']}/b{e['batch']}": e for p in ("embedding", "head") for e in d[p]})
    assert len(rows) == total - 1 and "optimizer" in d
    for key, res in before.items():
        if key in rows:
            assert rows[key]["fwd_us"] == res["fwd_us"] and rows[key]["bwd_us"] == res["bwd_us"]
    assert not part.exists()
