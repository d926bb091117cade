"""Dropout on (attention 0.1, hidden 0.1) on 3 gloo ranks, a TP-2 stage then a TP-1 stage with none /
attn_dropout / selective / full recompute: two runs with the same seed give the same losses, the losses differ
from the dropout-0 run's, and a run resumed from a checkpoint repeats the later steps bit for bit (the RNG
states, the rng tracker's included, travel in the checkpoint).

Dropout masks depend on the TP rank (megatron-core's tracker seeds the attention dropout per TP rank), so a
dropout run is compared with itself, not with the single-process reference.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from aceso_megatron.training.engine import TrainConfig
from aceso_megatron.testing import make_batches, scheduled_steps, spawn
from tests.tiny_models import GPT

SEED = 13
ITERS = 4
SAVE_AT = 2
TC = TrainConfig(lr=1e-3, clip_grad=1.0)
SCHEDULE = SimpleNamespace(lr=1e-3, min_lr=1e-4, lr_warmup_iters=1, lr_decay_iters=None, train_iters=ITERS,
                           lr_decay_style="cosine", weight_decay=0.01)
DROPOUT = GPT.model_copy(update={"attention_dropout": 0.1, "hidden_dropout": 0.1})


def plan(model) -> dict:
    return {"model": model.model_dump(), "micro_batch_size": 2, "global_batch_size": 4, "stages": [
        {"num_gpus": 2, "tp": 2, "dp": 1, "start_unit": 0, "end_unit": 2, "recompute": ["attn_dropout", "full"]},
        {"num_gpus": 1, "tp": 1, "dp": 1, "start_unit": 2, "end_unit": 4, "recompute": ["selective", "none"]}]}


def run_dropout(rank: int, world_size: int, out: str, ckpt: str) -> None:
    """Losses of: a dropout run saving at SAVE_AT, a second one, a dropout-0 one, and a resumed one."""
    from aceso_megatron.training import checkpoint
    from aceso_megatron.training.engine import build_runtime
    from aceso_megatron.training.train import build_scheduler

    batches = make_batches(GPT, 2, 4 * ITERS, SEED)

    def fresh(model):
        rt = build_runtime(plan(model), rank, world_size, seed=SEED, train_config=TC)
        return rt, build_scheduler(SCHEDULE, rt.optimizer)

    def steps(rt, scheduler, iterations) -> list[float]:
        return scheduled_steps(rt, scheduler, batches, iterations, 2)

    res = {}
    rt, sch = fresh(DROPOUT)
    res["first"] = steps(rt, sch, range(SAVE_AT))
    checkpoint.save(ckpt, SAVE_AT, rt, sch)
    res["first"] += steps(rt, sch, range(SAVE_AT, ITERS))
    res["second"] = steps(*fresh(DROPOUT), range(ITERS))
    res["no_dropout"] = steps(*fresh(GPT), range(ITERS))
    rt, sch = fresh(DROPOUT)
    assert checkpoint.load(ckpt, rt, sch) == (SAVE_AT, True)
    res["resumed"] = steps(rt, sch, range(SAVE_AT, ITERS))
    if rank == 0:
        torch.save(res, out)


def test_dropout_is_deterministic_and_resumes_exactly(tmp_path):
    out = tmp_path / "losses.pt"
    spawn(3, run_dropout, str(out), str(tmp_path / "ckpt"))
    res = torch.load(out)
    assert res["second"] == res["first"]
    assert res["resumed"] == res["first"][SAVE_AT:]
    for a, b in zip(res["first"], res["no_dropout"]):
        assert abs(a - b) > 1e-5 * abs(b), (a, b)  # 6e-5 to 8e-4 apart; plan rounding differences ~1e-7
