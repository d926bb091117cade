"""The GDN formulas (``search.layers.gdn``) against megatron-core 0.19's own ``GatedDeltaNet``: its parameters as
built (``gdn_case.py``, one CPU process, fla's kernels never called) and the (tp, cp) its ``TransformerConfig``
refuses, in the Python 3.12 environment of megatron-core 0.19 (skipped where there is none)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from search.layers.gdn import GDNSpec, params, shape_refusal
from tests.runtime.test_mamba_layer import PY_019

GRID = [[tp, cp] for tp in (1, 2, 4, 8) for cp in (1, 2, 4)]


SPECS = [GDNSpec(linear_key_head_dim=32, linear_value_head_dim=48, linear_num_key_heads=2, linear_num_value_heads=4,
                 linear_conv_kernel_dim=3),
         GDNSpec(linear_num_key_heads=4, linear_num_value_heads=8)]
HIDDEN = 256


@pytest.fixture(scope="module")
def megatron() -> list[dict]:
    """megatron-core's answer for every spec of ``SPECS``, from one ``gdn_case.py`` process (one start of the
    Python 3.12 environment, torch and megatron-core for both specs)."""
    if not PY_019.exists():
        pytest.skip(f"no megatron-core 0.19 environment at {PY_019} (ACESO_PYTHON_MCORE019)")
    cases = [{"spec": spec.model_dump(), "hidden": HIDDEN, "grid": GRID} for spec in SPECS]
    r = subprocess.run([str(PY_019), str(Path(__file__).with_name("gdn_case.py"))], capture_output=True, text=True,
                       input=json.dumps(cases), timeout=600)
    if "No module named 'megatron.core.ssm.gated_delta_net'" in r.stderr:
        pytest.skip("this megatron-core has no gated_delta_net package (0.19 has)")
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(got) == len(SPECS)
    return got


@pytest.mark.parametrize("i", range(len(SPECS)), ids=[f"spec{i}" for i in range(len(SPECS))])
def test_parameters_and_tp_cp_rule_are_megatron_cores(megatron, i):
    spec, got = SPECS[i], megatron[i]
    p = params(spec, HIDDEN)
    # the local spec's in_proj has no fused norm: the layer's pre-norm is apart (TE fuses it into in_proj)
    assert got["params"] == {"dt_bias": p.dt_bias, "A_log": p.A_log, "in_proj.weight": p.in_proj,
                             "conv1d.weight": p.conv1d, "out_norm.weight": p.out_norm, "out_proj.weight": p.out_proj}
    assert got["refused"] == [shape_refusal(spec, tp, cp) is not None for tp, cp in GRID]
