"""What a launch script runs is named before how it is written, also where Megatron-LM core_v0.18/0.19's examples
write it (tests/unit/test_megatron_examples.py reads those from a checkout; these copies of their shape always run):

- the module a launcher runs on a continuation line (examples/inference/run_inference_server.sh: ``torchrun ... \\``
  then ``-m examples.inference.launch_inference_server``) was missed, so an inference script behind a ``while`` /
  ``case`` argument parser was refused for its ``case`` statement, not as inference;
- ``uv run [OPTIONS] python -m torch.distributed.run ... -m MODULE`` (examples/mimo/scripts/
  run_hetero_nemotron_20l_mock_train.sh) read as "runs uv"; the command uv runs is the launcher."""

from __future__ import annotations

import pytest

from search.io.errors import AcesoError
from search.megatron.importer import read_megatron

PARSER = """#!/bin/bash
NPROC=8
while [[ $# -gt 0 ]]; do
    case "$1" in
        --nproc) NPROC="$2"; shift 2 ;;
    esac
done
"""


def _refusal(text: str) -> str:
    with pytest.raises(AcesoError) as e:
        read_megatron(text, source="run.sh")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("run.sh: ")
    return msg[len("run.sh: "):]


def test_a_module_on_a_continuation_line_is_what_the_script_runs():
    text = PARSER + 'torchrun --nproc-per-node "$NPROC" \\\n    -m examples.inference.launch_inference_server \\\n' \
        "    --tensor-model-parallel-size 1\n"
    assert _refusal(text).startswith("runs examples/inference/launch_inference_server.py: inference / text "
                                     "generation, not training")


def test_the_command_uv_runs_is_the_launcher():
    text = ('set -euo pipefail\nuv run --extra ssm python -m torch.distributed.run \\\n  --standalone '
            "--nproc-per-node 8 \\\n  -m examples.mimo.pretrain_mimo \\\n  --num-layers 20 --hidden-size 2688\n")
    got = _refusal(text)
    assert got.startswith("line 2: runs examples.mimo.pretrain_mimo (python -m examples.mimo.pretrain_mimo): a MIMO "
                          "multimodal model"), got
