"""Plans with the modern features on gloo (<= 4 ranks) against a single-process stock megatron-core model:
sequence parallelism (SP on every tp > 1 stage; SP -> no SP with tp 2 -> 1; no SP -> SP; SP with DP 2 -> 1;
T5 with SP across the encoder|decoder boundary), the distributed optimizer with overlapped gradient reduction
and parameter all-gather, gradient-reduction overlap with a tied embedding, and interleaved 1F1B (2 virtual
chunks per stage: identical and uneven spans, heterogeneous stages, mixed recompute, SP).

Each plan as in ``test_plans.py``: loss and every gradient after one step (fp32, relative <= 1e-5), the losses
of 3 clipped optimizer steps and the weights after them. Overlap plans also show the overlap happened: DDP buckets
whose reduction started during backward (small buckets: ``TrainConfig.ddp_bucket_size``), and the parameter
all-gather left for the next forward.
"""

from __future__ import annotations

import pytest
import torch

from aceso_megatron.testing import run_plans, spawn
from aceso_megatron.training.engine import TrainConfig
from tests.distributed.test_plans import SEED, STEPS, compare, reference_process  # noqa: F401 (fixture)
from tests.tiny_models import GPT, LLAMA, T5

TC = TrainConfig(lr=1e-3, clip_grad=0.3, ddp_bucket_size=2000)  # clip_grad as test_plans.TC; several buckets
GPT4 = GPT.model_copy(update={"name": "tiny-gpt-4", "num_layers": 4})  # 8 units: room for uneven chunks
LLAMA4 = LLAMA.model_copy(update={"name": "tiny-llama-4", "num_layers": 4})
OVERLAP = {"distributed_optimizer": True, "overlap_grad_reduce": True, "overlap_param_gather": True}


def st(tp, dp, lo, hi, rc=None, sp=False):
    return {"num_gpus": tp * dp, "tp": tp, "dp": dp, "sequence_parallel": sp, "start_unit": lo, "end_unit": hi,
            "recompute": rc or ["none"] * (hi - lo)}


def vst(tp, dp, *spans, sp=False):
    """An interleaved stage: spans ``(lo, hi)`` or ``(lo, hi, recompute)``."""
    return {"num_gpus": tp * dp, "tp": tp, "dp": dp, "sequence_parallel": sp, "chunks": [
        {"start_unit": s[0], "end_unit": s[1], "recompute": s[2] if len(s) > 2 else ["none"] * (s[1] - s[0])}
        for s in spans]}


def plan(model, *stages, mb=2, gbs=4, **features):
    return {"model": model.model_dump(), "micro_batch_size": mb, "global_batch_size": gbs, "stages": list(stages),
            **features}


PLANS = {
    2: {
        "gpt SP on the one tp2 stage, mixed recompute": plan(
            GPT, st(2, 1, 0, 4, ["attn_dropout", "selective", "full", "selective"], sp=True)),
        "gpt VPP 2, identical chunks": plan(GPT, vst(1, 1, (0, 1), (2, 3)), vst(1, 1, (1, 2), (3, 4))),
    },
    3: {
        "gpt SP tp2 -> no SP tp1": plan(GPT, st(2, 1, 0, 3, ["none", "full", "selective"], sp=True), st(1, 1, 3, 4)),
        "llama tp1 -> SP tp2": plan(LLAMA, st(1, 1, 0, 1), st(2, 1, 1, 4, ["selective", "none", "full"], sp=True)),
        "gpt dp 1 -> 2, distributed optimizer, both overlaps": plan(GPT4, st(1, 1, 0, 3), st(1, 2, 3, 8), **OVERLAP),
        "gpt VPP 2, uneven chunks, dp 1 | 2": plan(GPT4, vst(1, 1, (0, 3), (5, 6)), vst(1, 2, (3, 5), (6, 8))),
        "t5 SP tp2 -> tp1 inside the decoder": plan(
            T5, st(2, 1, 0, 6, ["full", "selective"] * 3, sp=True), st(1, 1, 6, 10)),
    },
    4: {
        "gpt dp2 -> SP tp2 (DP 2 -> 1)": plan(GPT, st(1, 2, 0, 2), st(2, 1, 2, 4, sp=True)),
        "llama VPP 2, uneven, mixed recompute, SP tp2 | dp2": plan(
            LLAMA4, vst(2, 1, (0, 1, ["full"]), (4, 7, ["attn_dropout", "selective", "full"]), sp=True),
            vst(1, 2, (1, 4, ["selective", "attn_dropout", "none"]), (7, 8, ["selective"]))),
        "t5 SP tp2 | SP tp2 at the decoder input, distributed optimizer, both overlaps": plan(
            T5, st(2, 1, 0, 4, ["selective", "full", "none", "selective"], sp=True), st(2, 1, 4, 10, sp=True),
            **OVERLAP),
        "gpt tied, gradient-reduction overlap, dp2 | dp2": plan(GPT4, st(1, 2, 0, 5), st(1, 2, 5, 8),
                                                                 overlap_grad_reduce=True),
        "gpt SP tp2 x dp2, one stage, distributed optimizer, both overlaps": plan(
            GPT4, st(2, 2, 0, 8, sp=True), **OVERLAP),
        "gpt VPP 2, SP tp2 | SP tp2, distributed optimizer, both overlaps": plan(
            GPT4, vst(2, 1, (0, 2), (4, 6), sp=True), vst(2, 1, (2, 4), (6, 8), sp=True), **OVERLAP),
    },
}


def test_enough_modern_plans():
    assert sum(len(p) for p in PLANS.values()) >= 12


def run_and_compare(world_size: int, plans: dict, tmp_path, hybrid: bool = False) -> list[str]:
    """Run ``plans`` on ``world_size`` gloo ranks; the failures against the single-process reference (``hybrid``:
    stock HybridModel) and of the overlaps they ask for."""
    names, raws = zip(*plans.items())
    out = tmp_path / "results.pt"
    spawn(world_size, run_plans, list(raws), str(out), SEED, STEPS, TC)
    results = torch.load(out)
    return compare(names, raws, results, hybrid) + overlap_failures(names, raws, results)


@pytest.mark.parametrize("world_size", sorted(PLANS))
def test_modern_plans_match_single_process(world_size, tmp_path, reference_process):  # noqa: F811
    failures = run_and_compare(world_size, PLANS[world_size], tmp_path)
    assert not failures, "\n".join(failures)


def overlap_failures(names, raws, results) -> list[str]:
    """Plans asking for an overlap that did not happen (``run_plans``' evidence)."""
    failures = []
    for name, raw, got in zip(names, raws, results):
        if raw.get("overlap_grad_reduce") and got["overlapped_buckets"] == 0:
            failures.append(f"{name}: no bucket reduction started during backward")
        if raw.get("overlap_param_gather") and not got["param_gather_deferred"]:
            failures.append(f"{name}: the parameter all-gather was not left for the next forward")
    return failures
