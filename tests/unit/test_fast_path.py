"""The fast-path choice (``aceso_megatron.model.fast_path``) is a pure function of the environment description
and the plan: checked here, torch-free, for the CPU, "CUDA, no transformer-engine" and "CUDA + TE" environments
against megatron-core's requirements of each option (the table in the module docstring)."""

from __future__ import annotations

import pytest

from aceso_megatron.model.fast_path import APEX_GRAD_ACCUM, APEX_SOFTMAX, OFF, Environment, choose
from aceso_megatron.preflight import refusal
from search.spec.model import ModelSpec
from search.spec.plan import ParallelPlan

GPT = ModelSpec(name="g", family="gpt", num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256,
                seq_length=32, vocab_size=256, params_dtype="bf16")  # GELU with biases, learned positions
LLAMA = GPT.model_copy(update={"name": "l", "family": "llama", "activation": "swiglu", "normalization": "rmsnorm",
                               "position_embedding": "rope", "add_bias_linear": False, "tied_embeddings": False})
GELU_NO_BIAS = GPT.model_copy(update={"add_bias_linear": False})

CPU = Environment(cuda=False)
CUDA = Environment(cuda=True, compute_capability=(9, 0))
CUDA_APEX = Environment(cuda=True, compute_capability=(8, 0), apex_kernels=frozenset((*APEX_SOFTMAX, APEX_GRAD_ACCUM)))
CUDA_TE = Environment(cuda=True, te_version="2.1.0+abc", compute_capability=(9, 0), te_userbuffers=True)
V100_TE = Environment(cuda=True, te_version="1.3", compute_capability=(7, 0))


def stage(tp, dp, lo, hi, cp=1, sp=None):
    return {"num_gpus": tp * cp * dp, "tp": tp, "cp": cp, "dp": dp, "sequence_parallel": tp > 1 if sp is None else sp,
            "start_unit": lo, "end_unit": hi, "recompute": ["none"] * (hi - lo)}


def plan(*stages, mb=4, **features):
    return ParallelPlan.model_validate({"model": GPT.model_dump(), "micro_batch_size": mb, "global_batch_size": 8,
                                        "stages": list(stages), **features})


def test_cpu_runs_fp32_with_every_fusion_off():
    for model in (GPT, LLAMA):
        fp = choose(CPU, model)
        assert (fp.spec, fp.dtype, fp.config) == ("local", "fp32", OFF)
        assert not fp.output_layer_grad_accum_fusion and fp.notes


def test_cuda_with_transformer_engine():
    fp = choose(CUDA_TE, GPT)
    assert fp.spec == "te" and fp.te and fp.dtype == "bf16"
    c = fp.config
    assert c["bias_activation_fusion"] and c["bias_dropout_fusion"] and c["masked_softmax_fusion"]
    assert c["gradient_accumulation_fusion"] and not fp.output_layer_grad_accum_fusion  # local output layer: apex
    assert not c["apply_rope_fusion"]  # learned positions
    assert choose(CUDA_TE, LLAMA).config["apply_rope_fusion"]  # RoPE and TE >= 1.4
    # YaRN: off, as Megatron-LM's validate_args turns it off for --position-embedding-type yarn (megatron-core's
    # apply_rotary_pos_emb runs a cos / sin scale unfused only)
    yarn = LLAMA.model_copy(update={"rope_scaling": {"type": "yarn", "factor": 32.0}})
    assert not choose(CUDA_TE, ModelSpec.model_validate(yarn.model_dump())).config["apply_rope_fusion"]
    assert not c["tp_comm_overlap"] and choose(CUDA_TE, GPT, tp_comm_overlap=True).config["tp_comm_overlap"]
    assert not c["persist_layer_norm"] and not c["cross_entropy_loss_fusion"]


def test_cuda_without_transformer_engine():
    fp = choose(CUDA, GPT)
    assert fp.spec == "local" and fp.dtype == "bf16"
    c = fp.config
    assert c["bias_activation_fusion"] and c["bias_dropout_fusion"]  # megatron-core's own jit-fused kernels
    assert not c["masked_softmax_fusion"] and not c["gradient_accumulation_fusion"]  # apex kernels absent
    assert not choose(CUDA, LLAMA).config["apply_rope_fusion"]
    assert any("transformer-engine not importable" in n for n in fp.notes)
    apex = choose(CUDA_APEX, GPT)
    assert apex.config["masked_softmax_fusion"] and apex.config["gradient_accumulation_fusion"]
    assert apex.output_layer_grad_accum_fusion


def test_bias_activation_fusion_follows_megatron_core_mlp():
    """megatron-core fuses SwiGLU with or without bias, but its fused bias-GELU asserts add_bias_linear."""
    assert choose(CUDA_TE, LLAMA).config["bias_activation_fusion"]
    assert not choose(CUDA_TE, GELU_NO_BIAS).config["bias_activation_fusion"]


def test_bf16_needs_ampere():
    fp = choose(V100_TE, GPT)
    assert fp.dtype == "fp32" and any("compute capability 8.0" in n for n in fp.notes)
    assert not fp.config["apply_rope_fusion"]  # TE 1.3 < 1.4
    assert choose(CUDA, GPT.model_copy(update={"params_dtype": "fp32"})).dtype == "fp32"


def test_context_parallel_needs_transformer_engine():
    p = plan(stage(1, 1, 0, 2), stage(2, 1, 2, 4, cp=2, sp=False))
    for env, where in ((CPU, "not on CPU"), (CUDA, "not without transformer-engine")):
        msg = refusal(env, p)
        assert msg.startswith("stages[1].cp (2): megatron-core runs context parallelism only with "
                              "transformer-engine's attention") and where in msg and "\n" not in msg
    assert refusal(CUDA_TE, p) is None


def test_tp_comm_overlap_needs_te_userbuffers_and_one_tp_domain():
    uniform = plan(stage(2, 1, 0, 2), stage(2, 1, 2, 4), tp_comm_overlap=True)
    assert refusal(CUDA_TE, uniform) is None
    assert "tp_comm_overlap" in refusal(CPU, uniform) and "settings.tp_comm_overlap" in refusal(CUDA, uniform)
    assert "lacks it" in refusal(Environment(cuda=True, te_version="1.8", te_userbuffers=True), uniform)
    mixed = plan(stage(2, 1, 0, 2), stage(2, 2, 2, 4), tp_comm_overlap=True)  # per-rank micro-batch 4 vs 2
    assert "every stage needs the same tp (> 1), cp and per-rank micro-batch" in refusal(CUDA_TE, mixed)
    assert refusal(CUDA_TE, plan(stage(2, 1, 0, 4))) is None  # not asked: nothing to refuse


@pytest.mark.parametrize("version, want", [("2.1.0+abc", (2, 1, 0)), ("1.13.0.dev0", (1, 13, 0)), (None, ())])
def test_versions_compare_numerically(version, want):
    from aceso_megatron.model.fast_path import _version

    assert _version(version) == want
