"""Gated DeltaNet on CPU (``patches.gdn_cpu``, kernels ``patches/_gdn_ref.py``) against independent references.

The kernels against the definition: the chunked gated delta rule equals the token-by-token recurrence (float64,
random inputs, several chunk sizes with a partial last chunk, an initial state, the final state) and megatron-core
0.19's own torch implementation of the chunked rule (``torch_chunk_gated_delta_rule``, its deterministic-mode
path, after Hugging Face's Qwen3-Next); the causal conv against a convolution written as a sum of shifted inputs;
the L2 norm against fla's formula. Then megatron-core's own GDN layer under the patch (``gdn_layer_case.py``, run
under megatron-core 0.19 in its Python 3.12 environment): forward and every gradient equal a GDN layer written out
from its weights with the recurrence, and ``revert()`` restores megatron-core's names.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from patches._gdn_ref import causal_conv1d, chunk_gated_delta_rule, l2norm, naive_recurrent
from tests.conftest import ROOT

PY_019 = Path(os.environ.get("ACESO_PYTHON_MCORE019", ROOT.parent / "venv312" / "bin" / "python"))


def _inputs(b=2, t=13, h=3, dk=5, dv=4, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q, k, v = rand(b, t, h, dk), F.normalize(rand(b, t, h, dk), dim=-1), rand(b, t, h, dv)
    g = -torch.rand(b, t, h, generator=gen, dtype=torch.float64) * 2
    beta = torch.rand(b, t, h, generator=gen, dtype=torch.float64)
    return q, k, v, g, beta, rand(b, h, dk, dv)


@pytest.mark.parametrize("chunk", [1, 4, 5, 13, 64])
def test_chunked_rule_equals_the_recurrence(chunk):
    q, k, v, g, beta, s0 = _inputs(seed=chunk)
    o, final = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=s0, output_final_state=True, chunk_size=chunk)
    o_ref, final_ref = naive_recurrent(q, k, v, g, beta, initial_state=s0)
    torch.testing.assert_close(o, o_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(final, final_ref, rtol=1e-12, atol=1e-12)
    assert chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=chunk)[1] is None


def test_the_recurrence_is_the_delta_rule_by_hand():
    """Two tokens, one head, written out: S_1 = b1 k1 v1^T, S_2 = a2 (I - b2 k2 k2^T) S_1 + b2 k2 v2^T."""
    q, k, v, g, beta, _ = _inputs(b=1, t=2, h=1, dk=3, dv=2, seed=7)
    k1, k2, v1, v2 = k[0, 0, 0], k[0, 1, 0], v[0, 0, 0], v[0, 1, 0]
    a2, b1, b2 = g[0, 1, 0].exp(), beta[0, 0, 0], beta[0, 1, 0]
    s1 = b1 * torch.outer(k1, v1)
    s2 = a2 * (torch.eye(3, dtype=s1.dtype) - b2 * torch.outer(k2, k2)) @ s1 + b2 * torch.outer(k2, v2)
    o, final = naive_recurrent(q, k, v, g, beta, scale=0.5)
    torch.testing.assert_close(o[0, :, 0], torch.stack([s1.t() @ q[0, 0, 0], s2.t() @ q[0, 1, 0]]) * 0.5)
    torch.testing.assert_close(final[0, 0], s2)


def test_chunked_rule_equals_megatron_cores_torch_rule():
    gdn = pytest.importorskip("megatron.core.ssm.gated_delta_net", reason="megatron-core without GatedDeltaNet")
    q, k, v, g, beta, s0 = _inputs(t=21)
    o, final = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=s0, output_final_state=True)
    o_ref, final_ref = gdn.torch_chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=8, initial_state=s0,
                                                        output_final_state=True)
    torch.testing.assert_close(o, o_ref.double(), rtol=1e-5, atol=1e-5)      # megatron-core's runs in fp32
    torch.testing.assert_close(final, final_ref.double(), rtol=1e-5, atol=1e-5)


def test_causal_conv_and_l2norm():
    gen = torch.Generator().manual_seed(3)
    x, w, bias = (torch.randn(*s, generator=gen, dtype=torch.float64) for s in ((2, 9, 5), (5, 4), (5,)))
    y, state = causal_conv1d(x, w, bias, activation="silu")
    shifted = [F.pad(x, (0, 0, j, 0))[:, : x.shape[1]] for j in range(4)]     # x_{t-j}
    ref = F.silu(sum(shifted[j] * w[:, 3 - j] for j in range(4)) + bias)
    torch.testing.assert_close(y, ref, rtol=1e-12, atol=1e-12)
    assert state is None
    torch.testing.assert_close(l2norm(x), x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6))
    with pytest.raises(NotImplementedError, match="patches.gdn_cpu"):
        chunk_gated_delta_rule(*_inputs()[:5], cu_seqlens=torch.tensor([0, 13]))


def test_megatron_gdn_layer_equals_the_written_out_layer(tmp_path):
    """megatron-core 0.19's GDN layer under the patch (``gdn_layer_case.py``) in its Python 3.12 environment
    (``ACESO_PYTHON_MCORE019``, default ``../venv312/bin/python``)."""
    if not PY_019.exists():
        pytest.skip(f"no Python with megatron-core 0.19 at {PY_019} (set ACESO_PYTHON_MCORE019)")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([str(PY_019), str(ROOT / "tests" / "runtime" / "gdn_layer_case.py")], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    for name, diffs in got["cases"].items():
        assert len(diffs) == 9 and max(diffs.values()) < 1e-4, (name, diffs)     # fp32: output, input, 7 params
    assert got["reverted"]
