"""A worker's bad input comes back from torchrun as its one line and exit 2 (issue 15), not as torchrun's
``ChildFailedError`` report; ``aceso launch`` itself refuses bad train arguments before starting anything.

The first test starts torchrun directly on ``aceso_megatron.training.train`` with arguments that only the
workers check (``aceso launch`` would have refused them first), so what is tested is the way back: the error file
every worker may write (``report_bad_input``) and ``run_torchrun``'s filtering of torchrun's report.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from search.spec.cluster import parse_cluster
from search.io.errors import AcesoError
from search.spec.model import ModelSpec
from search.spec.plan import uniform_plan
from tests.conftest import ROOT

TINY = ModelSpec(name="tiny", family="gpt", num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                 seq_length=16, vocab_size=512, params_dtype="fp32")


@pytest.fixture
def plan(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text(uniform_plan(TINY, 1, 1, 2, 2, 4, cluster=parse_cluster("1x2-cpu")).to_json())
    return str(path)


def test_worker_bad_input_is_one_line_not_torchruns_report(plan, capfd):
    from launch.commands import run_torchrun

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
           "-m", "aceso_megatron.training.train", plan, "--cpu", "--mock-data"]      # no --train-iters
    with pytest.raises(AcesoError, match=r"the following arguments are required: --train-iters"):
        run_torchrun(cmd, extra_pythonpath=str(ROOT))
    out, err = capfd.readouterr()
    assert "ChildFailedError" not in err and "Traceback" not in err and "SIGTERM" not in err, err


def test_launch_refuses_bad_train_arguments_before_starting_anything(plan, tmp_path):
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "search", "launch", plan, "--cpu", "--", "--mock-data"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120,
                       env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)})
    assert r.returncode == 2 and r.stdout == ""                 # the torchrun command was never printed
    assert r.stderr.strip().splitlines() == [
        "aceso launch: error: the following arguments are required: --train-iters (on the command line or in "
        "--config); see `aceso train --help`"]
    assert time.monotonic() - t0 < 60                           # no worker started (they take longer)
