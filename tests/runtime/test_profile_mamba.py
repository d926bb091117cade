"""``aceso profile`` of a hybrid model measures its Mamba-2 unit (``M``) on CPU: the profiler's probe model keeps one
layer per pattern symbol (``units.hybrid_probe``) and megatron-core's own ``MambaLayer`` runs on the ``mamba_cpu``
patch as in the runtime. The row's bytes against ``search.layers.mamba``'s formulas (themselves checked against
megatron-core's layer in test_mamba_layer.py): the parameters, the input that full recompute keeps, at least the
mixer's saved tensors under none, linear in the batch."""

from __future__ import annotations

import tempfile

import pytest
import torch.distributed as dist

from search.layers import mamba
from search.spec.model import ModelSpec
from tests.hybrid_plans import MAMBA8

TINY = ModelSpec.model_validate({
    **MAMBA8.model_dump(), "name": "tiny-mamba", "hidden_size": 64, "num_attention_heads": 4, "num_query_groups": 2,
    "kv_channels": 16, "ffn_hidden_size": 128, "seq_length": 64, "vocab_size": 256, "params_dtype": "fp32",
    "hybrid_layer_pattern": "M*M-M*", "num_layers": 6,
    "mamba": {**MAMBA8.mamba.model_dump(), "mamba_num_heads": 8, "mamba_head_dim": 16, "mamba_num_groups": 2,
              "mamba_state_dim": 16}})


@pytest.fixture(scope="module")
def world1():
    started = not dist.is_initialized()
    if started:
        store = tempfile.mktemp(prefix="aceso-profile-mamba-")
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    from patches import cpu_mode, mamba_cpu

    cpu_mode.apply()
    yield
    mamba_cpu.revert()
    cpu_mode.revert()
    if started:
        dist.destroy_process_group()


def test_the_probe_model_has_one_layer_per_symbol():
    from aceso_megatron.profiler.units import one_layer
    probe = one_layer(TINY)
    assert probe.hybrid_layer_pattern == "M*-" and [u.kind for u in probe.units] == ["mamba", "attention", "mlp"]


def test_the_mamba_unit_is_measured(world1):
    from aceso_megatron.profiler.units import Settings, TPBench
    bench = TPBench(TINY, 1, 1, 0, Settings("cpu", 0, 2))
    spec, h, s = TINY.mamba, TINY.hidden_size, TINY.seq_length
    r1, r2 = bench.unit("decoder", "mamba", 1), bench.unit("decoder", "mamba", 2)
    assert len(r1["act_bytes"]) == len(r1["recompute_us"]) == 2          # the kind's choices: none, full
    assert r1["fwd_us"] > 0 and r1["bwd_us"] > 0 and r1["recompute_us"][0] == 0.0
    assert r1["weight_bytes"] == 4 * mamba.params(spec, h, 1, False).total
    for b, r in ((1, r1), (2, r2)):
        assert r["act_bytes"][1] == 4 * s * b * h                        # full: the layer's input only
        mixer = s * b * mamba.act_bytes(spec, h, 4).total + mamba.fixed_act_bytes(spec, h, 4)
        assert r["act_bytes"][0] >= mixer
    assert r2["act_bytes"][0] - r1["act_bytes"][0] == r1["act_bytes"][0] - mamba.fixed_act_bytes(spec, h, 4)
