"""The README's quick start, run as written: every ```bash block of README.md, in order, in one shell, in a
temporary folder, so the README cannot drift from the code.

A block is skipped only when the README marks it ``<!-- readme-test: skip (reason) -->`` (the install, the test
suite itself, the GPU profiler). ``aceso`` and ``python`` are shell functions running this interpreter on this
checkout (``sys.executable -m search``), not whatever is on PATH. About four minutes on a 2-core machine: two
searches for GPT-1.3B, two CPU searches, three 2-process CPU trainings, the 4-process pipelined demo and a data
preparation.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.readme

_BLOCK = re.compile(r"(?:<!-- readme-test: skip \(([^)]*)\) -->[ \t]*\n)?([ \t]*)```bash\n(.*?)\n[ \t]*```", re.S)


def readme_blocks() -> list[tuple[str | None, str]]:
    """(skip reason or None, code) of every bash block, indentation removed."""
    out = []
    for m in _BLOCK.finditer((ROOT / "README.md").read_text()):
        indent = m.group(2)
        code = "\n".join(ln[len(indent):] if ln.startswith(indent) else ln for ln in m.group(3).splitlines())
        out.append((m.group(1), code))
    return out


def test_every_block_runs_or_says_why_not():
    blocks = readme_blocks()
    assert len(blocks) == sum(1 for _ in re.finditer(r"```bash", (ROOT / "README.md").read_text()))
    skipped = [reason for reason, _ in blocks if reason]
    assert all(r.strip() for r in skipped) and len(skipped) <= 3, skipped
    assert len(blocks) - len(skipped) >= 4


def test_quick_start_runs_as_written(tmp_path):
    prelude = ('set -euo pipefail\n'
               'aceso() { "$ACESO_PYTHON" -m search "$@"; }\n'
               'python() { "$ACESO_PYTHON" "$@"; }\n')
    body = "\n".join(f"echo '>>> README block {i}'\n{code}" for i, (skip, code) in enumerate(readme_blocks())
                     if skip is None)
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "ACESO_PYTHON": sys.executable,
           "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    r = subprocess.run(["bash", "-c", prelude + body], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=900, check=False)
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-4000:]
    runs = tmp_path / "runs"
    # the quick start's results, checked against what the README says they are
    plan = json.loads((runs / "plan.json").read_text())
    assert plan["model"]["name"] == "gpt-1.3b" and sum(s["num_gpus"] for s in plan["stages"]) == 8
    assert "valid plan for gpt-1.3b on 8 GPUs" in r.stdout and "fits 1x8-h100" in r.stdout
    assert re.search(r"iteration\s+20/20 \| loss", r.stdout)                      # mock-data training
    _check_pipe_demo(json.loads((runs / "pipe-plan.json").read_text()), r.stdout)
    assert (runs / "data" / "corpus.bin").is_file() and (runs / "data" / "corpus.idx").is_file()
    assert "saved checkpoint ckpt/iter_0000010" in r.stdout
    assert "resumed from ckpt at iteration 10" in r.stdout                           # the resume trained on
    assert (runs / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "20"
    sbatch = (runs / "job.sbatch").read_text()
    assert "#SBATCH --nodes=4" in sbatch and "#SBATCH --gpus-per-node=8" in sbatch
    assert subprocess.run(["bash", "-n", str(runs / "job.sbatch")]).returncode == 0
    assert "Traceback" not in log


def _check_pipe_demo(plan: dict, stdout: str) -> None:
    """The 2x2-cpu demo, as the README says it is: pipelined across the two nodes in uneven chunks, faster than the
    uniform and Megatron-LM lines (its search's report lines), and trained."""
    stdout = next(b for b in stdout.split(">>> README block ") if "pipe-gpt on 2x2-cpu" in b)
    sizes = [c["end_unit"] - c["start_unit"] for st in plan["stages"] for c in st["chunks"]]
    assert len(plan["stages"]) == 2 and len(set(sizes)) > 1, sizes
    ms = {k: float(re.findall(rf"{k}\s+([\d.]+) ms", stdout)[-1])
          for k in ("uniform Megatron-LM", "Megatron-LM plan", "heterogeneous plan")}
    assert ms["heterogeneous plan"] < min(ms["uniform Megatron-LM"], ms["Megatron-LM plan"]), ms
    assert re.search(r"iteration\s+10/10 \| loss", stdout)
