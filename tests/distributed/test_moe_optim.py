"""MoE with the distributed optimizer and with interleaved pipelining (VPP), on gloo (4 ranks), against the
single-process stock megatron-core ``GPTModel`` of ``test_moe_plans.py`` (same MoE spec and config, EP 1).

Each plan as in ``test_plans.py``: loss and every gradient after one step (fp32, relative <= 1e-5; the
distributed optimizer's gradients are the DP-reduced shards put together, experts by their global index), the
losses of 3 clipped optimizer steps and the weights after them. Plans:

- the distributed optimizer with both overlaps (``overlap_grad_reduce``, ``overlap_param_gather``), EP 2 over
  attention DP 4: the expert states shard over expert-DP 2, the rest over DP 4 (megatron-core's
  ``get_megatron_optimizer`` builds a second ``DistributedOptimizer`` on DDP's expert buffers and the stage's
  ``expt_dp`` group); the run must show that reductions started during backward and that the parameter
  all-gather was left for the next forward;
- VPP 2 with MoE layers in every chunk (two stages, two chunks each, EP 2 with expert-DP 1 on stage 0, EP 1
  with expert-DP 2 on stage 1), and the same with the distributed optimizer and both overlaps.

Routing is deterministic for the reason ``test_moe_plans.test_routing_margin`` measures.
"""

from __future__ import annotations

import torch

from aceso_megatron.testing import run_plans, spawn
from aceso_megatron.training.engine import TrainConfig
from tests.distributed.test_modern_plans import overlap_failures
from tests.distributed.test_moe_plans import MOE
from tests.distributed.test_plans import SEED, STEPS, compare, reference_process  # noqa: F401 (fixture)
from tests.tiny_models import LLAMA

TC = TrainConfig(lr=1e-3, clip_grad=0.3, ddp_bucket_size=2000)   # clip_grad as test_plans.TC; several buckets
LLAMA4_MOE = LLAMA.model_copy(update={"name": "tiny-llama-moe-4", "num_layers": 4, "moe": MOE})
OVERLAP = {"distributed_optimizer": True, "overlap_grad_reduce": True, "overlap_param_gather": True}


def st(dp, lo, hi, ep=1):
    return {"num_gpus": dp, "tp": 1, "dp": dp, "ep": ep, "start_unit": lo, "end_unit": hi,
            "recompute": ["none"] * (hi - lo)}


def vst(dp, *spans, ep=1):
    """An interleaved stage of ``dp`` ranks: chunks spanning units ``(lo, hi)``."""
    return {"num_gpus": dp, "tp": 1, "dp": dp, "ep": ep, "chunks": [
        {"start_unit": lo, "end_unit": hi, "recompute": ["none"] * (hi - lo)} for lo, hi in spans]}


def plan(*stages, mb=2, gbs=4, **features):
    return {"model": LLAMA4_MOE.model_dump(), "micro_batch_size": mb, "global_batch_size": gbs,
            "stages": list(stages), **features,
            "moe": {"token_dispatcher": "alltoall", "grouped_gemm": False, "permute_fusion": False}}


PLANS = {
    "dp4, EP 2 (expert-DP 2), distributed optimizer, both overlaps": plan(st(4, 0, 8, ep=2), mb=4, gbs=8,
                                                                         **OVERLAP),
    "VPP 2, MoE layers in every chunk, EP 2 | EP 1": plan(vst(2, (0, 2), (4, 6), ep=2), vst(2, (2, 4), (6, 8))),
    "VPP 2, MoE chunks, EP 2 | EP 1, distributed optimizer, both overlaps": plan(
        vst(2, (0, 2), (4, 6), ep=2), vst(2, (2, 4), (6, 8)), **OVERLAP),
}


def test_moe_optim_plans_match_single_process(tmp_path, reference_process):  # noqa: F811
    names, raws = zip(*PLANS.items())
    out = tmp_path / "results.pt"
    spawn(4, run_plans, list(raws), str(out), SEED, STEPS, TC)
    results = torch.load(out)
    failures = compare(names, raws, results) + overlap_failures(names, raws, results)
    assert not failures, "\n".join(failures)
