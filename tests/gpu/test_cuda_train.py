"""GPU tier (skipped without CUDA): `aceso train` on NCCL runs a heterogeneous plan and learns, and its
losses match the same plan run on CPU/gloo (fp32) — the CPU path is the one proven equal to a single-process
model in tests/distributed."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs CUDA (the GPU tier runs on a machine with an NVIDIA GPU)", allow_module_level=True)

from search.spec.model import ModelSpec  # noqa: E402
from search.spec.plan import ParallelPlan, StageSpec  # noqa: E402

MODEL = ModelSpec(name="tiny-gpt", family="gpt", num_layers=2, hidden_size=64, num_attention_heads=4,
                  ffn_hidden_size=256, seq_length=64, vocab_size=512, params_dtype="fp32")


def _plan(num_gpus: int) -> ParallelPlan:
    if num_gpus >= 2:  # two stages cut between an attention and an MLP half, recompute mixed
        stages = [StageSpec(num_gpus=1, tp=1, dp=1, start_unit=0, end_unit=3, recompute=["full", "none", "selective"]),
                  StageSpec(num_gpus=1, tp=1, dp=1, start_unit=3, end_unit=4, recompute=["none"])]
    else:
        stages = [StageSpec(num_gpus=1, tp=1, dp=1, start_unit=0, end_unit=4,
                            recompute=["full", "none", "selective", "none"])]
    return ParallelPlan(model=MODEL, micro_batch_size=2, global_batch_size=8, stages=stages)


def _train(tmp_path, plan: ParallelPlan, cpu: bool) -> list[float]:
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(plan.to_json())
    log = tmp_path / ("cpu.jsonl" if cpu else "gpu.jsonl")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={plan.world_size}",
           "-m", "aceso_megatron.training.train", str(plan_file), "--mock-data", "--train-iters", "10",
           "--log-interval", "1", "--lr", "3e-3", "--log-file", str(log)] + (["--cpu"] if cpu else [])
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return [rec["loss"] for rec in map(json.loads, log.read_text().splitlines()) if rec.get("kind") == "train"]


def check_learns_and_matches_cpu(tmp_path, plan: ParallelPlan, rel: float) -> None:
    """10 steps of ``plan`` on CUDA lower the loss by 0.5 and equal the same steps on CPU within ``rel``."""
    gpu = _train(tmp_path, plan, cpu=False)
    cpu = _train(tmp_path, plan, cpu=True)
    assert len(gpu) == len(cpu) == 10
    assert gpu[-1] < gpu[0] - 0.5, gpu
    assert gpu == pytest.approx(cpu, rel=rel), (gpu, cpu)


def test_cuda_training_learns_and_matches_cpu(tmp_path):
    # fp32 on both; TF32 matmuls on the GPU are off by default in torch, so the two agree closely
    check_learns_and_matches_cpu(tmp_path, _plan(min(2, torch.cuda.device_count())), rel=2e-3)
