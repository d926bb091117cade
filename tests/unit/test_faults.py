"""Faults around outputs and signals (issue 15), all in temporary folders; the real /dev is never touched.

- what is not a regular file is written in place, never replaced: a FIFO, a symbolic link to a FIFO, a
  ``/proc/self/fd/N`` link (``/dev/stdout``-style); a link to a regular file stays a link;
- a write that fails half-way (file-size limit, the same path as a full disk) leaves nothing, names the path
  given, and a failing ``--trace`` leaves no plan either; a folder nobody may write in is refused before the work;
- SIGTERM stops a search like Ctrl-C (best plan so far written, exit 143) and its workers with it; SIGKILL of the
  main process alone leaves no worker behind.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from search.cli import main
from tests.conftest import ROOT

GPT2 = {"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 4, "n_positions": 64, "vocab_size": 512}
SEARCH = ["search", "--model", "gpt-1.3b", "--cluster", "1x8-h100", "--global-batch-size", "512", "--precision", "bf16"]
LONG_SEARCH = ["search", "--model", "gpt-13b", "--cluster", "4x8-h100", "--global-batch-size", "1024",
               "--budget-evals", "2000000", "--workers", "2"]


@pytest.fixture
def hf(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "hf.json").write_text(json.dumps(GPT2))
    return tmp_path / "hf.json"


def _read_fifo_into(path: Path, out: list) -> threading.Thread:
    t = threading.Thread(target=lambda: out.append(path.read_text()), daemon=True)
    t.start()
    return t


def test_fifo_is_written_in_place_not_replaced(hf, tmp_path, capsys):
    fifo = tmp_path / "out.fifo"
    os.mkfifo(fifo)
    got: list[str] = []
    reader = _read_fifo_into(fifo, got)
    assert main(["import-hf", str(hf), "-o", str(fifo)]) == 0
    reader.join(10)
    assert json.loads(got[0])["hidden_size"] == 64
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)                     # still the FIFO
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf.json", "out.fifo"]   # no temp file left


def test_link_to_fifo_stays_a_link_to_the_fifo(hf, tmp_path):
    fifo, link = tmp_path / "real.fifo", tmp_path / "link.json"
    os.mkfifo(fifo)
    link.symlink_to(fifo)
    got: list[str] = []
    reader = _read_fifo_into(fifo, got)
    assert main(["import-hf", str(hf), "-o", str(link)]) == 0
    reader.join(10)
    assert json.loads(got[0])["num_layers"] == 2
    assert link.is_symlink() and stat.S_ISFIFO(os.stat(link).st_mode)


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc/self/fd (Linux)")
def test_descriptor_link_like_dev_stdout_is_written_in_place(hf, tmp_path):
    r, w = os.pipe()
    try:
        link = tmp_path / "stdout-like"
        link.symlink_to(f"/proc/self/fd/{w}")          # what /dev/stdout is: a link to a descriptor
        assert main(["import-hf", str(hf), "-o", str(link)]) == 0
        os.close(w)
        w = -1
        with os.fdopen(r) as f:
            r = -1
            assert json.loads(f.read())["family"] == "gpt"
        assert link.is_symlink()
    finally:
        for fd in (r, w):
            if fd >= 0:
                os.close(fd)


def test_link_to_regular_file_stays_a_link(hf, tmp_path):
    target, link = tmp_path / "spec.json", tmp_path / "link.json"
    target.write_text("old")
    target.chmod(0o640)
    link.symlink_to(target.name)
    assert main(["import-hf", str(hf), "-o", str(link)]) == 0
    assert link.is_symlink() and json.loads(target.read_text())["vocab_size"] == 512
    assert stat.S_IMODE(target.stat().st_mode) == 0o640                 # the replaced file keeps its mode


def _limited(argv: list[str], cwd: Path, max_bytes: int) -> subprocess.CompletedProcess:
    """``aceso ARGV`` with files limited to ``max_bytes`` (writes beyond fail with EFBIG, like a full disk)."""
    code = ("import resource, signal, sys\n"
            "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
            f"resource.setrlimit(resource.RLIMIT_FSIZE, ({max_bytes}, {max_bytes}))\n"
            "from search.cli import main\n"
            f"sys.exit(main({argv!r}))\n")
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_write_failing_half_way_leaves_nothing_and_names_the_path(tmp_path):
    r = _limited([*SEARCH, "--workers", "1", "--budget-evals", "300", "-o", "plan.json"], tmp_path, 1000)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip() == ("aceso search: error: -o plan.json: cannot write it (File too large); "
                                "nothing was written")
    assert list(tmp_path.iterdir()) == []                               # no plan, no temporary file


def test_failing_trace_leaves_no_plan(tmp_path):
    argv = [*SEARCH, "--workers", "1", "--budget-evals", "300", "-o", "plan.json", "--trace", "trace.json"]
    free = tmp_path / "free"
    free.mkdir()
    assert subprocess.run([sys.executable, "-m", "search", *argv, "--json"], cwd=free, capture_output=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300).returncode == 0
    plan, trace = (free / "plan.json").stat().st_size, (free / "trace.json").stat().st_size
    assert trace > plan, "the trace must be the larger file for this test"
    limited = tmp_path / "limited"
    limited.mkdir()
    r = _limited(argv, limited, (plan + trace) // 2)                   # the plan fits, the trace does not
    assert r.returncode == 2 and "--trace trace.json: cannot write it" in r.stderr, r.stderr
    assert list(limited.iterdir()) == []


def test_unwritable_folder_is_refused_before_the_work(hf, tmp_path, monkeypatch, capsys):
    """A read-only filesystem (simulated: every file creation there fails with EROFS) is one line before any
    work; a real read-only folder is checked too when we are not root (root ignores permission bits)."""
    import tempfile

    ro = tmp_path / "ro"
    ro.mkdir()
    real = tempfile.mkstemp

    def mkstemp(*a, dir=None, **kw):
        if dir is not None and Path(dir).resolve() == ro.resolve():
            raise OSError(errno.EROFS, os.strerror(errno.EROFS))
        return real(*a, dir=dir, **kw)

    monkeypatch.setattr(tempfile, "mkstemp", mkstemp)
    rc = main([*SEARCH, "-o", str(ro / "plan.json")])
    err = capsys.readouterr().err
    assert rc == 2 and err.strip().endswith(f"-o {ro / 'plan.json'}: cannot write in folder {ro} "
                                            "(Read-only file system); choose another path")
    assert list(ro.iterdir()) == []
    monkeypatch.setattr(tempfile, "mkstemp", real)
    if os.geteuid() != 0:
        ro.chmod(0o555)
        try:
            assert main(["import-hf", str(hf), "-o", str(ro / "spec.json")]) == 2
            assert "cannot write in folder" in capsys.readouterr().err
        finally:
            ro.chmod(0o755)


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(x) for x in path.read_text().split()] if path.exists() else []


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    st = Path(f"/proc/{pid}/stat")
    return not (st.exists() and st.read_text().split(") ")[-1].startswith("Z"))


def _start_long_search(tmp_path: Path) -> tuple[subprocess.Popen, list[int]]:
    p = subprocess.Popen([sys.executable, "-m", "search", *LONG_SEARCH, "-o", "plan.json"], cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and len(_children(p.pid)) < 2:
        time.sleep(0.2)
    workers = _children(p.pid)
    assert len(workers) >= 2, "the search did not start its workers"
    return p, workers


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs /proc (Linux)")
def test_sigterm_writes_the_best_plan_and_stops_the_workers(tmp_path):
    p, workers = _start_long_search(tmp_path)
    time.sleep(1.0)
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=60)      # returns only when every holder of the pipes (workers too) is gone
    assert p.returncode == 143, err
    assert "interrupted; wrote the best plan found so far" in err and "Traceback" not in err, err
    assert json.loads((tmp_path / "plan.json").read_text())["model"]["name"] == "gpt-13b"
    assert not [w for w in workers if _alive(w)]


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs /proc (Linux)")
def test_sigkill_of_the_main_process_leaves_no_worker(tmp_path):
    p, workers = _start_long_search(tmp_path)
    p.kill()
    p.wait(30)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and [w for w in workers if _alive(w)]:
        time.sleep(0.2)
    assert not [w for w in workers if _alive(w)]
    out, err = p.communicate(timeout=30)      # no orphan keeps the pipe open, none prints a BrokenPipe traceback
    assert "Traceback" not in err
    assert not (tmp_path / "plan.json").exists()
