"""Plans with a model chunk that holds no transformer layer, only the embedding or only the loss (megatron-core's
``--pipeline-model-parallel-layout`` ``E|...`` / ``...|L``), on gloo against a single-process stock megatron-core
``GPTModel``.

As in ``test_plans.py``: loss and every gradient after one step (fp32, relative <= 1e-5), the losses of 3 clipped
optimizer steps and the weights after them. The plans: interleaved (2 stages x 2 chunks) with the embedding alone
on model chunk 0 and the loss alone on model chunk 3 (``E|t*2|t*2|L``; tied embeddings, so the loss chunk's output
layer is the embedding weight synchronised across the end stages), the same untied with only the loss alone
(``Et|t|t*2|L``, Llama), and one chunk per stage with the embedding alone on stage 0 (``E|t*4L``); with MoE
(``test_moe_plans.py``'s tiny Llama MoE, ``E|t|t|L``) and the DeepSeek-like MLA + MoE + MTP model of
``test_moe_mla_mtp.py`` (``E|t*3mL``: the embedding alone on stage 0; the runtime runs MTP without interleaving).
Routing is deterministic there as those files' ``test_routing_margin`` measure for the same models and seed.
"""

from __future__ import annotations

import torch

from aceso_megatron.testing import run_plans, spawn
from search.spec.plan import parse_plan
from tests.distributed.test_modern_plans import GPT4, LLAMA4, TC, plan
from tests.distributed.test_moe_mla_mtp import DEEPSEEK
from tests.distributed.test_moe_plans import LLAMA_MOE
from tests.distributed.test_plans import SEED, STEPS, compare, reference_process  # noqa: F401 (fixture)


def chunk(lo, hi, only=None):
    out = {"start_unit": lo, "end_unit": hi, "recompute": ["none"] * (hi - lo)}
    return {**out, "holds_only": only} if only else out


def stage(*chunks, tp=1, dp=1):
    return {"num_gpus": tp * dp, "tp": tp, "dp": dp, "chunks": list(chunks)}


PLANS = {
    "gpt tied VPP 2: E|t*2|t*2|L": plan(GPT4, stage(chunk(0, 0, "embedding"), chunk(4, 8)),
                                        stage(chunk(0, 4), chunk(8, 8, "loss"))),
    "llama untied VPP 2: Et|t|t*2|L": plan(LLAMA4, stage(chunk(0, 2), chunk(4, 8)),
                                           stage(chunk(2, 4), chunk(8, 8, "loss"))),
    "gpt tied, one chunk per stage: E|t*4L": plan(GPT4, stage(chunk(0, 0, "embedding")), stage(chunk(0, 8))),
}


MOE = {"token_dispatcher": "alltoall", "grouped_gemm": False, "permute_fusion": False}
MOE_PLANS = {
    "llama MoE VPP 2: E|t|t|L": plan(LLAMA_MOE, stage(chunk(0, 0, "embedding"), chunk(2, 4)),
                                     stage(chunk(0, 2), chunk(4, 4, "loss")), moe=MOE),
    "DeepSeek-like MLA + MoE + MTP: E|t*3mL": plan(DEEPSEEK, stage(chunk(0, 0, "embedding")), stage(chunk(0, 7)),
                                                 moe=MOE),
}


def test_the_plans_hold_end_only_chunks():
    """The plans are what they say: each has a unit-less end chunk (guards against a silent schema change)."""
    for raw in [*PLANS.values(), *MOE_PLANS.values()]:
        p = parse_plan(raw)
        assert any(ch.num_units == 0 and ch.holds_only for _, _, ch in p.chunks_in_order())


def test_end_only_chunks_match_single_process(tmp_path, reference_process):  # noqa: F811
    """The dense and the MoE plans, all on 2 ranks: one process group for them all."""
    names, raws = zip(*PLANS.items(), *MOE_PLANS.items())
    out = tmp_path / "results.pt"
    spawn(2, run_plans, list(raws), str(out), SEED, STEPS, TC)
    failures = compare(names, raws, torch.load(out))
    assert not failures, "\n".join(failures)
