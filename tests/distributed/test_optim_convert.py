"""Adam's state across optimizer kinds on 2 gloo ranks: a checkpoint of the distributed optimizer (TP 1 | DP 2)
resumes under the plain optimizer (TP 2 | DP 1) and one of the plain optimizer under the distributed one. The
loaded exp_avg, exp_avg_sq, fp32 master weights and step count equal, bit for bit, those of the run that saved
(read from its live optimizer and put together over DP and TP, not from the checkpoint), and the resumed steps 3
and 4 have the saving run's losses; step 4's update is the first that reads the moments. The control:
``--no-load-optim`` (the moments from zero) misses step 4's loss by far more than the tolerance."""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.distributed as dist

from aceso_megatron.model.init import gather_full
from aceso_megatron.testing import make_batches, scheduled_steps, spawn
from aceso_megatron.training.engine import TrainConfig
from tests.tiny_models import GPT

SEED, ITERS, SAVE_AT = 7, 4, 2
TC = TrainConfig(lr=1e-2, clip_grad=1.0)
SCHEDULE = SimpleNamespace(lr=1e-2, min_lr=1e-3, lr_warmup_iters=1, lr_decay_iters=None, train_iters=ITERS,
                           lr_decay_style="cosine", weight_decay=0.01)
KEYS = ("exp_avg", "exp_avg_sq", "param")
TOL = 1e-6   # relative: another TP/DP layout sums in another order (measured 2.5e-8)


def _plan(tp: int, dp: int, dist_opt: bool) -> dict:
    n = GPT.num_units
    return {"model": GPT.model_dump(), "micro_batch_size": 2, "global_batch_size": 4,
            "distributed_optimizer": dist_opt,
            "stages": [{"num_gpus": 2, "tp": tp, "dp": dp, "start_unit": 0, "end_unit": n, "recompute": ["none"] * n}]}


DIST, PLAIN = _plan(1, 2, True), _plan(2, 1, False)


def _local_state(rt) -> tuple[dict[str, dict], set[float]]:
    """Per state key: local parameter name -> this TP rank's full shard of it; and the step counts seen."""
    params = dict(rt.named_parameters())
    by_id = {id(p): n for n, p in params.items()}
    out = {k: {} for k in KEYS}
    steps: set[float] = set()
    for opt in getattr(rt.optimizer, "chained_optimizers", [rt.optimizer]):
        if rt.plan.distributed_optimizer:  # each DP rank holds a flat range of every parameter: sum them over DP
            flat = {n: {k: torch.zeros(p.numel()) for k in KEYS} for n, p in params.items()}
            for maps in opt.gbuf_ranges:
                for per_bucket in maps.values():
                    for bucket in per_bucket:
                        for p, ranges in bucket["param_map"].items():
                            r, mine = ranges["param"], opt._get_main_param_and_optimizer_states(p)
                            steps.add(float(mine["step"]))
                            for k in KEYS:
                                flat[by_id[id(p)]][k][r.start:r.end] = mine[k]
            for n, p in params.items():
                for k in KEYS:
                    dist.all_reduce(flat[n][k], group=opt.data_parallel_group)
                    out[k][n] = flat[n][k].view(p.shape)
        else:
            mains = {id(m): f for g16, g32 in zip(getattr(opt, "float16_groups", []),
                                                  getattr(opt, "fp32_from_float16_groups", [])) for m, f in zip(g16, g32)}
            for n, p in params.items():
                main = mains.get(id(p), p)
                state = opt.optimizer.state[main]
                steps.add(float(state["step"]))
                out["exp_avg"][n], out["exp_avg_sq"][n], out["param"][n] = state["exp_avg"], state["exp_avg_sq"], main
    return out, steps


def full_optimizer_state(rt) -> dict:
    """{state key: {canonical name: full tensor}, "step": [the step counts of every rank]} (collective)."""
    local, steps = _local_state(rt)
    params, names = dict(rt.named_parameters()), rt.canonical_names()
    full = {k: gather_full(v, params, names, rt.plan.model, rt.groups.tp) for k, v in local.items()}
    lay = rt.layout
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, ({k: {n: t.cpu() for n, t in v.items()} for k, v in full.items()}
                                   if lay.tp_rank == lay.dp_rank == 0 else None, sorted(steps)))
    out = next(p for p, _ in parts if p is not None)
    out["step"] = sorted({s for _, ss in parts for s in ss})
    return out


def run(rank: int, world_size: int, root: str, out: str) -> None:
    from aceso_megatron.training import checkpoint
    from aceso_megatron.training.engine import build_runtime
    from aceso_megatron.training.train import build_scheduler

    batches = make_batches(GPT, 2, 4 * ITERS, SEED)

    def fresh(raw):
        rt = build_runtime(raw, rank, world_size, seed=SEED, train_config=TC)
        return rt, build_scheduler(SCHEDULE, rt.optimizer)

    res = {}
    for name, plan in (("dist", DIST), ("plain", PLAIN)):   # the uninterrupted runs, saved after step 2
        rt, sch = fresh(plan)
        scheduled_steps(rt, sch, batches, range(SAVE_AT), 2)
        res[f"{name}_state"] = full_optimizer_state(rt)
        checkpoint.save(f"{root}/{name}", SAVE_AT, rt, sch)
        res[f"{name}_losses"] = scheduled_steps(rt, sch, batches, range(SAVE_AT, ITERS), 2)
    for name, saved, plan, load_optim in (("dist_to_plain", "dist", PLAIN, True), ("plain_to_dist", "plain", DIST, True),
                                          ("zeroed", "dist", PLAIN, False)):
        rt, sch = fresh(plan)
        res[f"{name}_loaded"] = checkpoint.load(f"{root}/{saved}", rt, sch, load_optim=load_optim)
        if load_optim:
            res[f"{name}_state"] = full_optimizer_state(rt)
        res[f"{name}_losses"] = scheduled_steps(rt, sch, batches, range(SAVE_AT, ITERS), 2)
    if rank == 0:
        torch.save(res, out)


def test_adam_state_converts_between_the_distributed_and_the_plain_optimizer(tmp_path):
    out = tmp_path / "res.pt"
    spawn(2, run, str(tmp_path / "ckpt"), str(out))
    res = torch.load(out)
    for name, saved in (("dist_to_plain", "dist"), ("plain_to_dist", "plain")):
        assert res[f"{name}_loaded"] == (SAVE_AT, False)
        want, got = res[f"{saved}_state"], res[f"{name}_state"]
        assert want["step"] == got["step"] == [float(SAVE_AT)], (name, want["step"], got["step"])
        for k in KEYS:
            assert want[k].keys() == got[k].keys()
            for n in want[k]:
                assert torch.equal(want[k][n], got[k][n]), (name, k, n)
        assert max(float(want["exp_avg"][n].abs().max()) for n in want["exp_avg"]) > 0   # Adam has moments
        for a, b in zip(res[f"{name}_losses"], res[f"{saved}_losses"]):   # steps 3 and 4 as uninterrupted
            assert abs(a - b) <= TOL * abs(b), (name, res[f"{name}_losses"], res[f"{saved}_losses"])
    # the control: moments from zero (--no-load-optim) change step 3's update, hence step 4's loss (measured: by
    # 9.4e-4 relative, 900 times the tolerance); step 3's loss, before any update, is the weights' alone
    (z3, z4), (r3, r4) = res["zeroed_losses"], res["dist_losses"]
    assert abs(z3 - r3) <= TOL * abs(r3)
    assert abs(z4 - r4) > 100 * TOL * abs(r4), (z4, r4)
