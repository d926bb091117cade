"""GPU tier (skipped without CUDA or before megatron-core 0.19): a hybrid model (Mamba-2, attention, MoE and MLP
layers as megatron-core's ``HybridModel`` pattern) trained by `aceso train` on NCCL -- Mamba on mamba-ssm's kernels
where it is installed, else on ``patches.mamba_cpu``'s torch kernels on the GPU; transformer-engine's linears where
importable -- learns and matches the same plan run on CPU/gloo (fp32), the path proven equal to stock
``HybridModel`` in tests/distributed/test_hybrid_plans.py. With 3 GPUs the plan cuts the pattern inside with
SP tp 2 | tp 1, with 2 GPUs tp 1 | tp 1, on one GPU one stage."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs CUDA (the GPU tier runs on a machine with an NVIDIA GPU)", allow_module_level=True)

from patches.compat import have_hybrid  # noqa: E402
from search.spec.model import ModelSpec  # noqa: E402
from search.spec.plan import ParallelPlan  # noqa: E402
from tests.gpu.test_cuda_train import check_learns_and_matches_cpu  # noqa: E402

if not have_hybrid():
    pytest.skip("megatron-core without models.hybrid (before 0.19): hybrid plans are refused there",
                allow_module_level=True)

MODEL = ModelSpec(name="tiny-hybrid-gpu", family="llama", num_layers=6, hidden_size=64, num_attention_heads=4,
                  num_query_groups=2, ffn_hidden_size=128, seq_length=64, vocab_size=512, activation="swiglu",
                  normalization="rmsnorm", position_embedding="rope", tied_embeddings=False, add_bias_linear=False,
                  params_dtype="fp32", hybrid_layer_pattern="M*EM-E",
                  mamba={"mamba_state_dim": 16, "mamba_head_dim": 16, "mamba_num_groups": 2, "chunk_size": 32},
                  moe={"num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 64})


def _stage(tp, lo, hi, rc=None):
    return {"num_gpus": tp, "tp": tp, "dp": 1, "sequence_parallel": tp > 1, "etp": 1 if tp > 1 else None,
            "start_unit": lo, "end_unit": hi, "recompute": rc or ["none"] * (hi - lo)}


def _plan(num_gpus: int) -> ParallelPlan:
    if num_gpus >= 3:
        stages = [_stage(2, 0, 4, ["full", "none", "none", "none"]), _stage(1, 4, 6)]
    elif num_gpus == 2:
        stages = [_stage(1, 0, 3, ["full", "selective", "none"]), _stage(1, 3, 6)]
    else:
        stages = [_stage(1, 0, 6, ["full", "selective", "none", "none", "selective", "full"])]
    return ParallelPlan.model_validate({
        "model": MODEL.model_dump(), "micro_batch_size": 2, "global_batch_size": 8, "stages": stages,
        "moe": {"token_dispatcher": "alltoall", "grouped_gemm": False, "permute_fusion": False}})


def test_hybrid_training_on_cuda_learns_and_matches_cpu(tmp_path):
    # fp32 on both; mamba-ssm's fused scan (where installed) sums in another order than the torch kernels
    check_learns_and_matches_cpu(tmp_path, _plan(min(3, torch.cuda.device_count())), rel=5e-3)
