"""Aux-loss-free routing (``moe_router_enable_expert_bias`` with a sigmoid router: DeepSeek-V3, Nemotron-3) on
heterogeneous plans against single-process stock megatron-core.

At the end of every global batch megatron-core's ``finalize_model_grads`` moves each router's expert bias by
``moe_router_bias_update_rate`` towards balance, from the tokens its experts got, all-reduced over the global
TP x DP x CP group; the runtime does it over each stage's own TP x DP x CP group (``grads.finish_router_batch``).
Each plan as in ``test_plans.py`` (loss and gradients of step 1, losses of 3 clipped steps, weights after them) and
every rank's copy of every expert bias after the 3 steps equal to the stock model's (exactly: sums of +-rate). The
stages route different token shares (a tp 2 + SP stage: each TP rank its half of the sequence; a dp 2 stage: each
replica its samples). The control counts the tokens over the stage's DP group only and must fail on the biases.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.distributed as dist

from aceso_megatron.testing import run_plans, spawn
from patches.compat import have_hybrid
from tests.distributed.test_modern_plans import plan as hybrid_plan
from tests.distributed.test_modern_plans import st as hybrid_st
from tests.distributed.test_moe_plans import MOE, plan, st
from tests.distributed.test_plans import SEED, STEPS, TC, compare, expert_bias_failures, reference_process  # noqa: F401
from tests.tiny_models import HYBRID, LLAMA

BIAS = {"moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True}
LLAMA_BIAS = LLAMA.model_copy(update={"name": "tiny-llama-moe-bias", "num_layers": 4,
                                      "moe": MOE.model_copy(update=BIAS)})
HYBRID_BIAS = HYBRID.model_copy(update={"name": "tiny-hybrid-bias", "moe": HYBRID.moe.model_copy(update=BIAS)})

PLANS = {
    "llama tp2 + SP (experts ep2 etp1) | dp2 (ep2), 2 MoE layers a stage": plan(
        LLAMA_BIAS, st(2, 1, 0, 4, ep=2, etp=1, sp=True), st(1, 2, 4, 8, ep=2)),
}
# HYBRID is M*EM-E: its MoE layers on both sides of the cut; experts at etp 1, unfused as on CPU
HYBRID_PLANS = {
    "hybrid cut M*EM | -E, SP tp2 | tp1 dp2": hybrid_plan(
        HYBRID_BIAS, {**hybrid_st(2, 1, 0, 4, ["none", "full", "none", "full"], sp=True), "etp": 1},
        hybrid_st(1, 2, 4, 6, ["selective", "none"]),
        moe={"token_dispatcher": "alltoall", "grouped_gemm": False, "permute_fusion": False}),
}
CONTROL = next(iter(PLANS.values()))


def _over_dp(runtime, model_chunks) -> None:
    """The wrong group: the tokens counted over the stage's DP group, not its TP x DP x CP group."""
    from megatron.core.distributed.finalize_model_grads import reset_model_temporary_tensors

    from patches.compat import update_router_expert_bias

    update_router_expert_bias(model_chunks, model_chunks[0].config, runtime.groups.dp)
    reset_model_temporary_tensors(model_chunks[0].config, model_chunks)


def plans_then_control(rank, world_size, raws, out, control_out, seed, steps, tc) -> None:
    from aceso_megatron.parallel import grads

    run_plans(rank, world_size, raws, out, seed, steps, tc)
    with mock.patch.object(grads, "finish_router_batch", _over_dp):
        run_plans(rank, world_size, [CONTROL], control_out, seed, steps, tc)
    dist.barrier()


def test_expert_bias_plans_match_single_process(tmp_path, reference_process):  # noqa: F811
    names, raws = zip(*PLANS.items())
    out, control = tmp_path / "results.pt", tmp_path / "control.pt"
    spawn(4, plans_then_control, list(raws), str(out), str(control), SEED, STEPS, TC)
    results = torch.load(out)
    assert all(len(r["expert_bias"]) == 4 for r in results), "a router's bias is missing"
    failures = compare(names, raws, results)
    assert not failures, "\n".join(failures)
    assert _moved(raws[0]), "the stock model's expert biases did not move: nothing compared"
    wrong = compare(["control"], [CONTROL], torch.load(control))
    assert any(" expert bias " in f for f in wrong), wrong


@pytest.mark.skipif(not have_hybrid(), reason="megatron-core without models.hybrid (before 0.19)")
def test_expert_bias_hybrid_plans_match_stock_hybrid_model(tmp_path, reference_process):  # noqa: F811
    names, raws = zip(*HYBRID_PLANS.items())
    out = tmp_path / "results.pt"
    spawn(4, run_plans, list(raws), str(out), SEED, STEPS, TC)
    results = torch.load(out)
    assert all(len(r["expert_bias"]) == 2 for r in results), "a router's bias is missing"
    failures = compare(names, raws, results, hybrid=True)
    assert not failures, "\n".join(failures)
    assert _moved(raws[0], hybrid=True), "the stock model's expert biases did not move: nothing compared"


def _moved(raw, hybrid: bool = False) -> bool:
    from aceso_megatron.testing.reference import stock_run

    return all(bool(b.abs().sum() > 0) for b in stock_run(raw, SEED, TC, STEPS, hybrid=hybrid)["expert_bias"].values())


# checkpoints: the routers' expert biases are saved (megatron-core's router saves them with its weight) and resume
# under another plan; a run that lost them would route by zero biases after the resume
CKPT_SAVED = {**plan(LLAMA_BIAS, st(2, 1, 0, 4, ep=2, etp=1, sp=True), st(1, 2, 4, 8, ep=2), mb=4, gbs=8),
              "distributed_optimizer": True}
CKPT_RESUMED = plan(LLAMA_BIAS, st(1, 4, 0, 8, ep=2), mb=4, gbs=8)


def save_and_resume_biases(rank: int, world_size: int, ckpt: str, out: str) -> None:
    """Train ``CKPT_SAVED`` ``SAVE_AT`` steps, save, train on; resume under ``CKPT_RESUMED``, train as far: every
    rank's expert biases at the save / after the load and at the end, and the losses after the save."""
    from aceso_megatron.parallel.gather import all_expert_biases
    from aceso_megatron.testing import make_batches, scheduled_steps
    from aceso_megatron.training import checkpoint
    from tests.distributed.test_moe_checkpoint import ITERS, SAVE_AT, SEED as CKPT_SEED, _fresh

    batches = make_batches(LLAMA_BIAS, 4, 8 * ITERS, CKPT_SEED)
    res = {}
    for name, raw in (("saved", CKPT_SAVED), ("resumed", CKPT_RESUMED)):
        rt, sch = _fresh(raw, rank, world_size)
        if name == "saved":
            scheduled_steps(rt, sch, batches, range(SAVE_AT), 2)
            checkpoint.save(ckpt, SAVE_AT, rt, sch)
        else:
            checkpoint.load(ckpt, rt, sch)
        at_save = all_expert_biases(rt)
        losses = scheduled_steps(rt, sch, batches, range(SAVE_AT, ITERS), 2)
        res[name] = {"at_save": at_save, "losses": losses, "end": all_expert_biases(rt)}
    if rank == 0:
        torch.save(res, out)


def test_expert_biases_checkpoint_and_resume_under_another_plan(tmp_path):
    out = tmp_path / "res.pt"
    spawn(4, save_and_resume_biases, str(tmp_path / "ckpt"), str(out))
    res = torch.load(out)
    saved, resumed = res["saved"], res["resumed"]
    assert len(saved["at_save"]) == 4 and all(bool(c[0].abs().sum() > 0) for c in saved["at_save"].values())
    failures = [f"{when}: {f}" for when in ("at_save", "end")
                for f in expert_bias_failures(resumed[when], {k: c[0] for k, c in saved[when].items()})]
    failures += [f"loss {a} != {b}" for a, b in zip(resumed["losses"], saved["losses"]) if abs(a - b) > 1e-5 * abs(b)]
    assert not failures, "\n".join(failures)
