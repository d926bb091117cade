"""Checkpoints across plan generations on 4 gloo ranks: a checkpoint written under a schema-v1 plan (TP 2 | DP 2)
resumes under an interleaved, sequence-parallel plan with the same next-step losses as the run that wrote it; one
written by the distributed optimizer with both overlaps under an interleaved SP plan resumes under the v1 layout
with the distributed optimizer (megatron-core's fully re-shardable format), and the v1 checkpoint of the plain
optimizer under the interleaved SP plan with the distributed one (Adam's state converted); a checkpoint of another
model is refused with one line naming the first differing field (another width; GPT into T5), also for a checkpoint
that does not record its model (the first differently shaped tensor); the weights alone (``--no-load-optim``) load
from a checkpoint of either optimizer kind."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

from aceso_megatron.testing import make_batches, scheduled_steps, spawn
from aceso_megatron.training.engine import TrainConfig
from search.io.errors import AcesoError
from tests.tiny_models import GPT, T5

SEED, ITERS, SAVE_AT = 5, 4, 2
TC = TrainConfig(lr=1e-3, clip_grad=0.3)
SCHEDULE = SimpleNamespace(lr=1e-3, min_lr=1e-4, lr_warmup_iters=1, lr_decay_iters=None, train_iters=ITERS,
                           lr_decay_style="cosine", weight_decay=0.01)
GPT4 = GPT.model_copy(update={"name": "tiny-gpt-4", "num_layers": 4})

V1 = {"schema_version": 1, "model": GPT4.model_dump(), "micro_batch_size": 2, "global_batch_size": 4, "stages": [
    {"num_gpus": 2, "tp": 2, "dp": 1, "start_unit": 0, "end_unit": 3, "recompute": ["none", "full", "selective"]},
    {"num_gpus": 2, "tp": 1, "dp": 2, "start_unit": 3, "end_unit": 8, "recompute": ["none"] * 5}]}


def _vpp_sp(**features) -> dict:
    return {"model": GPT4.model_dump(), "micro_batch_size": 2, "global_batch_size": 4, **features, "stages": [
        {"num_gpus": 2, "tp": 2, "dp": 1, "sequence_parallel": True, "chunks": [
            {"start_unit": 0, "end_unit": 3, "recompute": ["selective", "none", "full"]},
            {"start_unit": 5, "end_unit": 6, "recompute": ["selective"]}]},
        {"num_gpus": 2, "tp": 1, "dp": 2, "chunks": [
            {"start_unit": 3, "end_unit": 5, "recompute": ["none", "full"]},
            {"start_unit": 6, "end_unit": 8, "recompute": ["none", "selective"]}]}]}


def _other(model) -> dict:
    return {"model": model.model_dump(), "micro_batch_size": 2, "global_batch_size": 4, "stages": [
        {"num_gpus": 2, "tp": 2, "dp": 1, "start_unit": 0, "end_unit": 4, "recompute": ["none"] * 4},
        {"num_gpus": 2, "tp": 1, "dp": 2, "start_unit": 4, "end_unit": model.num_units,
         "recompute": ["none"] * (model.num_units - 4)}]}


def run(rank: int, world_size: int, ckpt: str, out: str) -> None:
    from aceso_megatron.training import checkpoint
    from aceso_megatron.training.engine import build_runtime
    from aceso_megatron.training.train import build_scheduler

    batches = make_batches(GPT4, 2, 4 * ITERS, SEED)

    def fresh(raw):
        rt = build_runtime(raw, rank, world_size, seed=SEED, train_config=TC)
        return rt, build_scheduler(SCHEDULE, rt.optimizer)

    def steps(rt, scheduler, iterations) -> list[float]:
        return scheduled_steps(rt, scheduler, batches, iterations, 2)

    def refusal(raw) -> str:
        rt, sch = fresh(raw)
        try:
            checkpoint.load(ckpt, rt, sch)
        except AcesoError as e:
            return str(e)
        return "loaded"

    res = {}
    rt, sch = fresh(V1)
    steps(rt, sch, range(SAVE_AT))
    checkpoint.save(ckpt, SAVE_AT, rt, sch)
    res["v1"] = steps(rt, sch, range(SAVE_AT, ITERS))
    rt, sch = fresh(_vpp_sp())
    res["vpp_sp_loaded"] = checkpoint.load(ckpt, rt, sch)
    res["vpp_sp"] = steps(rt, sch, range(SAVE_AT, ITERS))
    dist_opt = _vpp_sp(distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True)
    rt, sch = fresh(dist_opt)
    steps(rt, sch, range(SAVE_AT))
    checkpoint.save(ckpt + "-dist-opt", SAVE_AT, rt, sch)
    res["vpp_sp_dist_opt"] = steps(rt, sch, range(SAVE_AT, ITERS))
    rt, sch = fresh({**V1, "distributed_optimizer": True})
    res["v1_dist_opt_loaded"] = checkpoint.load(ckpt + "-dist-opt", rt, sch)
    res["v1_dist_opt"] = steps(rt, sch, range(SAVE_AT, ITERS))
    rt, sch = fresh(dist_opt)   # the plain optimizer's checkpoint under the distributed one (optim_convert)
    res["other_optimizer_loaded"] = checkpoint.load(ckpt, rt, sch)
    res["other_optimizer"] = steps(rt, sch, range(SAVE_AT, ITERS))
    rt, sch = fresh(V1)   # the distributed optimizer's checkpoint, weights only, under a plan without it
    res["weights_only_loaded"] = checkpoint.load(ckpt + "-dist-opt", rt, sch, load_optim=False)
    res["weights_only"] = steps(rt, sch, range(SAVE_AT, ITERS))
    wider = GPT4.model_copy(update={"hidden_size": 64})
    res["wider"] = refusal(_other(wider))
    res["t5"] = refusal(_other(T5))
    dist.barrier()
    if rank == 0:  # a checkpoint written before checkpoints recorded their model
        for f in Path(ckpt).glob("iter_*/extra_rank_*.pt"):
            extra = torch.load(f, weights_only=False)
            extra.pop("model")
            torch.save(extra, f)
    dist.barrier()
    res["wider_unrecorded"] = refusal(_other(wider))
    if rank == 0:
        torch.save(res, out)


def test_v1_checkpoint_resumes_under_interleaved_sp_plans_and_other_models_are_refused(tmp_path):
    out = tmp_path / "res.pt"
    spawn(4, run, str(tmp_path / "ckpt"), str(out))
    res = torch.load(out)
    assert res["vpp_sp_loaded"] == res["v1_dist_opt_loaded"] == res["other_optimizer_loaded"] == (SAVE_AT, False)
    for name in ("vpp_sp", "vpp_sp_dist_opt", "v1_dist_opt", "other_optimizer"):  # the same model the same way
        for a, b in zip(res[name], res["v1"]):
            assert abs(a - b) <= 1e-5 * abs(b), (name, res[name], res["v1"])
    # weights only (--no-load-optim): the first step's loss is the weights' (its forward comes before any update)
    assert res["weights_only_loaded"] == (SAVE_AT, False)
    assert abs(res["weights_only"][0] - res["v1"][0]) <= 1e-5 * abs(res["v1"][0])
    assert res["wider"] == (f"--load {tmp_path / 'ckpt'}: iteration {SAVE_AT} holds another model than the plan's: "
                            "hidden_size is 32 in the checkpoint (model tiny-gpt-4) but 64 in the plan (model "
                            "tiny-gpt-4); resume it with a plan for its model, or save this run to a new folder")
    assert "family is 'gpt' in the checkpoint (model tiny-gpt-4) but 't5' in the plan (model tiny-t5)" in res["t5"]
    assert re.search(r"holds another model than the plan's: decoder\.layers\.0\.\S+ has shape \[(128, )?32\] in the "
                     r"checkpoint but \[(128, )?64\] in the plan", res["wider_unrecorded"]), res["wider_unrecorded"]
    for k in ("wider", "t5", "wider_unrecorded"):
        assert "\n" not in res[k]
