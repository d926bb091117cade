"""The loss normalised as stock megatron-core normalises it, in both of Megatron-LM's settings, with uneven loss
masks (each sample keeps its own number of tokens): gloo plans (3 ranks) against a single-process stock
``GPTModel`` trained by megatron-core's own schedule, ``finalize_model_grads`` and Megatron-LM's ``loss_func``
(``testing.reference``), whose micro-batch is a rank's (Megatron-LM's ``--micro-batch-size``).

- default (``calculate_per_token_loss`` off): each rank's micro-batch divided by its own token count and by the
  number of micro-batches, the MTP loss by its own (rolled) count, DDP averaging over DP: the runtime always
  divided by the global count, so an MTP plan's gradients differed by the MTP count's share (6.7% at seq 16) and
  any uneven mask gave other gradients;
- ``--calculate-per-token-loss``: everything divided by the global batch's token count (the MoE aux loss too, which
  the runtime did not divide at all: its gradient was the global token count times too large).

Plans: dense GPT with DP changing across the pipeline (1 -> 2 and 2 -> 1), two MTP layers on a DP-2 last stage,
a tied GPT with an MTP layer on a TP-2 last stage, an MoE model with an aux loss on three stages, and (megatron-core
0.17 on) that MoE model with 2 MTP depths running one shared layer on the last stage. Each: loss
and every gradient after one step (relative 1e-5), the losses of 2 clipped optimizer steps and the weights. The
reference's two settings differ by far more than the tolerance on every plan (the comparison can fail).
"""

from __future__ import annotations

import torch

from aceso_megatron.testing import run_plans, spawn
from aceso_megatron.testing.reference import stock_run
from aceso_megatron.training.engine import TrainConfig
from patches.compat import at_least
from search.layers.moe_spec import MoESpec
from tests.distributed.test_plans import reference_process  # noqa: F401 (fixture)
from tests.tiny_models import GPT, LLAMA

SEED, STEPS, TOL, TOL_WEIGHTS = 13, 2, 1e-5, 1e-4
DEFAULT = TrainConfig(lr=1e-3, clip_grad=0.3)
PER_TOKEN = TrainConfig(lr=1e-3, clip_grad=0.3, calculate_per_token_loss=True)
MTP_LLAMA = LLAMA.model_copy(update={"name": "tiny-llama-mtp", "mtp_num_layers": 2})
GPT_MTP = GPT.model_copy(update={"name": "tiny-gpt-mtp", "mtp_num_layers": 1, "position_embedding": "rope"})
AUX = LLAMA.model_copy(update={"name": "tiny-llama-moe-aux", "moe": MoESpec(
    num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, moe_aux_loss_coeff=0.01)})


def st(tp, dp, lo, hi):
    return {"num_gpus": tp * dp, "tp": tp, "dp": dp, "start_unit": lo, "end_unit": hi, "recompute": ["none"] * (hi - lo)}


def plan(model, *stages, mb=2, gbs=4):
    raw = {"model": model.model_dump(), "micro_batch_size": mb, "global_batch_size": gbs, "stages": list(stages)}
    if model.moe is not None:
        raw["moe"] = {"token_dispatcher": "alltoall", "grouped_gemm": False, "permute_fusion": False}
    return raw


PLANS = {
    "gpt dp 1 -> 2": plan(GPT, st(1, 1, 0, 1), st(1, 2, 1, 4)),
    "gpt dp 2 -> 1": plan(GPT, st(1, 2, 0, 3), st(1, 1, 3, 4)),
    "llama 2 MTP layers on a dp2 last stage": plan(MTP_LLAMA, st(1, 1, 0, 2), st(1, 2, 2, 6)),
    "gpt tied, MTP on a tp2 last stage": plan(GPT_MTP, st(1, 1, 0, 2), st(2, 1, 2, 5)),
    "llama MoE with aux loss, 3 stages": plan(AUX, st(1, 1, 0, 1), st(1, 1, 1, 3), st(1, 1, 3, 4)),
}
# one MTP layer run at both depths (mtp_use_repeated_layer, megatron-core 0.17 on), its MoE aux loss divided by the
# depths (stock router); DP stays 1: an aux loss balances the tokens of its micro-batch, so a stage of another DP
# (another micro-batch) balances other token sets than any one stock run does
if at_least("0.17"):
    PLANS["llama MoE aux loss, 2 depths of one shared MTP layer, 3 stages"] = plan(
        AUX.model_copy(update={"name": "tiny-llama-moe-shared-mtp", "mtp_num_layers": 2,
                               "mtp_use_repeated_layer": True}), st(1, 1, 0, 1), st(1, 1, 1, 3), st(1, 1, 3, 6))


def both(rank, world_size, raws, out_default, out_per_token, seed, steps) -> None:
    run_plans(rank, world_size, raws, out_default, seed, steps, DEFAULT, True)
    run_plans(rank, world_size, raws, out_per_token, seed, steps, PER_TOKEN, True)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def compare(tc, results) -> list[str]:
    failures = []
    for (name, raw), got in zip(PLANS.items(), results):
        want = stock_run(raw, SEED, tc, STEPS, loss_mask=True)
        for what, tol in (("grads", TOL), ("params", TOL_WEIGHTS)):
            for k, g in want[what].items():
                if (err := _rel(got[what][k], g)) > tol:
                    failures.append(f"{name}: {what[:-1]} {k} rel err {err:.2e}")
        for i, (a, b) in enumerate(zip(got["losses"], want["losses"])):
            if abs(a - b) > TOL * abs(b):
                failures.append(f"{name}: loss of step {i + 1} {a} != {b}")
    return failures


def test_both_normalisations_match_single_process_stock_megatron_core(tmp_path, reference_process):  # noqa: F811
    names, raws = zip(*PLANS.items())
    a, b = tmp_path / "default.pt", tmp_path / "per_token.pt"
    spawn(3, both, list(raws), str(a), str(b), SEED, STEPS)
    failures = [f"default: {f}" for f in compare(DEFAULT, torch.load(a))]
    failures += [f"per-token: {f}" for f in compare(PER_TOKEN, torch.load(b))]
    assert not failures, "\n".join(failures)
    for name, raw in zip(names, raws):       # the two settings are told apart on every plan
        d, p = (stock_run(raw, SEED, tc, STEPS, loss_mask=True)["grads"] for tc in (DEFAULT, PER_TOKEN))
        assert max(_rel(d[k], p[k]) for k in d) > 100 * TOL, name


def test_mtp_without_masks_differs_by_its_count_share(reference_process):  # noqa: F811
    """No loss mask: the main loss is the same either way, the MTP loss is not (megatron-core divides layer j's by
    its own count b (s - 1 - j) by default, by the main loss's b s per token): the 1/16 difference of seq 16, what
    the runtime's MTP gradients were off from the stock default by. megatron-core 0.19 weighs the per-token MTP
    loss by b s / b (s - 1 - j) (``compat.mtp_loss_scale``), so there the two settings agree."""
    from patches.compat import at_least

    raw = PLANS["gpt tied, MTP on a tp2 last stage"]
    d, p = (stock_run(raw, SEED, tc, STEPS)["grads"] for tc in (DEFAULT, PER_TOKEN))
    mtp_only = [k for k in d if k.startswith("mtp.layers.0.eh_proj")]
    want = 0.0 if at_least("0.19") else 1 / 16
    assert mtp_only and all(_rel(p[k], d[k]) == __import__("pytest").approx(want, rel=1e-3, abs=1e-6)
                            for k in mtp_only), [(k, _rel(p[k], d[k])) for k in mtp_only]
