"""One process: CPU shims, builders, plan validation at the runtime entry, and a single-stage plan that equals a
plain stock megatron-core GPTModel (loss and every gradient)."""

from __future__ import annotations

import pytest
import torch

from search.io.errors import AcesoError
from search.spec.model import ModelSpec

GPT = ModelSpec(name="tiny-gpt", family="gpt", num_layers=2, hidden_size=32, num_attention_heads=4,
                ffn_hidden_size=64, seq_length=16, vocab_size=128, params_dtype="fp32")


def st(tp, dp, lo, hi, rc=None):
    return {"num_gpus": tp * dp, "tp": tp, "dp": dp, "start_unit": lo, "end_unit": hi,
            "recompute": rc or ["none"] * (hi - lo)}


def plan(model, *stages, mb=2, gbs=4):
    return {"model": model.model_dump(), "micro_batch_size": mb, "global_batch_size": gbs, "stages": list(stages)}


@pytest.fixture(scope="module")
def single_process():
    from aceso_megatron.testing.reference import init_single_process
    from aceso_megatron.testing import free_port

    init_single_process(free_port())


# ----- CPU shims ------------------------------------------------------------------------------------------
def test_cpu_mode_maps_cuda_to_cpu_and_replays_rng(single_process):
    from megatron.core.tensor_parallel import random as mrandom

    from patches import cpu_mode

    assert cpu_mode.is_applied()
    assert torch.ones(2, device="cuda").device.type == "cpu"
    assert torch.zeros(1, device=torch.cuda.current_device()).device.type == "cpu"
    state = mrandom._get_cuda_rng_state()
    a = torch.rand(3)
    mrandom._set_cuda_rng_state(state)
    assert torch.equal(a, torch.rand(3))  # the recompute RNG replay works on the CPU generator


def test_cpu_mode_active_in_backward(single_process):
    """A recomputed forward that creates a device='cuda' tensor must work inside backward."""
    from megatron.core import tensor_parallel

    def f(x):
        return x * torch.ones(x.shape, device="cuda")

    x = torch.randn(4, requires_grad=True)
    y = tensor_parallel.checkpoint(f, False, x)
    y.sum().backward()
    assert torch.equal(x.grad, torch.ones(4))


def test_cpu_mode_revert_restores_torch(single_process):
    from patches import cpu_mode

    cpu_mode.revert()
    try:
        assert not cpu_mode.is_applied()
        with pytest.raises((AssertionError, RuntimeError)):  # CPU-only torch: CUDA calls fail again
            torch.cuda.current_device()
    finally:
        cpu_mode.apply()
    assert torch.cuda.current_device() == 0


def test_patch_refuses_untested_version(monkeypatch):
    from patches import _base

    monkeypatch.setattr(_base, "megatron_version", lambda: "0.0.1")
    monkeypatch.delenv(_base.ALLOW_UNTESTED_ENV, raising=False)
    with pytest.raises(_base.PatchError, match="tested on megatron-core 0.16.1 but 0.0.1"):
        _base.check_version("cpu_mode", ("0.16.1",))


def test_runtime_cli_reports_a_refused_patch_as_bad_input(monkeypatch):
    from aceso_megatron.errors import bad_input_from_patches
    from patches import _base

    monkeypatch.setattr(_base, "megatron_version", lambda: "0.0.1")
    monkeypatch.delenv(_base.ALLOW_UNTESTED_ENV, raising=False)
    with pytest.raises(AcesoError, match="tested on megatron-core 0.16.1 but 0.0.1") as e:
        with bad_input_from_patches():
            _base.check_version("cpu_mode", ("0.16.1",))
    assert e.value.exit_code == 2


# ----- builders ---------------------------------------------------------------------------------------------
def test_unit_specs_split_a_layer(single_process):
    from megatron.core.transformer.identity_op import IdentityOp

    from model_specs.builders import gpt_layer_spec, unit_spec

    full = gpt_layer_spec(GPT, te=False)
    att, mlp = unit_spec(full, "attention").submodules, unit_spec(full, "mlp").submodules
    assert att.mlp is IdentityOp and att.pre_mlp_layernorm is IdentityOp
    assert att.self_attention is full.submodules.self_attention
    assert mlp.self_attention is IdentityOp and mlp.mlp is full.submodules.mlp


def test_attn_dropout_core_and_te_fallback(single_process, caplog):
    """attn_dropout swaps in the recomputing core attention; with transformer-engine it runs as none, one
    warning per stage."""
    from aceso_megatron.model.attention import (
        RecomputedDropoutAttention,
        fall_back_with_te,
        with_recomputed_dropout,
    )
    from model_specs.builders import gpt_layer_spec, unit_spec

    spec = with_recomputed_dropout(unit_spec(gpt_layer_spec(GPT, te=False), "attention"), "attention")
    assert spec.submodules.self_attention.submodules.core_attention is RecomputedDropoutAttention
    rc = ["attn_dropout", "selective", "attn_dropout", "full"]
    assert fall_back_with_te(rc, te=False, stage=1) == rc
    with caplog.at_level("WARNING", logger="aceso_megatron.model.attention"):
        assert fall_back_with_te(rc, te=True, stage=1) == ["none", "selective", "none", "full"]
    assert len(caplog.records) == 1 and "stage 1: attn_dropout on 2 unit(s) runs as none" in caplog.text


@pytest.mark.parametrize("assumed,te,device,warns", [
    ("flash", False, "cuda", "transformer-engine is not installed"), ("flash", True, "cuda", None),
    ("unfused", True, "cuda", "needs less memory"), ("unfused", False, "cuda", None), ("flash", False, "cpu", None),
    (None, False, "cuda", None)])
def test_attention_mismatch_between_plan_and_run(assumed, te, device, warns):
    """A plan costed with flash attention run without transformer-engine keeps s^2 activations: a warning."""
    from aceso_megatron.model.attention import attention_mismatch
    from search.spec.plan import parse_plan

    raw = plan(GPT, st(1, 1, 0, 4))
    raw["predicted"] = {"cost_model": "analytic", "iteration_time_ms": 1.0, "samples_per_s": 1.0,
                        "stage_time_ms": [1.0], "stage_memory_mb": [1.0], "attention": assumed}
    msg = attention_mismatch(parse_plan(raw), te, device)
    assert (msg is None) if warns is None else (warns in msg)


def test_stage_parameter_count_matches_model_spec(single_process):
    """The stage chunks' parameters add up to ModelSpec.num_parameters (an independent count)."""
    from aceso_megatron.training.engine import build_runtime

    for m in (GPT, GPT.model_copy(update={"tied_embeddings": False, "normalization": "rmsnorm",
                                          "activation": "swiglu", "add_bias_linear": False,
                                          "position_embedding": "rope", "num_query_groups": 2})):
        rt = build_runtime(plan(m, st(1, 1, 0, 4)), 0, 1, seed=3)
        assert sum(p.numel() for p in rt.stage_module.parameters()) == m.num_parameters


# ----- plan validation at the entry ---------------------------------------------------------------------------
@pytest.mark.parametrize("raw, world, message", [
    (plan(GPT, st(1, 1, 0, 4)), 2, "the plan needs 1 processes"),
    (plan(GPT, st(1, 1, 0, 2), st(3, 1, 2, 4)), 4, "stages[1].tp (3) must divide num_attention_heads"),
    (plan(GPT, st(1, 1, 0, 2), st(1, 1, 2, 2, [])), 2, "stages[1].chunks[0]: span [2, 2) is empty"),
    ({**plan(GPT, {**st(1, 1, 0, 2), "num_gpus": 2, "cp": 2}, st(1, 1, 2, 4)), "global_batch_size": 2}, 3,
     "stages[0].cp (2): megatron-core runs context parallelism only with transformer-engine's attention"),
    ({**plan(GPT, {**st(2, 1, 0, 4), "sequence_parallel": True}), "tp_comm_overlap": True}, 2,
     "tp_comm_overlap: transformer-engine's TP communication overlap"),
])
def test_bad_plans_fail_before_any_group(raw, world, message, monkeypatch):
    import torch.distributed as dist

    from aceso_megatron.training.engine import build_runtime

    def no_groups(*a, **k):
        raise AssertionError("a process group was created")

    monkeypatch.setattr(dist, "new_group", no_groups)
    with pytest.raises(AcesoError) as e:
        build_runtime(raw, 0, world)
    assert message in str(e.value) and "\n" not in str(e.value)


# ----- single stage == plain model ------------------------------------------------------------------------------
def test_single_stage_plan_equals_stock_gpt_model(single_process):
    from aceso_megatron.training.engine import TrainConfig, build_runtime
    from aceso_megatron.testing.reference import Reference
    from aceso_megatron.testing import make_batches

    tc = TrainConfig(clip_grad=0.3)
    raw = plan(GPT, st(1, 1, 0, 4, ["none", "selective", "full", "selective"]))
    batches = make_batches(GPT, 2, 4, seed=5)
    ref = Reference(GPT, seed=9, train_config=tc)
    rt = build_runtime(raw, 0, 1, seed=9, train_config=tc)
    assert ref.forward_backward(batches) == pytest.approx(rt.forward_backward(iter(batches)), rel=1e-6)
    want, got = ref.grads(), rt.full_grads()
    assert set(want) == set(got)
    for k in want:
        assert torch.allclose(got[k], want[k], rtol=1e-5, atol=1e-7), k
    ref.optimizer.step()
    from aceso_megatron.parallel.grads import clip_grad_norm

    clip_grad_norm(rt, tc.clip_grad)
    rt.optimizer.step()
    assert ref.train_step(batches) == pytest.approx(rt.train_step(iter(batches)), rel=1e-5)


@pytest.mark.parametrize("family", ["gpt", "t5"])
def test_single_stage_plan_with_dropout_equals_stock_model(single_process, family):
    """Attention and hidden dropout 0.1: same seed, same masks as stock megatron-core, under every recompute
    choice (each replays the RNG state it saved)."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from aceso_megatron.training.engine import build_runtime
    from aceso_megatron.testing.reference import Reference
    from aceso_megatron.testing import make_batches
    from tests.tiny_models import T5

    model = (GPT if family == "gpt" else T5).model_copy(update={"attention_dropout": 0.1, "hidden_dropout": 0.1})
    rc = (["attn_dropout", "selective", "selective", "full"] if family == "gpt" else  # T5: enc attn, mlp, ...
          ["attn_dropout", "full", "selective", "selective", "attn_dropout", "attn_dropout", "none", "full",
           "selective", "selective"])  # ... dec attn, cross, mlp
    batches = make_batches(model, 2, 4, seed=5)
    ref = Reference(model, seed=9)
    rt = build_runtime(plan(model, st(1, 1, 0, model.num_units, rc)), 0, 1, seed=9)
    model_parallel_cuda_manual_seed(9)  # both forwards start from the seeded RNG states (one stage: seed + 0)
    want_loss = ref.forward_backward(batches)
    model_parallel_cuda_manual_seed(9)
    assert rt.forward_backward(iter(batches)) == pytest.approx(want_loss, rel=1e-6)
    want, got = ref.grads(), rt.full_grads()
    assert set(want) == set(got)
    for k in want:
        assert torch.allclose(got[k], want[k], rtol=1e-5, atol=1e-7), k


# ----- recompute ------------------------------------------------------------------------------------------------
def _saved_bytes(rt, batches) -> int:
    """Bytes of tensors autograd keeps for backward during the forward of one micro-batch."""
    total = 0

    def pack(t):
        nonlocal total
        if not isinstance(t, torch.nn.Parameter):
            total += t.numel() * t.element_size()
        return t

    b = batches[0]
    pos = torch.arange(GPT.seq_length).unsqueeze(0).expand_as(b["tokens"])
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        rt.stage_module(input_ids=b["tokens"], position_ids=pos, labels=b["labels"])
    return total


def test_recompute_keeps_fewer_activations(single_process):
    """full < selective < none in saved activations, with the same gradients."""
    from aceso_megatron.training.engine import build_runtime
    from aceso_megatron.testing import make_batches

    batches = make_batches(GPT, 2, 2, seed=1)
    saved, grads = {}, {}
    for rc in ("none", "selective", "full"):
        rt = build_runtime(plan(GPT, st(1, 1, 0, 4, [rc] * 4), gbs=2), 0, 1, seed=4)
        saved[rc] = _saved_bytes(rt, batches)
        rt.forward_backward(iter(batches))
        grads[rc] = rt.full_grads()
    assert saved["full"] < saved["selective"] < saved["none"]
    for rc in ("selective", "full"):
        for k, g in grads["none"].items():
            assert torch.allclose(grads[rc][k], g, rtol=1e-6, atol=1e-8), (rc, k)


# ----- fast paths ----------------------------------------------------------------------------------------------
def test_selective_mlp_unit_keeps_its_activation_unfused(single_process):
    """With megatron-core's fused bias-GELU on, its MLP calls the fused kernel directly; a selective MLP unit must
    run CheckpointedActivation instead, so its unit config turns that one fusion off (the others stay)."""
    from aceso_megatron.model.config import stage_config, unit_config
    from aceso_megatron.model.fast_path import Environment, choose
    from aceso_megatron.model.recompute import CheckpointedActivation

    fast = choose(Environment(cuda=True, compute_capability=(9, 0)), GPT)
    base = stage_config(GPT, 1, "cpu", fast=fast)
    assert base.bias_activation_fusion and base.bias_dropout_fusion
    sel = unit_config(base, "mlp", "selective")
    assert isinstance(sel.activation_func, CheckpointedActivation)
    assert not sel.bias_activation_fusion and sel.bias_dropout_fusion
    assert unit_config(base, "mlp", "none") is base and unit_config(base, "attention", "selective").bias_activation_fusion


def test_transformer_engine_norm_weights_map_to_local_names():
    """TE fuses a layer's norms into the next linear; checkpoints key them by the local spec's names."""
    from aceso_megatron.model.stage_model import local_layer_name

    assert local_layer_name("self_attention.linear_qkv.layer_norm_weight") == "input_layernorm.weight"
    assert local_layer_name("self_attention.linear_qkv.layer_norm_bias") == "input_layernorm.bias"
    assert local_layer_name("mlp.linear_fc1.layer_norm_weight") == "pre_mlp_layernorm.weight"
    assert local_layer_name("self_attention.linear_qkv.weight") == "self_attention.linear_qkv.weight"
    assert local_layer_name("mlp.linear_fc1.bias") == "mlp.linear_fc1.bias"


@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
def test_sequence_parallel_norm_is_the_torch_norm_flagged(single_process, norm):
    """megatron-core's torch norm refuses SP; the flagged one computes the same and marks its weights for the TP
    gradient reduction."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from aceso_megatron.model.config import stage_config
    from aceso_megatron.model.norms import SequenceParallelNorm, with_sequence_parallel_norms
    from model_specs.builders import gpt_layer_spec

    model = GPT.model_copy(update={"normalization": norm})
    cfg = stage_config(model, 2, sequence_parallel=True)
    with pytest.raises(AssertionError, match="sequence parallel not supported"):
        WrappedTorchNorm(cfg, 32)
    sp = SequenceParallelNorm(cfg, 32, eps=1e-5)
    ref = WrappedTorchNorm(stage_config(model, 2), 32, eps=1e-5)
    ref.load_state_dict(sp.state_dict())
    x = torch.randn(5, 2, 32)
    assert torch.equal(sp(x), ref(x)) and all(p.sequence_parallel for p in sp.parameters())
    spec = with_sequence_parallel_norms(gpt_layer_spec(model, te=False)).submodules
    assert spec.input_layernorm is SequenceParallelNorm and spec.pre_mlp_layernorm is SequenceParallelNorm


def test_fp16_on_a_gpu_is_refused_before_any_group():
    from aceso_megatron.model.fast_path import Environment
    from aceso_megatron.training.engine import check_plan

    raw = plan(GPT.model_copy(update={"params_dtype": "fp16"}), st(1, 1, 0, 4))
    with pytest.raises(AcesoError, match=r"model.params_dtype fp16 \(aceso search --precision fp16\): the aceso runtime has no fp16 loss scaling yet"):
        check_plan(raw, 1, Environment(cuda=True, compute_capability=(9, 0)))
    assert check_plan(raw, 1, Environment(cuda=False)).model.params_dtype == "fp16"  # CPU runs fp32
