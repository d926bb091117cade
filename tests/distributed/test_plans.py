"""Plans of every kind on gloo (<= 4 ranks) against a single-process stock megatron-core GPTModel / T5Model.

For each plan: loss and every full-model gradient after one forward/backward equal the reference (fp32,
relative error <= 1e-5), and the losses of 3 optimizer steps with gradient clipping (active: the norm exceeds
the threshold) and the weights after them match. Distributed-optimizer plans: the gradients are the DP-reduced
shards put together. Plans of one world size share one spawned process group; ``compare`` is shared with
``test_modern_plans.py``.
"""

from __future__ import annotations

import pytest
import torch

from aceso_megatron.training.engine import TrainConfig
from aceso_megatron.testing import run_plans, spawn
from aceso_megatron.testing.reference import stock_run
from tests.tiny_models import GPT, LLAMA, T5

SEED = 11
STEPS = 3
TC = TrainConfig(lr=1e-3, clip_grad=0.3)
TOL = 1e-5
TOL_WEIGHTS = 1e-4  # after 3 Adam steps: Adam amplifies rounding in near-zero gradients (e.g. the key bias)

GPT_UNTIED = GPT.model_copy(update={"name": "tiny-gpt-untied", "tied_embeddings": False})
T5_UNTIED = T5.model_copy(update={"name": "tiny-t5-untied", "tied_embeddings": False})


def st(tp, dp, lo, hi, rc=None):
    return {"num_gpus": tp * dp, "tp": tp, "dp": dp, "start_unit": lo, "end_unit": hi,
            "recompute": rc or ["none"] * (hi - lo)}


def plan(model, *stages, mb=2, gbs=4, dist_opt=False):
    return {"model": model.model_dump(), "micro_batch_size": mb, "global_batch_size": gbs, "stages": list(stages),
            "distributed_optimizer": dist_opt}


PLANS = {
    2: {
        "gpt uneven, boundary attention|mlp": plan(GPT, st(1, 1, 0, 1), st(1, 1, 1, 4)),
        "gpt 2 stages, one micro-batch": plan(GPT, st(1, 1, 0, 3), st(1, 1, 3, 4), gbs=2),
        "llama tp2 one stage, selective": plan(LLAMA, st(2, 1, 0, 4, ["selective", "selective", "none", "full"])),
        "t5 boundary at encoder|decoder": plan(T5, st(1, 1, 0, 4), st(1, 1, 4, 10, ["selective"] * 3 + ["full"] * 3)),
    },
    3: {
        "gpt tp 2->1, mixed recompute": plan(GPT, st(2, 1, 0, 3, ["none", "full", "selective"]), st(1, 1, 3, 4)),
        "gpt dp 1->2": plan(GPT, st(1, 1, 0, 1, ["full"]), st(1, 2, 1, 4, ["selective", "none", "full"])),
        "gpt dp 2->1": plan(GPT, st(1, 2, 0, 3), st(1, 1, 3, 4, ["selective"])),
        "gpt tp 1->2": plan(GPT, st(1, 1, 0, 2), st(2, 1, 2, 4)),
        "gpt untied tp 2->1": plan(GPT_UNTIED, st(2, 1, 0, 2), st(1, 1, 2, 4, ["full", "selective"])),
        "llama tp 1->2, mixed recompute": plan(LLAMA, st(1, 1, 0, 3, ["full", "selective", "none"]),
                                               st(2, 1, 3, 4, ["selective"])),
        "t5 tp 2->1, boundary cross|mlp": plan(T5, st(2, 1, 0, 6, ["full", "selective"] * 3), st(1, 1, 6, 10)),
        "t5 untied dp 1->2, boundary in encoder": plan(T5_UNTIED, st(1, 1, 0, 3), st(1, 2, 3, 10)),
        "gpt dp 1->2, distributed optimizer": plan(GPT, st(1, 1, 0, 1), st(1, 2, 1, 4), dist_opt=True),
        "gpt tp 2->1, attn_dropout in both stages": plan(GPT, st(2, 1, 0, 2, ["attn_dropout", "full"]),
                                                         st(1, 1, 2, 4, ["attn_dropout", "selective"])),
    },
    4: {
        "gpt 3 stages tp 1|2|1": plan(GPT, st(1, 1, 0, 1), st(2, 1, 1, 3, ["selective", "full"]), st(1, 1, 3, 4)),
        "gpt 4 stages, 4 micro-batches": plan(GPT, st(1, 1, 0, 1), st(1, 1, 1, 2), st(1, 1, 2, 3),
                                              st(1, 1, 3, 4), mb=1, gbs=4),
        "gpt tied tp2 -> dp2": plan(GPT, st(2, 1, 0, 2), st(1, 2, 2, 4, ["full", "none"])),
        "gpt dp 1->3": plan(GPT, st(1, 1, 0, 2), st(1, 3, 2, 4, ["selective", "full"]), mb=3, gbs=6),
        "llama dp2 -> tp2": plan(LLAMA, st(1, 2, 0, 1), st(2, 1, 1, 4, ["none", "full", "selective"])),
        "t5 3 stages tp 1|2|1, decoder starts mid-stage": plan(
            T5, st(1, 1, 0, 2), st(2, 1, 2, 5, ["selective", "full", "none"]), st(1, 1, 5, 10)),
        "t5 untied dp2 -> tp2": plan(T5_UNTIED, st(1, 2, 0, 7, ["selective"] * 7), st(2, 1, 7, 10)),
        "t5 dp2 -> tp2, distributed optimizer": plan(T5, st(1, 2, 0, 5), st(2, 1, 5, 10), dist_opt=True),
        "t5 dp2 -> tp2, attn_dropout on self- and cross-attention": plan(
            T5, st(1, 2, 0, 5, ["attn_dropout", "none", "none", "full", "attn_dropout"]),
            st(2, 1, 5, 10, ["attn_dropout", "selective", "attn_dropout", "attn_dropout", "none"])),
    },
}


@pytest.fixture(scope="module")
def reference_process():
    from aceso_megatron.testing.reference import init_single_process
    from aceso_megatron.testing import free_port

    init_single_process(free_port())


def compare(names, raws, results, hybrid: bool = False) -> list[str]:
    """Failures of each plan's results against the single-process reference (``hybrid``: stock HybridModel)."""
    failures = []
    for name, raw, got in zip(names, raws, results):
        want = stock_run(raw, SEED, TC, STEPS, hybrid=hybrid)
        if not got["grad_norm"] > TC.clip_grad:
            failures.append(f"{name}: clipping inactive (norm {got['grad_norm']})")
        if set(got["params"]) != set(want["params"]):
            failures.append(f"{name}: parameter sets differ")
            continue
        for what in ("grads", "params"):
            for k, g in want[what].items():
                err = float((got[what][k] - g).norm() / g.norm().clamp_min(1e-30))
                if err > (TOL if what == "grads" else TOL_WEIGHTS):
                    failures.append(f"{name}: {what[:-1]} {k} rel err {err:.2e}")
        for i, (a, b) in enumerate(zip(got["losses"], want["losses"])):
            if abs(a - b) > TOL * abs(b):
                failures.append(f"{name}: loss of step {i + 1} {a} != {b}")
        failures += [f"{name}: {f}" for f in expert_bias_failures(got["expert_bias"], want["expert_bias"])]
    return failures


def expert_bias_failures(got: dict, want: dict) -> list[str]:
    """Each router's expert bias (moe_router_enable_expert_bias): every rank's copy equal to the stock model's (a
    sum of +-moe_router_bias_update_rate steps: exact)."""
    if set(got) != set(want):
        return [f"expert biases of {sorted(set(got) ^ set(want))} on one side only"]
    return [f"expert bias {k} copy {i}: {c.tolist()} != {want[k].tolist()}"
            for k, copies in got.items() for i, c in enumerate(copies) if not torch.equal(c, want[k])]


@pytest.mark.parametrize("world_size", sorted(PLANS))
def test_plans_match_single_process(world_size, tmp_path, reference_process):
    names, raws = zip(*PLANS[world_size].items())
    out = tmp_path / "results.pt"
    spawn(world_size, run_plans, list(raws), str(out), SEED, STEPS, TC)
    failures = compare(names, raws, torch.load(out))
    assert not failures, "\n".join(failures)
