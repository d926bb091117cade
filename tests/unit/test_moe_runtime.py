"""The runtime's MoE choices (``aceso_megatron.model.moe``), torch-free: the per-stage ``TransformerConfig`` fields
(expert shape as megatron-core names it, the dispatcher, the fast paths per environment), the stock model's
global expert index of a local expert, and every refusal (one line naming the field and the fix): MLA and MTP run
(tests/distributed/test_moe_mla_mtp.py), but not MTP recompute nor ``attn_dropout`` on MLA attention."""

from __future__ import annotations

import pytest

from aceso_megatron.model.fast_path import Environment
from aceso_megatron.model.moe import fast_fields, global_expert_name, is_expert, stage_fields
from aceso_megatron.preflight import refusal
from search.spec.model import ModelSpec
from search.layers.moe_spec import MLASpec, MoESpec
from search.settings.moe_plan import MoEPlanSettings
from search.spec.plan import ParallelPlan

MOE = ModelSpec(name="m", family="llama", num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                seq_length=16, vocab_size=128, activation="swiglu", normalization="rmsnorm",
                position_embedding="rope", add_bias_linear=False, tied_embeddings=False, params_dtype="fp32",
                moe=MoESpec(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32))
MLA = MOE.model_copy(update={"mla": MLASpec(kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=8)})
MTP = MOE.model_copy(update={"mtp_num_layers": 1})
BF16 = MOE.model_copy(update={"params_dtype": "bf16"})       # megatron-core runs the EP overlap in bf16 / fp16 only
CPU = Environment(cuda=False)
CUDA = Environment(cuda=True, compute_capability=(9, 0))
CUDA_TE = Environment(cuda=True, te_version="2.1.0", compute_capability=(9, 0))


def plan(model=MOE, tp=2, dp=1, ep=2, etp=1, moe=None, rc=None, **features):
    st = {"num_gpus": tp * dp, "tp": tp, "dp": dp, "ep": ep, "etp": etp, "sequence_parallel": tp > 1,
          "start_unit": 0, "end_unit": model.num_units, "recompute": rc or ["none"] * model.num_units}
    return ParallelPlan.model_validate({"model": model.model_dump(), "micro_batch_size": 2, "global_batch_size": 2,
                                        "stages": [st], "moe": moe, **features})


def test_stage_fields_carry_the_stage_expert_shape_and_dispatcher():
    got = stage_fields(plan(moe={"token_dispatcher": "allgather"}), 0, cuda=False, te=False)
    assert got == {"expert_model_parallel_size": 2, "expert_tensor_parallel_size": 1,
                   "moe_token_dispatcher_type": "allgather", "moe_flex_dispatcher_backend": "deepep",
                   "moe_router_dtype": None, "moe_grouped_gemm": False, "moe_permute_fusion": False,
                   "moe_router_fusion": False, "moe_shared_expert_overlap": False}
    assert stage_fields(plan(ep=1, etp=None), 0, False, False)["expert_tensor_parallel_size"] == 2   # None = tp
    dense = MOE.model_copy(update={"moe": None})
    assert stage_fields(plan(dense, ep=1, etp=None), 0, False, False) == {}


def test_fast_paths_follow_the_environment():
    s = MoEPlanSettings(shared_expert_overlap=True, router_fusion=True)
    assert not any(fast_fields(False, False, s).values())                # CPU: SequentialMLP, no streams
    assert fast_fields(True, True, s) == {"moe_grouped_gemm": True, "moe_permute_fusion": True,
                                          "moe_router_fusion": True, "moe_shared_expert_overlap": True}
    assert fast_fields(True, False, s)["moe_permute_fusion"] is False   # TE's fused permute


def test_local_experts_take_the_stock_models_global_index():
    name = "decoder.layers.1.mlp.experts.local_experts.1.linear_fc1.weight"
    assert global_expert_name(name, 1, 2) == "decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight"
    assert global_expert_name("decoder.layers.1.mlp.router.weight", 1, 2) == "decoder.layers.1.mlp.router.weight"
    assert is_expert(name) and not is_expert("decoder.layers.1.mlp.shared_experts.linear_fc1.weight")


@pytest.mark.parametrize("make, env, field", [
    (lambda: plan(moe={"token_dispatcher": "flex"}), CPU, "moe.token_dispatcher flex"),
    (lambda: plan(moe={"grouped_gemm": True}), CUDA, "moe.grouped_gemm"),
    (lambda: plan(BF16, moe={"overlap_ep_comm": True}), CUDA_TE, "moe.overlap_ep_comm"),
    (lambda: plan(ep=1, etp=2), CPU, "stages[0].etp (2) with the alltoall dispatcher"),
    (lambda: plan(MTP, rc=["none"] * 4 + ["full"]), CPU, "unit 4 (mtp): recompute full"),
    (lambda: plan(MLA, rc=["attn_dropout"] + ["none"] * 3), CPU, "attn_dropout with multi-latent attention"),
])
def test_refusals_name_the_field_and_the_fix(make, env, field):
    msg = refusal(env, make())
    assert msg is not None and field in msg and "\n" not in msg and ("use" in msg or "set" in msg), msg


def test_runnable_plans_are_not_refused():
    assert refusal(CPU, plan()) is None
    assert refusal(CPU, plan(rc=["selective"] * 4)) is None   # an MoE unit: each expert's activation
    assert refusal(CPU, plan(ep=1, etp=2, moe={"token_dispatcher": "allgather"})) is None
    assert refusal(CUDA_TE, plan(ep=1, etp=2)) is None
    assert refusal(None, plan(moe={"token_dispatcher": "flex"})) is None   # environment unknown: not refused
    assert refusal(CPU, plan(MTP)) is None and refusal(CPU, plan(MLA, rc=["selective", "full"] * 2)) is None
    dense_mla_mtp = MLA.model_copy(update={"moe": None, "mtp_num_layers": 2})   # MLA / MTP without MoE run too
    assert refusal(CPU, plan(dense_mla_mtp, ep=1, etp=None)) is None
    # aux-loss-free routing: the runtime updates the expert bias over each stage's own groups (was refused)
    assert refusal(CPU, plan(MOE.model_copy(update={"moe": MOE.moe.model_copy(update={
        "moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True})}))) is None


def test_validate_refuses_what_no_machine_runs_and_the_search_keeps_the_distributed_optimizer():
    """The one pre-flight (validate, the search's output check, launch) refuses an MoE runtime plan that no
    machine runs (``overlap_ep_comm``), not only in the workers; the distributed optimizer with MoE runs
    (tests/distributed/test_moe_optim.py), so validate passes it and a runtime search keeps it as asked."""
    from search.io.errors import AcesoError
    from search.planner.api import runtime_training
    from search.targets.preflight import preflight
    from search.spec.training import TrainingSpec
    with pytest.raises(AcesoError, match="moe.overlap_ep_comm"):
        preflight(plan(BF16, moe={"overlap_ep_comm": True}), "cuda")
    assert preflight(plan(distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True), "cuda")
    tr = TrainingSpec(global_batch_size=8, distributed_optimizer=True, overlap_param_gather=True)
    kept = runtime_training(tr)
    assert kept.distributed_optimizer is True and kept.overlap_param_gather is True


def test_mtp_with_context_parallelism_or_virtual_stages_is_refused():
    """Not proven against stock megatron-core (tests/distributed/test_moe_mla_mtp.py runs neither): one line each."""
    n = MTP.num_units
    cp2 = ParallelPlan.model_validate({"model": MTP.model_dump(), "micro_batch_size": 2, "global_batch_size": 2,
                                       "stages": [{"num_gpus": 2, "tp": 1, "dp": 1, "cp": 2, "ep": 2, "etp": 1,
                                                   "start_unit": 0, "end_unit": n, "recompute": ["none"] * n}]})
    msg = refusal(CUDA_TE, cp2)       # on CPU the table refuses cp 2 first (no transformer-engine)
    assert msg is not None and "stages[0].cp (2) with model.mtp_num_layers" in msg and "use cp 1" in msg, msg
    def st(*spans):
        return {"num_gpus": 2, "tp": 1, "dp": 2, "ep": 2, "etp": 1,
                "chunks": [{"start_unit": a, "end_unit": b, "recompute": ["none"] * (b - a)} for a, b in spans]}
    vpp = ParallelPlan.model_validate({"model": MTP.model_dump(), "micro_batch_size": 2, "global_batch_size": 8,
                                       "stages": [st((0, 1), (2, 3)), st((1, 2), (3, n))]})
    msg = refusal(CPU, vpp)
    assert msg is not None and "stages[1].chunks (2 virtual stages" in msg and "one chunk per stage" in msg, msg
