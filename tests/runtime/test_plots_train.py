"""`aceso train --plot` on one process: at the end the picture of the run's own log, the same bytes that
`aceso plot LOG` draws afterwards (skipped without matplotlib)."""

from __future__ import annotations

import os
import struct
import subprocess
import sys

import pytest

from aceso_megatron.testing import run_fresh
from search.cli import main
from search.spec.plan import uniform_plan
from search.plots import DPI
from search.plots import training as training_figure
from tests.conftest import ROOT
from tests.tiny_models import GPT


def test_train_plot_draws_the_log_at_the_end(tmp_path):
    pytest.importorskip("matplotlib")
    plan = uniform_plan(GPT, 1, 1, 1, 2, 4)
    (tmp_path / "plan.json").write_text(plan.to_json())
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
               OMP_NUM_THREADS="1")
    log, png = tmp_path / "train.jsonl", tmp_path / "train.png"
    # `aceso train`'s main in a fresh process from the preloaded server (no second torch and megatron-core import;
    # one torch thread as OMP_NUM_THREADS=1 gave): raises if it exits non-zero
    run_fresh(main, ["train", str(tmp_path / "plan.json"), "--cpu", "--mock-data", "--train-iters", "3",
                     "--log-interval", "1", "--log-file", str(log), "--plot", str(png)], cwd=ROOT)
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert struct.unpack(">II", data[16:24]) == (round(training_figure.WIDTH_IN * DPI),
                                                  round(training_figure.HEIGHT_IN * DPI))
    rows = training_figure.read_log(log)
    assert [x["iteration"] for x in rows.train] == [1, 2, 3] and rows.summary is not None
    again = tmp_path / "again.png"
    r = subprocess.run([sys.executable, "-m", "search", "plot", str(log), "-o", str(again)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert again.read_bytes() == data
