"""MoE plans on gloo (<= 5 ranks) against a single-process stock megatron-core ``GPTModel`` with the same MoE
config (``get_gpt_decoder_block_spec``: dense and ``MoELayer`` layers, ``SequentialMLP`` experts, one process, EP 1).

Each plan as in ``test_plans.py``: loss and every gradient after one step (fp32, relative <= 1e-5; the expert
gradients by the stock model's global expert index), the losses of 3 clipped optimizer steps and the weights after
them. Plans: EP 2 on one stage; EP 2 -> EP 1 and EP 4 -> EP 1 across two stages; attention tp2 + SP with experts ep2 etp1 on the
same GPUs (folding); ETP 2 with EP 2 under attention tp2 x dp2; a dense first layer on stage 0 and MoE after; a
shared expert; the alltoall and allgather dispatchers; selective (each expert's activation) and full recompute
of MoE units. The control reduces the expert gradients over the
attention DP group instead of expert-DP and must fail.

Routing is deterministic without forcing it: the router's fp32 logits of distinct random tokens differ by far
more than the rounding differences between plans (its GEMM runs on a rank's share of the tokens), so top-k picks
the same experts everywhere; ``test_routing_margin`` measures the smallest top-k margin of the reference.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

from aceso_megatron.testing import run_plans, spawn
from search.layers.moe_spec import MoESpec
from tests.distributed.test_plans import SEED, STEPS, TC, compare, reference_process  # noqa: F401 (fixture)
from tests.tiny_models import GPT, LLAMA

MOE = MoESpec(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32)
LLAMA_MOE = LLAMA.model_copy(update={"name": "tiny-llama-moe", "moe": MOE})
DENSE_FIRST = LLAMA.model_copy(update={"name": "tiny-llama-moe-dense-first", "num_layers": 3, "moe": MOE.model_copy(
    update={"first_k_dense_layers": 1, "moe_shared_expert_intermediate_size": 16})})
# GELU, LayerNorm, learned positions, tied embeddings (no biases: refused with MoE, see model.moe.refusal)
GPT_MOE = GPT.model_copy(update={"name": "tiny-gpt-moe", "moe": MOE, "add_bias_linear": False})


def st(tp, dp, lo, hi, ep=1, etp=None, sp=False, rc=None):
    return {"num_gpus": tp * dp, "tp": tp, "dp": dp, "ep": ep, "etp": etp, "sequence_parallel": sp,
            "start_unit": lo, "end_unit": hi, "recompute": rc or ["none"] * (hi - lo)}


def plan(model, *stages, mb=2, gbs=4, dispatcher="alltoall"):
    return {"model": model.model_dump(), "micro_batch_size": mb, "global_batch_size": gbs, "stages": list(stages),
            "moe": {"token_dispatcher": dispatcher, "grouped_gemm": False, "permute_fusion": False}}


PLANS = {
    2: {
        "llama EP 2 on one stage (tp1 x dp2, edp 1), alltoall": plan(LLAMA_MOE, st(1, 2, 0, 4, ep=2)),
        "llama EP 2, allgather dispatcher, MoE units recomputed selective and full": plan(
            LLAMA_MOE, st(1, 2, 0, 4, ep=2, rc=["full", "selective", "selective", "full"]), dispatcher="allgather"),
        "gpt tp2 + SP, experts ep2 etp1 on the same GPUs (folding)": plan(
            GPT_MOE, st(2, 1, 0, 4, ep=2, etp=1, sp=True)),
    },
    4: {
        "llama EP 2 -> EP 1 across two stages (dp2 | dp2)": plan(LLAMA_MOE, st(1, 2, 0, 2, ep=2), st(1, 2, 2, 4)),
        "llama dense first layer on stage 0 (dp2), shared expert, EP 2 on stage 1": plan(
            DENSE_FIRST, st(1, 2, 0, 2), st(1, 2, 2, 6, ep=2)),
        "llama tp2 + SP x dp2, experts etp2 x ep2 (edp 1), allgather": plan(
            LLAMA_MOE, st(2, 2, 0, 4, ep=2, etp=2, sp=True), dispatcher="allgather"),
        "llama tp2 + SP x dp2, experts etp1 x ep4, allgather": plan(
            LLAMA_MOE, st(2, 2, 0, 4, ep=4, etp=1, sp=True), dispatcher="allgather"),
    },
    5: {
        "llama EP 4 -> EP 1 across two stages (dp4 | dp1)": plan(LLAMA_MOE, st(1, 4, 0, 2, ep=4), st(1, 1, 2, 4),
                                                                 mb=4, gbs=8),
    },
}


def test_enough_moe_plans():
    assert sum(len(p) for p in PLANS.values()) >= 7


# the control: EP 2 over attention DP 2 (expert-DP 1); reducing the experts over DP sums different experts
CONTROL = PLANS[2]["llama EP 2 on one stage (tp1 x dp2, edp 1), alltoall"]


def _experts_over_dp(chunk) -> None:
    """The wrong group: routed experts left in DDP's dense buffers, reduced over the attention DP group."""
    from aceso_megatron.model.moe import is_expert

    for name, canon in chunk.canonical_names().items():
        if is_expert(canon):
            chunk.get_parameter(name).allreduce = True


def plans_then_control(rank, world_size, raws, out, control_out, seed, steps, tc) -> None:
    """``run_plans`` on ``raws``; then, on ranks > 1, the control plan with experts reduced over DP."""
    run_plans(rank, world_size, raws, out, seed, steps, tc)
    if world_size == 2:
        from aceso_megatron.model import moe

        right, moe.mark_expert_params = moe.mark_expert_params, _experts_over_dp
        try:
            run_plans(rank, world_size, [CONTROL], control_out, seed, steps, tc)
        finally:
            moe.mark_expert_params = right
    dist.barrier()


@pytest.mark.parametrize("world_size", sorted(PLANS))
def test_moe_plans_match_single_process(world_size, tmp_path, reference_process):  # noqa: F811
    names, raws = zip(*PLANS[world_size].items())
    out, control = tmp_path / "results.pt", tmp_path / "control.pt"
    spawn(world_size, plans_then_control, list(raws), str(out), str(control), SEED, STEPS, TC)
    failures = compare(names, raws, torch.load(out))
    assert not failures, "\n".join(failures)
    if world_size == 2:   # the control must fail, on expert gradients
        wrong = compare(["control"], [CONTROL], torch.load(control))
        assert any(".mlp.experts." in f and " grad " in f for f in wrong), wrong


def test_routing_margin(reference_process):  # noqa: F811
    """The smallest gap between the k-th and (k+1)-th router logit over every token of every plan's batches, at
    the reference's initial weights: far above fp32 rounding, so every plan routes every token alike."""
    # plans of one model and batch sizes route the same tokens through the same reference: each such group once
    distinct = {(json.dumps(r["model"], sort_keys=True), r["micro_batch_size"], r["global_batch_size"]): r
                for plans in PLANS.values() for r in plans.values()}
    smallest = min(min(router_gaps(r)) for r in distinct.values())
    print(f"smallest top-k router-logit margin: {smallest:.2e}")
    assert smallest > 1e-5, f"top-k margin {smallest:.2e}: routing could differ between plans by rounding"


def router_gaps(raw) -> list[float]:
    """Every router call's smallest top-k margin (``_gap``) over the plan's batches, run through the single-process
    reference at its initial weights; asserts that a router ran."""
    from aceso_megatron.testing import make_batches
    from aceso_megatron.testing.reference import Reference
    from search.spec.plan import ParallelPlan

    p = ParallelPlan.model_validate(raw)
    ref = Reference(p.model, seed=SEED, train_config=TC)
    gaps = []
    hooks = [m.register_forward_hook(lambda mod, args, out: gaps.append(_gap(mod, args[0])))
             for n, m in ref.gpt.named_modules() if n.endswith("mlp.router")]
    ref.forward_backward(make_batches(p.model, p.micro_batch_size, p.global_batch_size, SEED))
    for h in hooks:
        h.remove()
    assert gaps, "no router ran"
    return gaps


def _gap(router, hidden: torch.Tensor) -> float:
    logits = (hidden.reshape(-1, hidden.size(-1)) @ router.weight.t()).detach()
    top = logits.topk(router.topk + 1, dim=-1).values
    return float((top[:, -2] - top[:, -1]).min())


# issue 32: padding the expert input to capacity (megatron-core's drop-and-pad alltoall) ran unpadded in the runtime;
# a capacity that drops nothing (4 experts, top 2, factor 2: every expert's capacity is a rank's tokens, the most
# it can receive; megatron-core's padded permute needs a capacity of at most the tokens) pads with zeros
PADDED_MOE = MOE.model_copy(update={"moe_expert_capacity_factor": 2.0, "moe_pad_expert_input_to_capacity": True})
PADDED = plan(LLAMA_MOE.model_copy(update={"name": "tiny-llama-moe-padded", "moe": PADDED_MOE}), st(1, 2, 0, 4, ep=2))


def test_a_plan_padding_the_expert_input_matches_single_process(tmp_path, reference_process):  # noqa: F811
    out = tmp_path / "results.pt"
    spawn(2, run_plans, [PADDED], str(out), SEED, STEPS, TC)
    failures = compare(["padded to capacity, EP 2, alltoall"], [PADDED], torch.load(out))
    assert not failures, "\n".join(failures)
