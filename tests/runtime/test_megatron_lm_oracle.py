"""Megatron-LM core_v0.16.1's own argument parser accepts every exported command line and builds each pipeline
rank's model chunks with exactly the plan's layers and recompute setting.

Needs a Megatron-LM checkout of core_v0.16.1 (megatron/training is not in the megatron-core wheel): set
``ACESO_MEGATRON_LM=/path/to/Megatron-LM``; skipped otherwise.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from search.megatron import megatron_config
from search.megatron.script import args_line
from tests.megatron_plans import CASES, case_plan

CHECKOUT = os.environ.get("ACESO_MEGATRON_LM")
pytestmark = pytest.mark.skipif(not CHECKOUT or not (Path(CHECKOUT) / "megatron" / "training").is_dir(),
                                reason="set ACESO_MEGATRON_LM to a Megatron-LM core_v0.16.1 checkout")


def _oracle(plans):
    cases = [{"line": args_line(megatron_config(p)), "world": p.world_size} for p in plans]
    env = {**os.environ, "PYTHONPATH": CHECKOUT}
    r = subprocess.run([sys.executable, str(Path(__file__).with_name("megatron_lm_oracle.py"))], input=json.dumps(cases),
                       capture_output=True, text=True, env=env, timeout=1200)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_megatron_lm_takes_the_fsdp_and_offload_flags():
    """Megatron FSDP (each strategy) and CPU activation offload as exported: parsed, validated (fsdp_dtensor,
    CUDA_DEVICE_MAX_CONNECTIONS unset) and in megatron-core's TransformerConfig (offload: one stage, no recompute)."""
    from search.fsdp import ActivationOffload, MegatronFSDP
    from search.plan import uniform_plan
    from search.presets import load_model
    model = load_model("llama3-8b", num_layers=4)
    plans = [uniform_plan(model, 1, 2, 4, 4, 16, "none", overlap_grad_reduce=True, overlap_param_gather=s != "no_shard",
                          megatron_fsdp=MegatronFSDP(data_parallel_sharding_strategy=s),
                          activation_offload=ActivationOffload(num_layers=2) if s == "optim_grads_params" else None)
             for s in ("no_shard", "optim", "optim_grads", "optim_grads_params")]
    for plan, got in zip(plans, _oracle(plans)):
        assert "error" not in got, got
        s = plan.megatron_fsdp.data_parallel_sharding_strategy
        assert got["fsdp"] == [True, s, "fsdp_dtensor"]
        assert got["offload"] == ([True, 2] if plan.activation_offload else [False, 0])


def test_megatron_lm_parses_validates_and_builds_the_plans_layers():
    plans = {n: case_plan(n) for n in sorted(CASES)}
    cases = [{"line": args_line(megatron_config(p)), "world": p.world_size} for p in plans.values()]
    env = {**os.environ, "PYTHONPATH": CHECKOUT}
    r = subprocess.run([sys.executable, str(Path(__file__).with_name("megatron_lm_oracle.py"))], input=json.dumps(cases),
                       capture_output=True, text=True, env=env, timeout=1200)
    assert r.returncode == 0, r.stderr[-2000:]
    results = json.loads(r.stdout.strip().splitlines()[-1])
    for (name, plan), got in zip(plans.items(), results):
        assert "error" not in got, (name, got)
        c = megatron_config(plan)
        assert got["dp"] == c.dp and got["micro_batch_size"] == c.micro_batch_size, name
        if not plan.model.is_t5:                  # T5's two blocks are built by pretrain_t5.py, not from the config
            starts = [0]
            for n in c.chunk_layers:
                starts.append(starts[-1] + n)
            assert got["chunks"] == [[a, n] for a, n in zip(starts, c.chunk_layers)], name
        rc = c.recompute
        assert got["recompute"] == [rc.granularity, rc.method, rc.num_layers,
                                    list(rc.modules) if rc.granularity == "selective" else None], name
        assert got["sequence_parallel"] == c.sequence_parallel, name
        m = plan.model                            # GPT-OSS's layer fields (search.layer_variants) as megatron-core's
        assert got["kv_channels"] == m.head_dim, name
        assert got["layer_variants"] == {
            "window_size": m.window_size, "window_attn_skip_freq": m.window_attn_skip_freq,
            "softmax_type": m.softmax_type or "vanilla", "glu_linear_offset": m.glu_linear_offset or 0.0,
            "activation_func_clamp_value": m.activation_func_clamp_value,
            "activation": {"gelu": "gelu", "swiglu": "silu", "quick_geglu": "quick_gelu"}[m.activation],
            "gated": m.gated_mlp}, name
