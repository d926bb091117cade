"""Mamba-2 on CPU (``patches.mamba_cpu``) and the Mamba formulas (``search.layers.mamba``) against megatron-core.

The reference kernels against the definition: the chunked SSD scan equals the step-by-step recurrence (float64,
random inputs, partial last chunk, several groups, an initial state); the fused conv + scan function's own
backward (which keeps only what mamba_ssm's kernel keeps) passes ``gradcheck``. Then megatron-core's own
``MambaLayer`` under the patch (``mamba_case.py``): forward and backward equal a Mamba-2 layer written out with the
recurrence; its parameters per TP rank and the bytes it keeps for backward equal the formulas; megatron-core's
TP and CP asserts (``MambaMixer``, ``MambaContextParallel``) refuse exactly what ``tp_refusal`` / ``cp_refusal``
refuse. The same checks run under megatron-core 0.19.2 in its Python 3.12 environment when one is found.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from search.layers.mamba import Mamba2Spec, cp_refusal, tp_refusal
from tests.conftest import ROOT
from tests.runtime import mamba_case as case

PY_019 = Path(os.environ.get("ACESO_PYTHON_MCORE019", ROOT.parent / "venv312" / "bin" / "python"))


def _rand(*shape):
    return torch.randn(*shape, dtype=torch.float64)


@pytest.mark.parametrize("chunk", [1, 4, 5, 13, 32])
def test_chunked_scan_equals_the_recurrence(chunk):
    from patches._mamba_ref import naive_scan, ssd_chunked

    torch.manual_seed(chunk)
    b, length, heads, p, groups, n = 2, 13, 6, 3, 3, 5
    x, B, C, start = _rand(b, length, heads, p), _rand(b, length, groups, n), _rand(b, length, groups, n), \
        _rand(b, heads, p, n)
    dt = torch.rand(b, length, heads, dtype=torch.float64)
    A = -torch.rand(heads, dtype=torch.float64) * 3
    y, final = ssd_chunked(x, dt, A, B, C, chunk, start)
    y_ref, final_ref = naive_scan(x, dt, A, B, C, start)
    torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(final, final_ref, rtol=1e-12, atol=1e-12)


def test_chunk_scan_combined_is_mamba2():
    """megatron-core's prefill call: softplus(dt + dt_bias), D skip, silu(z) gate, final state."""
    import torch.nn.functional as F

    from patches._mamba_ref import mamba_chunk_scan_combined, naive_scan

    torch.manual_seed(1)
    b, length, heads, p, groups, n = 1, 9, 4, 2, 2, 3
    x, z, B, C = _rand(b, length, heads, p), _rand(b, length, heads, p), _rand(b, length, groups, n), \
        _rand(b, length, groups, n)
    dt, dt_bias, D, A = _rand(b, length, heads), _rand(heads), _rand(heads), -torch.rand(heads, dtype=torch.float64)
    out, final = mamba_chunk_scan_combined(x, dt, A, B, C, 4, D=D, z=z, dt_bias=dt_bias, dt_softplus=True,
                                           return_final_states=True)
    y, final_ref = naive_scan(x, F.softplus(dt + dt_bias), A, B, C)
    torch.testing.assert_close(out, (y + x * D[:, None]) * F.silu(z), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(final, final_ref, rtol=1e-12, atol=1e-12)
    with pytest.raises(NotImplementedError, match="packed sequences"):
        mamba_chunk_scan_combined(x, dt, A, B, C, 4, seq_idx=torch.zeros(b, length, dtype=torch.int32))


def test_fused_kernel_and_norm_backward_pass_gradcheck():
    from patches._mamba_ref import _GroupRMSNorm, mamba_split_conv1d_scan_combined

    torch.manual_seed(2)
    b, length, heads, p, groups, n, width = 1, 6, 2, 2, 1, 2, 4
    dim, conv = heads * p, heads * p + 2 * groups * n
    inputs = [_rand(b, length, 2 * dim + 2 * groups * n + heads), _rand(conv, width), _rand(conv), _rand(heads),
              _rand(heads), _rand(heads)]
    inputs = [t.requires_grad_() for t in inputs]

    def fused(zxbcdt, w, bias, dt_bias, a_log, D):
        return mamba_split_conv1d_scan_combined(zxbcdt, w, bias, dt_bias, -torch.exp(a_log), D, 4, headdim=p,
                                                ngroups=groups)

    assert torch.autograd.gradcheck(fused, inputs)
    x, w = _rand(3, 8).requires_grad_(), _rand(8).requires_grad_()
    assert torch.autograd.gradcheck(lambda x, w: _GroupRMSNorm.apply(x, w, 4, 1e-5), (x, w))


@pytest.fixture(scope="module")
def mamba_process():
    from aceso_megatron.testing import free_port

    case.setup(free_port())


@pytest.mark.parametrize("name", sorted(case.CASES))
def test_megatron_mamba_layer_equals_the_written_out_layer(mamba_process, name):
    got = case.check_forward_backward(name)
    assert got["output"] < 1e-5
    assert max(got["grads"].values()) < 1e-5, got["grads"]


@pytest.mark.parametrize("name,tp", [(n, tp) for n in sorted(case.CASES) for tp in case.tp_sizes(n)])
def test_parameters_per_tp_rank(mamba_process, name, tp):
    got = case.check_params(name, tp)
    assert got["megatron"] == got["formula"]


@pytest.mark.parametrize("name,dtype", [(n, d) for n in sorted(case.CASES) for d in ("fp32", "bf16")])
def test_activation_bytes_kept_for_backward(mamba_process, name, dtype):
    got = case.check_act_bytes(name, dtype)
    assert got["megatron"] == got["formula"]


def _megatron_accepts(build) -> bool:
    try:
        build()
    except AssertionError:
        return False
    return True


def test_tp_rule_is_megatron_cores(mamba_process):
    """``MambaMixer`` built at each TP size (construction only) refuses exactly what ``tp_refusal`` refuses."""
    for heads, groups in ((4, 1), (8, 2), (12, 4), (6, 3)):
        m = Mamba2Spec(mamba_state_dim=4, mamba_head_dim=4, mamba_num_groups=groups, mamba_num_heads=heads,
                       chunk_size=8)
        for tp in (1, 2, 3, 4, 8):
            accepted = _megatron_accepts(lambda: case.build(m, tp=tp))
            assert accepted == (tp_refusal(m, case.HIDDEN, tp) is None), (heads, groups, tp)


def test_cp_rule_is_megatron_cores(mamba_process):
    """``MambaContextParallel`` (the CP all-to-all's set-up) refuses exactly what ``cp_refusal`` refuses."""
    from megatron.core.ssm.mamba_context_parallel import MambaContextParallel

    names = list(inspect.signature(MambaContextParallel).parameters)
    for heads, groups, tp in ((8, 2, 1), (8, 2, 2), (16, 4, 2), (24, 8, 4), (12, 3, 1)):
        m = Mamba2Spec(mamba_state_dim=4, mamba_head_dim=4, mamba_num_groups=groups, mamba_num_heads=heads)
        if tp_refusal(m, case.HIDDEN, tp):
            continue
        for cp in (1, 2, 3, 4, 6, 8, 16):
            sizes = {"cp_group": case._Group(cp), "d_inner_local_tp": heads * 4 // tp, "nheads_local_tp": heads // tp,
                     "ngroups_local_tp": groups // tp, "d_state": 4, "D_has_hdim": False}
            kwargs = {k: sizes.get(k) for k in names}
            accepted = _megatron_accepts(lambda: MambaContextParallel(**kwargs))
            assert accepted == (cp_refusal(m, case.HIDDEN, tp, cp) is None), (heads, groups, tp, cp)


def test_megatron_core_0_19(tmp_path):
    """The layer, parameter and memory checks under megatron-core 0.19.2 (its Python 3.12 environment:
    ``ACESO_PYTHON_MCORE019``, default ``../venv312/bin/python``)."""
    if not PY_019.exists():
        pytest.skip(f"no Python with megatron-core 0.19 at {PY_019} (set ACESO_PYTHON_MCORE019)")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "ACESO_ALLOW_UNTESTED_MEGATRON": "1"}   # cpu_mode: 0.16.1 only
    run = subprocess.run([str(PY_019), str(ROOT / "tests" / "runtime" / "mamba_case.py")], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["version"].startswith("0.19")
    for name, res in got["forward_backward"].items():
        assert res["output"] < 1e-5 and max(res["grads"].values()) < 1e-5, (name, res)
    for key, res in {**got["params"], **got["act_bytes"]}.items():
        assert res["megatron"] == res["formula"], key
