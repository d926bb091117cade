"""MLA and MTP plans on gloo (3 ranks) against a single-process stock megatron-core ``GPTModel`` with the same spec:
``MLASelfAttention`` layers (``get_gpt_layer_local_spec(multi_latent_attention=True)``, or the MoE block spec) and
the ``MultiTokenPredictionBlock`` (``get_gpt_mtp_block_spec``) with its loss in the backward.

Each plan as in ``test_plans.py`` (its ``compare``): loss and every gradient after one step (fp32, relative
<= 1e-5), the losses of 3 clipped optimizer steps and the weights after them. Plans: MLA across two stages with
tp2 + SP on the second (the RoPE key's gradient summed over TP: ``patches.mla_mtp_tp_group``); two MTP layers on
the last stage (pp2, dp2 there: the MTP block's embedding copy summed with stage 0's); a DeepSeek-V3-like tiny
model (MLA everywhere, the first layer dense, the rest MoE with a shared expert, one MTP layer) with the dense
layer on stage 0 and the MoE layers and the MTP block on stage 1 (tp2 + SP, ep2); a tied GPT (RoPE: Megatron-LM
refuses MTP with learned positions) with an MTP layer, whose last stage's output layer uses its embedding copy.

The control runs the MLA plan with megatron-core's own gather of MLA's ``kv_combined`` (the other TP rank's share
of the RoPE key's gradient lost) and must fail on ``linear_kv_down_proj``. Routing is deterministic as in
``test_moe_plans.py`` (``test_routing_margin``: the router's top-k margins far above fp32 rounding).
"""

from __future__ import annotations

import torch

from aceso_megatron.testing import run_plans, spawn
from aceso_megatron.testing.reference import stock_run
from patches.compat import at_least
from search.layers.moe_spec import MLASpec, MoESpec
from tests.distributed.test_plans import SEED, STEPS, TC, compare, reference_process  # noqa: F401 (fixture)
from tests.tiny_models import GPT, LLAMA

MLA = MLASpec(q_lora_rank=16, kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=8)
MLA_LLAMA = LLAMA.model_copy(update={"name": "tiny-llama-mla", "mla": MLA, "num_query_groups": None, "megatron": {"qk_layernorm": True}})
MTP_LLAMA = LLAMA.model_copy(update={"name": "tiny-llama-mtp", "mtp_num_layers": 2})
DEEPSEEK = LLAMA.model_copy(update={
    "name": "tiny-deepseek", "num_layers": 3, "mla": MLA, "num_query_groups": None, "mtp_num_layers": 1, "megatron": {"qk_layernorm": True},
    "moe": MoESpec(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, first_k_dense_layers=1,
                   moe_shared_expert_intermediate_size=16)})
# rope: Megatron-LM's validate_args refuses MTP with learned absolute positions (search.spec.model_rules)
GPT_MTP = GPT.model_copy(update={"name": "tiny-gpt-mtp", "mtp_num_layers": 1, "position_embedding": "rope"})


def st(tp, dp, lo, hi, ep=1, sp=False):
    return {"num_gpus": tp * dp, "tp": tp, "dp": dp, "ep": ep, "etp": 1 if ep > 1 else None,
            "sequence_parallel": sp, "start_unit": lo,
            "end_unit": hi, "recompute": ["none"] * (hi - lo)}


def plan(model, *stages):
    raw = {"model": model.model_dump(), "micro_batch_size": 2, "global_batch_size": 4, "stages": list(stages)}
    if model.moe is not None:
        raw["moe"] = {"token_dispatcher": "alltoall", "grouped_gemm": False, "permute_fusion": False}
    return raw


PLANS = {
    "MLA pp2, tp2 + SP on stage 1": plan(MLA_LLAMA, st(1, 1, 0, 2), st(2, 1, 2, 4, sp=True)),
    "2 MTP layers on the last stage (pp2, dp2 there)": plan(MTP_LLAMA, st(1, 1, 0, 2), st(1, 2, 2, 6)),
    "DeepSeek-like: dense MLA layer | MoE MLA layers + MTP on tp2 + SP, ep2": plan(
        DEEPSEEK, st(1, 1, 0, 2), st(2, 1, 2, 7, ep=2, sp=True)),
    "gpt tied, MTP on the last stage (tp2)": plan(GPT_MTP, st(1, 1, 0, 2), st(2, 1, 2, 5)),
}
if at_least("0.17"):   # megatron-core's shared MTP layer (mtp_use_repeated_layer): one layer run at both depths
    PLANS["2 MTP depths of one shared layer on the last stage (pp2, tp2 + SP there)"] = plan(
        MTP_LLAMA.model_copy(update={"name": "tiny-llama-shared-mtp", "mtp_use_repeated_layer": True}),
        st(1, 1, 0, 2), st(2, 1, 2, 6, sp=True))


# the control: the MLA tp2 + SP plan with megatron-core's plain gather of kv_combined (the RoPE key's gradient of
# the other TP rank's heads lost); it must fail on linear_kv_down_proj's gradient
CONTROL = PLANS["MLA pp2, tp2 + SP on stage 1"]


def plans_then_control(rank, world_size, raws, out, control_out, seed, steps, tc) -> None:
    """``run_plans`` on ``raws``, then the control plan without the RoPE key's TP reduction."""
    run_plans(rank, world_size, raws, out, seed, steps, tc)
    from megatron.core.tensor_parallel.mappings import _GatherFromModelParallelRegion

    from patches import mla_mtp_tp_group as patch

    right = patch._GatherWithKeyPos
    patch._GatherWithKeyPos = type("PlainGather", (), {"apply": staticmethod(
        lambda x, group, pos: _GatherFromModelParallelRegion.apply(x, group))})
    try:
        run_plans(rank, world_size, [CONTROL], control_out, seed, steps, tc)
    finally:
        patch._GatherWithKeyPos = right


def test_mla_mtp_plans_match_single_process(tmp_path, reference_process):  # noqa: F811
    names, raws = zip(*PLANS.items())
    out, control = tmp_path / "results.pt", tmp_path / "control.pt"
    spawn(3, plans_then_control, list(raws), str(out), str(control), SEED, STEPS, TC)
    failures = compare(names, raws, torch.load(out))
    assert not failures, "\n".join(failures)
    for raw in raws:   # stock GPTModel holds one MTP layer for shared depths (so the runtime, equal to it, does too)
        if raw["model"].get("mtp_use_repeated_layer"):
            layers = {k.split(".")[2] for k in stock_run(raw, SEED, TC, STEPS)["params"] if k.startswith("mtp.layers.")}
            assert layers == {"0"}, layers
    wrong = compare(["control"], [CONTROL], torch.load(control))
    assert any("linear_kv_down_proj" in f and " grad " in f for f in wrong), wrong


def test_routing_margin(reference_process):  # noqa: F811
    """The DeepSeek-like plan routes every token alike under any plan: its smallest top-k router-logit margin at
    the reference's initial weights is far above fp32 rounding (``test_moe_plans.router_gaps``)."""
    from tests.distributed.test_moe_plans import router_gaps

    gaps = router_gaps(PLANS["DeepSeek-like: dense MLA layer | MoE MLA layers + MTP on tp2 + SP, ep2"])
    assert len(gaps) >= 3 * 2, gaps   # 2 MoE layers + the MTP layer's, 2 micro-batches
    assert min(gaps) > 1e-5, f"top-k margin {min(gaps):.2e}: routing could differ between plans by rounding"
