"""GPU tier (skipped without CUDA): the fast paths against the unfused build of the same plan.

The plan runs twice on NCCL with the same weights and batches: once with what ``fast_path.choose`` picks on this
machine (transformer-engine specs when importable, bias-activation / bias-dropout-add / softmax fusions,
gradient-accumulation fusion), once unfused (megatron-core's local specs, every fusion off). Both in fp32, so the
5 losses agree closely (TF32 is off in torch by default; fused kernels reorder sums). A checkpoint written by the
fused run loads into an unfused runtime (TE's fused LayerNorm weights map to the local norms' names) and gives the
fused run's next loss. With 2 GPUs the plan is a TP-2 sequence-parallel stage (fused layers, SP norms, the
communicator on NCCL); with one, a single-GPU stage.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs CUDA (the GPU tier runs on a machine with an NVIDIA GPU)", allow_module_level=True)

from aceso_megatron.testing import make_batches, spawn  # noqa: E402
from search.spec.model import ModelSpec  # noqa: E402

STEPS, SEED = 5, 21
MODEL = ModelSpec(name="gpu-gpt", family="gpt", num_layers=2, hidden_size=256, num_attention_heads=8,
                  ffn_hidden_size=1024, seq_length=128, vocab_size=1024, params_dtype="fp32")


def _plan(num_gpus: int) -> dict:
    tp = 2 if num_gpus >= 2 else 1
    return {"model": MODEL.model_dump(), "micro_batch_size": 4, "global_batch_size": 16, "stages": [
        {"num_gpus": tp, "tp": tp, "dp": 1, "sequence_parallel": tp > 1, "start_unit": 0, "end_unit": 4,
         "recompute": ["none", "selective", "full", "selective"]}]}


def _run(rank: int, world: int, raw: dict, ckpt: str, out: str) -> None:
    from types import SimpleNamespace

    from aceso_megatron.model.fast_path import OFF, FastPath
    from aceso_megatron.training import checkpoint
    from aceso_megatron.training.engine import TrainConfig, build_runtime
    from aceso_megatron.training.train import build_scheduler

    tc = TrainConfig(lr=1e-3, clip_grad=1.0)
    schedule = SimpleNamespace(lr=1e-3, min_lr=1e-4, lr_warmup_iters=0, lr_decay_iters=None, train_iters=STEPS + 1,
                               lr_decay_style="constant", weight_decay=0.01)
    batches = make_batches(MODEL, 4, 16 * (STEPS + 1), SEED)
    unfused = FastPath("local", "fp32", dict(OFF))
    res = {}
    for name, fast in (("fused", None), ("unfused", unfused)):
        rt = build_runtime(raw, rank, world, seed=SEED, device="cuda", train_config=tc, fast=fast)
        sch = build_scheduler(schedule, rt.optimizer)
        res[name] = [rt.train_step(iter(batches[4 * i:4 * i + 4])) for i in range(STEPS)]
        res[name + "_spec"] = rt.fast.spec
        if name == "fused":
            checkpoint.save(ckpt, STEPS, rt, sch)
            res["fused_next"] = rt.train_step(iter(batches[4 * STEPS:]))
    rt = build_runtime(raw, rank, world, seed=SEED, device="cuda", train_config=tc, fast=unfused)
    sch = build_scheduler(schedule, rt.optimizer)
    checkpoint.load(ckpt, rt, sch)
    res["unfused_from_fused_checkpoint"] = rt.train_step(iter(batches[4 * STEPS:]))
    if rank == 0:
        torch.save(res, out)


def test_fused_plan_matches_unfused_and_its_checkpoint_loads_unfused(tmp_path):
    world = min(2, torch.cuda.device_count())
    out = tmp_path / "res.pt"
    spawn(world, _run, _plan(world), str(tmp_path / "ckpt"), str(out), backend="nccl")
    res = torch.load(out)
    assert res["unfused_spec"] == "local"
    assert res["fused"] == pytest.approx(res["unfused"], rel=2e-3), res
    assert res["fused"][-1] < res["fused"][0]
    assert res["unfused_from_fused_checkpoint"] == pytest.approx(res["fused_next"], rel=2e-3), res


def _cp_run(rank: int, world: int, out: str) -> None:
    from aceso_megatron.training.engine import TrainConfig, build_runtime

    model = MODEL.model_copy(update={"params_dtype": "bf16"})  # TE's CP attention runs in 16 bits
    batches = make_batches(model, 4, 16 * STEPS, SEED)
    res = {}
    for name, shape in (("cp2", {"cp": 2, "dp": 1}), ("dp2", {"cp": 1, "dp": 2})):
        raw = {"model": model.model_dump(), "micro_batch_size": 4, "global_batch_size": 16, "stages": [
            {"num_gpus": 2, "tp": 1, **shape, "start_unit": 0, "end_unit": 4, "recompute": ["none"] * 4}]}
        rt = build_runtime(raw, rank, world, seed=SEED, device="cuda", train_config=TrainConfig(clip_grad=1.0))
        res[name] = [rt.train_step(iter(batches[4 * i:4 * i + 4])) for i in range(STEPS)]
    if rank == 0:
        torch.save(res, out)


def test_context_parallel_plan_matches_data_parallel(tmp_path):
    """cp 2 (TE's ring attention, CP groups through pg_collection, load-balanced sequence chunks) trains like the
    same model on dp 2 (bf16: to 1 %)."""
    pytest.importorskip("transformer_engine")
    if torch.cuda.device_count() < 2:
        pytest.skip("context parallelism needs 2 GPUs")
    out = tmp_path / "cp.pt"
    spawn(2, _cp_run, str(out), backend="nccl")
    res = torch.load(out)
    assert res["cp2"] == pytest.approx(res["dp2"], rel=1e-2), res
