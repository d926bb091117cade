"""The worked example of docs/model-specs.md, run as written: its bash blocks, in order, in an empty folder, with
``aceso`` meaning this checkout's command (``python -m search``). Then what the page says happened: the profile
holds the user's layer spec and megatron block in its fingerprint, the plans carry them, both trainings ran their
steps, and the analytic search said what it does not price."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

from tests.conftest import ROOT

DOC = ROOT / "docs" / "model-specs.md"


def example_blocks() -> list[str]:
    text = DOC.read_text()
    section = text[text.index("## Worked example"):]
    return re.findall(r"```bash\n(.*?)```", section, flags=re.S)


def test_doc_has_the_blocks():
    blocks = example_blocks()
    assert len(blocks) == 3 and "aceso profile" in blocks[1] and "aceso launch" in blocks[2]


def test_worked_example_runs_as_written(tmp_path):
    script = "set -euo pipefail\naceso() { \"$PYTHON\" -m search \"$@\"; }\n" + "\n".join(example_blocks())
    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    r = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1500)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-6000:]
    db = json.loads((tmp_path / "qk-db.json").read_text())
    assert db["model"]["layer_spec"] == "my_specs:qk_layernorm_layer"
    assert db["model"]["megatron"] == {"qk_layernorm": True, "layernorm_epsilon": 1e-6}
    attn = [u for u in db["units"] if u["kind"] == "attention" and u["tp"] == 1 and u["batch"] == 1][0]
    h = 64   # QKV (3h^2 + 3h) + proj (h^2 + h) + input norm (2h) + the two QK norms over a head (2 * 2 * h/heads)
    assert attn["weight_bytes"] == 4 * (4 * h * h + 4 * h + 2 * h + 4 * (h // 4))
    for name, spec in (("qk-plan.json", "my_specs:qk_layernorm_layer"),
                       ("sqrelu-plan.json", "my_specs:squared_relu_layer")):
        plan = json.loads((tmp_path / name).read_text())
        assert plan["model"]["layer_spec"] == spec, name
    assert json.loads((tmp_path / "qk-plan.json").read_text())["predicted"]["cost_model"] == "profile"
    assert ("note: analytic cost model: prices the stock megatron-core layer, not layer_spec "
            "my_specs:squared_relu_layer") in out
    losses = [float(x) for x in re.findall(r"iteration\s+4/4 \| loss ([0-9.]+)", out)]
    assert len(losses) == 2 and all(0 < x < 20 for x in losses), out[-3000:]   # both trainings reached step 4
