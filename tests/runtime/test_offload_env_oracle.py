"""The exported launch script of a plan with fine-grained activation offload sets ``NVTE_CPU_OFFLOAD_V1=1``:
Megatron-LM's ``validate_args`` (core_v0.16.1 to core_v0.19.0, ``arguments.py``: "For fine-grained activation
offloading with TE >= 2.10.0, NVTE_CPU_OFFLOAD_V1 should be set to 1") refuses the run without it on every
transformer-engine from 2.10. Checked with each release's own parser (megatron_lm_oracle.py, transformer-engine
answered as new enough), in the environment the script exports; before, the script exported nothing for it."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from search.cli import main
from tests.runtime.test_megatron_lm_oracle import _checkout

LINE = ("--num-layers 4 --hidden-size 512 --num-attention-heads 8 --seq-length 1024 --max-position-embeddings 1024 "
        "--tensor-model-parallel-size 2 --sequence-parallel --micro-batch-size 1 --global-batch-size 16 --bf16 "
        "--fine-grained-activation-offloading --offload-modules core_attn "
        "--tokenizer-type NullTokenizer --vocab-size 32000")


def _oracle(tag: str, line: str, env: dict[str, str]) -> dict:
    root = _checkout(tag)
    r = subprocess.run([sys.executable, str(Path(__file__).with_name("megatron_lm_oracle.py"))],
                       input=json.dumps([{"line": line, "world": 8}]), capture_output=True, text=True,
                       env={**os.environ, **env, "PYTHONPATH": str(root)}, timeout=1200)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])[0]


@pytest.mark.parametrize("tag", ["core_v0.16.1", "core_v0.19.0"])
def test_the_script_exports_what_validate_args_asserts(tmp_path, capsys, tag):
    _checkout(tag)
    plan, script = tmp_path / "plan.json", tmp_path / "run.sh"
    version = tag.removeprefix("core_v")
    assert main(["import", "--from", "megatron-lm", "--args", LINE, "--world-size", "8", "--megatron-version",
                 version, "-o", str(plan)]) == 0
    assert main(["export", str(plan), "--megatron-version", version, "-o", str(script)]) == 0
    assert main(["export", str(plan), "--megatron-version", version, "--args-only"]) == 0
    line = capsys.readouterr().out.strip()
    assert "--fine-grained-activation-offloading" in line
    exported = dict(re.findall(r"^export (\w+)=(\S+)", script.read_text(), re.M))
    assert "NVTE_CPU_OFFLOAD_V1" in _oracle(tag, line, {"NVTE_CPU_OFFLOAD_V1": "0"}).get("error", "")  # the rule
    got = _oracle(tag, line, {"NVTE_CPU_OFFLOAD_V1": "0", **exported})
    assert "error" not in got, got
