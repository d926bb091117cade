"""Checkpoints across expert shapes: an MoE run saved under one plan resumes under another with the saving run's
weights (bit for bit, every tensor by canonical name), the distributed optimizer's Adam state where both plans use
it, and the losses of the uninterrupted steps 3 and 4 (relative 1e-5).

Saved: one stage of 4 gloo ranks, tp1 x dp4, experts ep2 (expert-DP 2), the distributed optimizer with both
overlaps. Resumed under: EP 1 (expert-DP 4); EP 2 on stage 0 and EP 1 on stage 1 (the plain optimizer: Adam's
state converted); attention tp2 + SP x dp2 with experts etp2 x ep2 (ETP 1 -> 2, expert-DP 1); and in one process,
the stock single-process layout (tp = dp = ep = 1: each parameter under its stock ``GPTModel`` name and shape).

Each routed expert is saved under its global name (``decoder.layers.L.mlp.experts.local_experts.E.*``, E the stock
model's index), written by expert-DP replica 0 of the EP rank holding it, its expert-TP shards by offset; so
dist_checkpointing re-shards EP by key and ETP by offset, and the optimizer's per-parameter state follows.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from aceso_megatron.testing import make_batches, scheduled_steps, spawn
from aceso_megatron.training.engine import TrainConfig
from tests.distributed.test_moe_plans import DENSE_FIRST, MOE
from tests.tiny_models import LLAMA

SEED, ITERS, SAVE_AT = 5, 4, 2
TC = TrainConfig(lr=1e-3, clip_grad=0.3)
SCHEDULE = SimpleNamespace(lr=1e-3, min_lr=1e-4, lr_warmup_iters=1, lr_decay_iters=None, train_iters=ITERS,
                           lr_decay_style="cosine", weight_decay=0.01)
MODEL = LLAMA.model_copy(update={"name": "tiny-llama-moe", "moe": MOE})
N = MODEL.num_units
OVERLAP = {"distributed_optimizer": True, "overlap_grad_reduce": True, "overlap_param_gather": True}


def st(tp, dp, lo, hi, ep=1, etp=None):
    return {"num_gpus": tp * dp, "tp": tp, "dp": dp, "ep": ep, "etp": etp, "sequence_parallel": tp > 1,
            "start_unit": lo, "end_unit": hi, "recompute": ["none"] * (hi - lo)}


def plan(*stages, **features):
    return {"model": MODEL.model_dump(), "micro_batch_size": 4, "global_batch_size": 8, "stages": list(stages),
            **features, "moe": {"token_dispatcher": "allgather", "grouped_gemm": False, "permute_fusion": False}}


SAVED = plan(st(1, 4, 0, N, ep=2), **OVERLAP)
RESUMED = {
    "EP 2 -> EP 1 (expert-DP 2 -> 4)": plan(st(1, 4, 0, N), **OVERLAP),
    "EP 2 -> EP 2 | EP 1 per stage, plain optimizer": plan(st(1, 2, 0, 2, ep=2), st(1, 2, 2, N)),
    "ETP 1 -> 2 (tp2 + SP x dp2, etp2 x ep2)": plan(st(2, 2, 0, N, ep=2, etp=2), **OVERLAP),
}
SINGLE = plan(st(1, 1, 0, N))   # the stock single-process layout


def _fresh(raw, rank, world_size):
    from aceso_megatron.training.engine import build_runtime
    from aceso_megatron.training.train import build_scheduler

    rt = build_runtime(raw, rank, world_size, seed=SEED, train_config=TC)
    return rt, build_scheduler(SCHEDULE, rt.optimizer)


def _resume(rank, world_size, ckpt, raw) -> dict:
    from aceso_megatron.parallel.gather import full_optimizer_state
    from aceso_megatron.training import checkpoint

    rt, sch = _fresh(raw, rank, world_size)
    got = {"loaded": checkpoint.load(ckpt, rt, sch), "params": rt.full_params()}
    if rt.plan.distributed_optimizer:
        got["state"] = full_optimizer_state(rt)
    batches = make_batches(rt.plan.model, 4, 8 * ITERS, SEED)
    got["losses"] = scheduled_steps(rt, sch, batches, range(SAVE_AT, ITERS), 2)
    return got


def run(rank: int, world_size: int, ckpt: str, out: str, saved: dict = SAVED, resumed: dict = RESUMED,
        single: dict = SINGLE) -> None:
    """Train ``saved`` (world size > 1), save at step ``SAVE_AT`` and resume under each of ``resumed``; in one
    process resume under ``single``. Rank 0 writes what each run holds to ``out``."""
    from aceso_megatron.parallel.gather import full_optimizer_state
    from aceso_megatron.training import checkpoint

    res = {}
    if world_size > 1:
        rt, sch = _fresh(saved, rank, world_size)
        batches = make_batches(rt.plan.model, 4, 8 * ITERS, SEED)
        scheduled_steps(rt, sch, batches, range(SAVE_AT), 2)
        checkpoint.save(ckpt, SAVE_AT, rt, sch)
        res["saved"] = {"params": rt.full_params()}
        if rt.plan.distributed_optimizer:
            res["saved"]["state"] = full_optimizer_state(rt)
        res["saved"]["losses"] = scheduled_steps(rt, sch, batches, range(SAVE_AT, ITERS), 2)
        for name, raw in resumed.items():
            res[name] = _resume(rank, world_size, ckpt, raw)
    else:
        res["single"] = _resume(rank, world_size, ckpt, single)
    if rank == 0:
        torch.save(res, out)


def _mismatches(name, got, want) -> list[str]:
    bad = [] if got["loaded"] == (SAVE_AT, False) else [f"{name}: loaded {got['loaded']}"]
    if got["params"].keys() != want["params"].keys():
        return bad + [f"{name}: parameter names differ"]
    bad += [f"{name}: weight {k} differs" for k, v in want["params"].items() if not torch.equal(got["params"][k], v)]
    for k in ("exp_avg", "exp_avg_sq") if "state" in got else ():
        bad += [f"{name}: {k} {n} differs" for n, v in want["state"][k].items() if not torch.equal(got["state"][k][n], v)]
    for i, (a, b) in enumerate(zip(got["losses"], want["losses"])):
        if abs(a - b) > 1e-5 * abs(b):
            bad.append(f"{name}: loss of step {SAVE_AT + i + 1} {a} != {b}")
    return bad


def save_and_resume(tmp_path, saved: dict, resumed: dict, single: dict) -> dict:
    """``run`` on 4 gloo ranks, then in one process: what each run holds, by name ("saved", "single", ``resumed``'s)."""
    ckpt, out = str(tmp_path / "ckpt"), tmp_path / "res.pt"
    spawn(4, run, ckpt, str(out), saved, resumed, single)
    res = torch.load(out)
    spawn(1, run, ckpt, str(tmp_path / "single.pt"), saved, resumed, single)
    res.update(torch.load(tmp_path / "single.pt"))
    return res


def test_moe_checkpoints_resume_across_expert_shapes(tmp_path):
    res = save_and_resume(tmp_path, SAVED, RESUMED, SINGLE)
    want = res["saved"]
    assert any(".mlp.experts.local_experts.3." in k for k in want["params"])   # all 4 experts, global names
    assert max(float(v.abs().max()) for k, v in want["state"]["exp_avg"].items() if ".experts." in k) > 0
    failures = [f for name in [*RESUMED, "single"] for f in _mismatches(name, res[name], want)]
    assert not failures, "\n".join(failures)


# a stage of dense layers only (DeepSeek-V3's first layers on stage 0): megatron-core still builds it an expert
# optimizer, with no parameter (patches/dist_opt_torch_adam.py, item 3)
DENSE_FIRST_SAVED = {**plan(st(1, 1, 0, 2), st(1, 1, 2, 6), distributed_optimizer=True),
                     "model": DENSE_FIRST.model_dump()}
DENSE_FIRST_RESUMED = {**plan(st(1, 1, 0, 4), st(1, 1, 4, 6), distributed_optimizer=True),
                       "model": DENSE_FIRST.model_dump()}


def run_dense_first(rank: int, world_size: int, ckpt: str, out: str) -> None:
    from aceso_megatron.training import checkpoint

    batches = make_batches(DENSE_FIRST, 4, 8 * ITERS, SEED)
    rt, sch = _fresh(DENSE_FIRST_SAVED, rank, world_size)
    scheduled_steps(rt, sch, batches, range(SAVE_AT), 2)
    checkpoint.save(ckpt, SAVE_AT, rt, sch)
    res = {"saved": {"params": rt.full_params(), "losses": scheduled_steps(rt, sch, batches, range(SAVE_AT, ITERS), 2)}}
    for name, raw in (("same plan", DENSE_FIRST_SAVED), ("dense layer moved beside the MoE layers", DENSE_FIRST_RESUMED)):
        rt, sch = _fresh(raw, rank, world_size)
        got = {"loaded": checkpoint.load(ckpt, rt, sch), "params": rt.full_params()}
        got["losses"] = scheduled_steps(rt, sch, batches, range(SAVE_AT, ITERS), 2)
        res[name] = got
    if rank == 0:
        torch.save(res, out)


def test_dense_only_stage_of_an_moe_model_checkpoints_and_resumes(tmp_path):
    """Stage 0 holds the dense first layer only, stage 1 the MoE layers (distributed optimizer): the checkpoint is
    written (megatron-core's empty expert optimizer on stage 0 has no step to read), resumes under the same plan
    exactly and under a split that puts the dense layer beside MoE layers with the saving run's weights and losses."""
    ckpt, out = str(tmp_path / "ckpt"), tmp_path / "res.pt"
    spawn(2, run_dense_first, ckpt, str(out))
    res = torch.load(out)
    want = res["saved"]
    assert res["same plan"]["loaded"] == (SAVE_AT, True)
    failures = [f for name in ("same plan", "dense layer moved beside the MoE layers")
                for f in _mismatches(name, {**res[name], "loaded": (SAVE_AT, False)}, want)]
    assert not failures, "\n".join(failures)
