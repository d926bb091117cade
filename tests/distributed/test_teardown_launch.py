"""A launched 2-process ``aceso train`` (``aceso launch --cpu``: torchrun, gloo) ends cleanly: exit status 0, no
rank aborting at exit, and when each rank's interpreter starts to exit (its last ``atexit`` call, from a
``sitecustomize`` put on the ranks' path) no megatron-core DDP wrapper or optimizer is left for finalization. Before the teardown (``training/teardown.py``) the distributed optimizer's DDP, the optimizer
and their gloo process groups lived to interpreter finalization, where destroying them could abort a rank with
"terminate called without an active exception" (pytorch/pytorch#179291; a rare CI flake of test_readme.py).
``tests/runtime/test_teardown.py`` proves in one process that nothing the run built is left when ``train`` returns."""

from __future__ import annotations

import os
import subprocess
import sys

from search.spec.plan import ParallelPlan, StageSpec
from tests.conftest import ROOT
from tests.runtime.test_teardown import TINY

# the ranks' last atexit call (registered first): what of the run is left for interpreter finalization
SITECUSTOMIZE = """
import atexit, gc, os, sys, warnings

def _left():
    if "megatron.core" not in sys.modules or "RANK" not in os.environ:
        return
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.optimizer import MegatronOptimizer
    with warnings.catch_warnings():   # isinstance on torch.distributed's deprecated names warns
        warnings.simplefilter("ignore")
        left = sum(isinstance(o, (DistributedDataParallel, MegatronOptimizer)) for o in gc.get_objects())
    sys.stderr.write(f"rank {os.environ['RANK']} left for finalization: {left}\\n")

atexit.register(_left)
"""


def test_two_process_run_exits_0_without_an_abort_at_exit(tmp_path):
    plan = ParallelPlan(model=TINY, micro_batch_size=2, global_batch_size=8, distributed_optimizer=True,
                        overlap_grad_reduce=True, overlap_param_gather=True,
                        stages=[StageSpec(num_gpus=2, tp=1, dp=2, start_unit=0, end_unit=4, recompute=["none"] * 4)])
    (tmp_path / "plan.json").write_text(plan.to_json())
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path / "site"), str(ROOT)]), OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-m", "search", "launch", str(tmp_path / "plan.json"), "--cpu", "--",
                        "--mock-data", "--train-iters", "3", "--log-interval", "1", "--data-cache-path",
                        str(tmp_path / "cache"), "--save", str(tmp_path / "ckpt"), "--save-interval", "2"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    assert "iteration      3/3" in r.stdout
    assert "terminate called" not in r.stderr and "Traceback" not in r.stderr, r.stderr[-5000:]
    left = sorted(line for line in r.stderr.splitlines() if "left for finalization" in line)
    assert left == ["rank 0 left for finalization: 0", "rank 1 left for finalization: 0"], r.stderr[-5000:]
