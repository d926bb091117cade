"""The README's quick start, run as written: every ```bash block of README.md, in order, in one shell, in a
temporary folder, so the README cannot drift from the code.

A block is skipped only when the README marks it ``<!-- readme-test: skip (reason) -->`` (the install, the test
suite itself, the GPU profiler). ``aceso`` and ``python`` are shell functions running this interpreter on this
checkout (``sys.executable -m search``), not whatever is on PATH. About two minutes on a 2-core machine: two
searches for GPT-1.3B, a tiny CPU search, three 2-process CPU trainings and a data preparation.
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
    assert (runs / "data" / "corpus.bin").is_file() and (runs / "data" / "corpus.idx").is_file()
    assert "saved checkpoint ckpt/iter_0000010" in r.stdout
    assert "resumed from ckpt at iteration 10" in r.stdout                           # the resume trained on
    assert (runs / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "20"
    sbatch = (runs / "job.sbatch").read_text()
    assert "#SBATCH --nodes=4" in sbatch and "#SBATCH --gpus-per-node=8" in sbatch
    assert subprocess.run(["bash", "-n", str(runs / "job.sbatch")]).returncode == 0
    assert "Traceback" not in log
