"""GPU tier (skipped without CUDA): the MoE and MLA fast paths against the unfused build of the same plan.

Each plan runs twice on NCCL with the same weights and batches, in fp32: once with the fast paths
(``model.moe.fast_fields``: transformer-engine's grouped experts ``TEGroupedMLP`` and its fused permute; the TE
layer specs of ``fast_path.choose``), once unfused (``SequentialMLP``, megatron-core's local specs, every fusion
off). The 5 losses agree closely (fused kernels reorder sums; TF32 is off in torch by default) and the model learns.

Plans: an MoE model with a shared expert, experts over EP 2 on 2 GPUs (EP 1 on one), alltoall dispatcher; the same
with the flex dispatcher where DeepEP is importable; a DeepSeek-like MLA + MoE model (``MLASelfAttention`` with TE's
linears, whose ``linear_kv_down_proj`` without SP takes the same gather ``patches.mla_mtp_tp_group`` fixes at
tp 2). None of this has run on a GPU yet; bench/gpu/validate.sh runs it when a device is lent.
"""

from __future__ import annotations

import importlib.util

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs CUDA (the GPU tier runs on a machine with an NVIDIA GPU)", allow_module_level=True)
if importlib.util.find_spec("transformer_engine") is None:
    pytest.skip("the MoE fast paths need transformer-engine (pip install -e '.[gpu]')", allow_module_level=True)

from aceso_megatron.testing import make_batches, spawn  # noqa: E402
from search.spec.model import ModelSpec  # noqa: E402
from search.layers.moe_spec import MLASpec, MoESpec  # noqa: E402

STEPS, SEED, MB, GBS = 5, 23, 2, 8
LLAMA = dict(family="llama", num_layers=2, hidden_size=256, num_attention_heads=8, ffn_hidden_size=512,
             seq_length=128, vocab_size=1024, params_dtype="fp32", normalization="rmsnorm", activation="swiglu",
             position_embedding="rope", add_bias_linear=False, tied_embeddings=False)
MOE = MoESpec(num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=128, moe_shared_expert_intermediate_size=128)
MOE_MODEL = ModelSpec(name="gpu-moe", moe=MOE, **LLAMA)
MLA_MOE_MODEL = ModelSpec(name="gpu-mla-moe", moe=MOE.model_copy(update={"first_k_dense_layers": 1}),
                          mla=MLASpec(q_lora_rank=64, kv_lora_rank=64, qk_head_dim=32, qk_pos_emb_head_dim=16,
                                      v_head_dim=32),
                          megatron={"qk_layernorm": True}, **LLAMA)


def _plan(model: ModelSpec, world: int, dispatcher: str, fused: bool) -> dict:
    units = len(model.units)
    return {"model": model.model_dump(), "micro_batch_size": MB, "global_batch_size": GBS, "stages": [
        {"num_gpus": world, "tp": 1, "dp": world, "ep": world, "etp": 1, "start_unit": 0, "end_unit": units,
         "recompute": ["none"] * units}],
        "moe": {"token_dispatcher": dispatcher, "grouped_gemm": fused, "permute_fusion": fused}}


def _run(rank: int, world: int, model_raw: dict, dispatcher: str, out: str) -> None:
    from aceso_megatron.model.fast_path import OFF, FastPath
    from aceso_megatron.training.engine import TrainConfig, build_runtime

    model = ModelSpec.model_validate(model_raw)
    batches = make_batches(model, MB, GBS * STEPS, SEED)
    per_step = GBS // MB
    res = {}
    unfused = FastPath("local", "fp32", dict(OFF))
    for name, disp, fused, fast in (("fused", dispatcher, True, None), ("unfused", "alltoall", False, unfused)):
        rt = build_runtime(_plan(model, world, disp, fused), rank, world, seed=SEED, device="cuda",
                           train_config=TrainConfig(lr=1e-3, clip_grad=1.0), fast=fast)
        res[name] = [rt.train_step(iter(batches[per_step * i:per_step * (i + 1)])) for i in range(STEPS)]
        res[name + "_experts"] = sorted({type(m).__name__ for c in rt.chunks for m in c.modules() if "MLP" in type(m).__name__})
    if rank == 0:
        torch.save(res, out)


def _check(res: dict) -> None:
    assert "TEGroupedMLP" in res["fused_experts"], res["fused_experts"]
    assert "SequentialMLP" in res["unfused_experts"], res["unfused_experts"]
    assert res["fused"] == pytest.approx(res["unfused"], rel=2e-3), res
    assert res["fused"][-1] < res["fused"][0], res


@pytest.mark.parametrize("model", [MOE_MODEL, MLA_MOE_MODEL], ids=lambda m: m.name)
def test_grouped_experts_match_sequential_experts(model, tmp_path):
    world = min(2, torch.cuda.device_count())
    out = tmp_path / "res.pt"
    spawn(world, _run, model.model_dump(), "alltoall", str(out), backend="nccl")
    _check(torch.load(out))


def test_flex_dispatcher_matches_alltoall_unfused(tmp_path):
    """The flex dispatcher (DeepEP) with grouped experts against SequentialMLP under alltoall: same losses."""
    if importlib.util.find_spec("deep_ep") is None:
        pytest.skip("the flex dispatcher needs DeepEP (deep_ep), not importable here")
    if torch.cuda.device_count() < 2:
        pytest.skip("the flex dispatcher needs 2 GPUs for EP 2")
    out = tmp_path / "res.pt"
    spawn(2, _run, MOE_MODEL.model_dump(), "flex", str(out), backend="nccl")
    _check(torch.load(out))
