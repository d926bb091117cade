"""A hybrid model's checkpoint (``tests.tiny_models.HYBRID``: Mamba-2, attention, MoE and MLP layers, megatron-core
0.19) saved under one plan resumes under another with the saving run's weights (bit for bit, every tensor by
canonical name) and the losses of the uninterrupted steps 3 and 4 (relative 1e-5).

Saved: one stage of 4 gloo ranks, SP tp2 x dp2 (Mamba's heads and groups, the attention heads and the experts split
over TP). Resumed under: the pattern cut ``M*E | M-E`` at tp1 x dp2 per stage (Mamba's packed ``in_proj`` and
``conv1d`` re-sharded part by part: a contiguous re-shard mixes their z / x / B / C / dt rows), and in one process,
the stock single-process layout (tp = dp = 1: each parameter under its stock ``HybridModel`` name and shape).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from aceso_megatron.testing import make_batches, scheduled_steps, spawn
from aceso_megatron.training.engine import TrainConfig
from patches.compat import have_hybrid
from tests.tiny_models import HYBRID as MODEL

pytestmark = pytest.mark.skipif(not have_hybrid(), reason="megatron-core without models.hybrid (before 0.19)")

SEED, ITERS, SAVE_AT = 5, 4, 2
TC = TrainConfig(lr=1e-3, clip_grad=0.3)
SCHEDULE = SimpleNamespace(lr=1e-3, min_lr=1e-4, lr_warmup_iters=1, lr_decay_iters=None, train_iters=ITERS,
                           lr_decay_style="cosine", weight_decay=0.01)
N = MODEL.num_units


def st(tp, dp, lo, hi):
    return {"num_gpus": tp * dp, "tp": tp, "dp": dp, "sequence_parallel": tp > 1, "start_unit": lo,
            "end_unit": hi, "recompute": ["none"] * (hi - lo)}


def plan(*stages):
    return {"model": MODEL.model_dump(), "micro_batch_size": 4, "global_batch_size": 8, "stages": list(stages),
            "moe": {"token_dispatcher": "allgather", "grouped_gemm": False, "permute_fusion": False}}


SAVED = plan(st(2, 2, 0, N))
RESUMED = {"SP tp2 x dp2 -> cut M*E | M-E, tp1 x dp2 each": plan(st(1, 2, 0, 3), st(1, 2, 3, N))}
SINGLE = plan(st(1, 1, 0, N))


def _fresh(raw, rank, world_size):
    from aceso_megatron.training.engine import build_runtime
    from aceso_megatron.training.train import build_scheduler

    rt = build_runtime(raw, rank, world_size, seed=SEED, train_config=TC)
    return rt, build_scheduler(SCHEDULE, rt.optimizer)


def _resume(rank, world_size, ckpt, raw) -> dict:
    from aceso_megatron.training import checkpoint

    rt, sch = _fresh(raw, rank, world_size)
    got = {"loaded": checkpoint.load(ckpt, rt, sch), "params": rt.full_params()}
    batches = make_batches(MODEL, 4, 8 * ITERS, SEED)
    got["losses"] = scheduled_steps(rt, sch, batches, range(SAVE_AT, ITERS), 2)
    return got


def run(rank: int, world_size: int, ckpt: str, out: str) -> None:
    from aceso_megatron.training import checkpoint

    res = {}
    if world_size > 1:
        batches = make_batches(MODEL, 4, 8 * ITERS, SEED)
        rt, sch = _fresh(SAVED, rank, world_size)
        scheduled_steps(rt, sch, batches, range(SAVE_AT), 2)
        checkpoint.save(ckpt, SAVE_AT, rt, sch)
        res["saved"] = {"params": rt.full_params()}
        res["saved"]["losses"] = scheduled_steps(rt, sch, batches, range(SAVE_AT, ITERS), 2)
        for name, raw in RESUMED.items():
            res[name] = _resume(rank, world_size, ckpt, raw)
    else:
        res["single"] = _resume(rank, world_size, ckpt, SINGLE)
    if rank == 0:
        torch.save(res, out)


def _mismatches(name, got, want) -> list[str]:
    bad = [] if got["loaded"] == (SAVE_AT, False) else [f"{name}: loaded {got['loaded']}"]
    if got["params"].keys() != want["params"].keys():
        return bad + [f"{name}: parameter names differ"]
    bad += [f"{name}: weight {k} differs" for k, v in want["params"].items() if not torch.equal(got["params"][k], v)]
    for i, (a, b) in enumerate(zip(got["losses"], want["losses"])):
        if abs(a - b) > 1e-5 * abs(b):
            bad.append(f"{name}: loss of step {SAVE_AT + i + 1} {a} != {b}")
    return bad


def test_hybrid_checkpoint_resumes_under_other_plans(tmp_path):
    ckpt, out = str(tmp_path / "ckpt"), tmp_path / "res.pt"
    spawn(4, run, ckpt, str(out))
    res = torch.load(out)
    spawn(1, run, ckpt, str(tmp_path / "single.pt"))
    res.update(torch.load(tmp_path / "single.pt"))
    want = res["saved"]
    assert any(k.endswith("mixer.in_proj.weight") for k in want["params"])
    failures = [f for name in [*RESUMED, "single"] for f in _mismatches(name, res[name], want)]
    assert not failures, "\n".join(failures)
