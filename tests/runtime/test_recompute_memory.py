"""Recompute choices free what the cost model says they free: the activations autograd keeps for backward after
one unit's forward, measured with saved-tensor hooks, against hand-computed sizes."""

from __future__ import annotations

import pytest
import torch

from search.spec.model import ModelSpec

S, B, H, FFN = 16, 2, 32, 128
GPT = ModelSpec(name="t", family="gpt", num_layers=1, hidden_size=H, num_attention_heads=4, ffn_hidden_size=FFN,
                seq_length=S, vocab_size=128, params_dtype="fp32")


@pytest.fixture(scope="module")
def single_process():
    from aceso_megatron.testing.reference import init_single_process
    from aceso_megatron.testing import free_port

    init_single_process(free_port())


def kept_bytes(model: ModelSpec, rc: str) -> tuple[int, torch.Tensor]:
    from aceso_megatron.training.engine import build_runtime
    from aceso_megatron.profiler.memory import SavedTensors

    raw = {"model": model.model_dump(), "micro_batch_size": B, "global_batch_size": B,
           "stages": [{"num_gpus": 1, "tp": 1, "dp": 1, "start_unit": 0, "end_unit": 2, "recompute": ["none", rc]}]}
    rt = build_runtime(raw, 0, 1, seed=1)
    mlp_unit = rt.stage_module.units[1]
    torch.manual_seed(0)
    x = torch.randn(S, B, H, requires_grad=True)
    with SavedTensors(exclude=[x], params=list(rt.stage_module.parameters())) as saved:
        out = mlp_unit(x)
    out = out[0] if isinstance(out, tuple) else out
    kept = saved.nbytes
    out.square().sum().backward()
    return kept, x.grad


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_selective_mlp_frees_the_activation_output_and_keeps_gradients(single_process, activation):
    model = GPT.model_copy(update={"activation": activation, "add_bias_linear": activation == "gelu"})
    none, g_none = kept_bytes(model, "none")
    sel, g_sel = kept_bytes(model, "selective")
    full, g_full = kept_bytes(model, "full")
    act_out = S * B * FFN * 4  # the activation function's output, fp32, that selective recompute drops
    assert none - sel == act_out
    # the planner's activation model says the same (fp32, tp 1)
    from search.costmodel.memory import mlp_act_bytes

    a_none, a_sel, _ = mlp_act_bytes(model, b=B, s=S, t=1, dt=4.0)
    assert a_none - a_sel == act_out
    if activation == "swiglu":  # the f-wide tensors kept beyond a gelu MLP's, measured and modelled
        gelu = GPT.model_copy(update={"add_bias_linear": False})
        gelu_none, _, _ = mlp_act_bytes(gelu, b=B, s=S, t=1, dt=4.0)
        assert none - kept_bytes(gelu, "none")[0] == a_none - gelu_none == 3 * act_out
    assert full == 0  # only the unit input is kept (excluded here: it is the previous unit's output)
    torch.testing.assert_close(g_sel, g_none, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(g_full, g_none, rtol=1e-6, atol=1e-7)


# ----- attn_dropout: the dropout mask and the dropped probabilities, with attention dropout on ------------------
def stage_run(model: ModelSpec, rc: str) -> tuple[float, dict, int]:
    """Loss and full gradients of one forward/backward (seed 5) with ``rc`` on every attention unit (MLP units
    none), and the bytes the stage's forward keeps for backward (storages counted once, parameters excluded)."""
    from aceso_megatron.training.engine import build_runtime
    from aceso_megatron.profiler.memory import SavedTensors
    from aceso_megatron.testing import make_batches

    rcs = [rc if u.kind != "mlp" else "none" for u in model.units]
    raw = {"model": model.model_dump(), "micro_batch_size": B, "global_batch_size": B,
           "stages": [{"num_gpus": 1, "tp": 1, "dp": 1, "start_unit": 0, "end_unit": model.num_units,
                       "recompute": rcs}]}
    rt = build_runtime(raw, 0, 1, seed=5)
    batches = make_batches(model, B, B, seed=2)
    loss = rt.forward_backward(iter(batches))
    grads = rt.full_grads()
    b = batches[0]
    if model.is_t5:
        kw = {"enc_ids": b["enc_tokens"], "dec_ids": b["dec_tokens"], "labels": b["labels"]}
    else:
        kw = {"input_ids": b["tokens"], "position_ids": torch.arange(model.seq_length).expand_as(b["tokens"]),
              "labels": b["labels"]}
    with SavedTensors(params=list(rt.stage_module.parameters())) as saved:
        out = rt.stage_module(**kw)
    kept = saved.nbytes
    del out
    return loss, grads, kept


def score_elements(model: ModelSpec) -> int:
    """Attention-score elements (per sample and head) of all attention and cross-attention units."""
    s, sd = model.seq_length, model.decoder_seq_length
    if not model.is_t5:
        return model.num_layers * s * s
    return model.num_layers * s * s + model.num_decoder_layers * (sd * sd + sd * s)


@pytest.mark.parametrize("family", ["gpt", "t5"])
def test_attn_dropout_frees_mask_and_dropped_probs_with_equal_gradients(single_process, family):
    from tests.tiny_models import GPT as TINY_GPT
    from tests.tiny_models import T5 as TINY_T5

    base = TINY_GPT if family == "gpt" else TINY_T5
    model = base.model_copy(update={"attention_dropout": 0.1, "hidden_dropout": 0.1})
    loss, grads, kept = stage_run(model, "none")
    loss_rc, grads_rc, kept_rc = stage_run(model, "attn_dropout")
    # the same RNG: the recomputed dropout draws the forward's mask, so loss and gradients are those of none
    assert loss_rc == pytest.approx(loss, rel=1e-7, abs=0)
    assert set(grads_rc) == set(grads)
    for k, g in grads.items():
        torch.testing.assert_close(grads_rc[k], g, rtol=1e-6, atol=1e-8, msg=k)
    # dropout is on: without it the loss differs
    assert stage_run(base, "none")[0] != pytest.approx(loss, rel=1e-4)
    # freed per score element: the dropped probabilities (fp32) and the dropout mask. torch's CPU dropout keeps
    # its mask as a noise tensor of the input's dtype (4 bytes); on CUDA native_dropout keeps a 1-byte bool mask
    dtype_bytes, mask_bytes = 4, 4
    assert kept - kept_rc == B * model.num_attention_heads * score_elements(model) * (mask_bytes + dtype_bytes)


def test_attn_dropout_without_dropout_frees_nothing_and_keeps_gradients(single_process):
    from tests.tiny_models import GPT as TINY_GPT

    loss, grads, kept = stage_run(TINY_GPT, "none")
    loss_rc, grads_rc, kept_rc = stage_run(TINY_GPT, "attn_dropout")
    assert loss_rc == pytest.approx(loss, rel=1e-7) and kept_rc == kept
    for k, g in grads.items():
        torch.testing.assert_close(grads_rc[k], g, rtol=1e-6, atol=1e-8, msg=k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attn_dropout_core_equals_stock_core(single_process, dtype):
    """The recomputing core against megatron-core's ``DotProductAttention`` on the same inputs and RNG state:
    equal output and input gradients, and less kept by exactly the mask and the dropped probabilities (CPU: both
    of the dtype). bf16 with the softmax in fp32: the fp32 softmax output is kept either way, the bf16 copy not."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from aceso_megatron.model.attention import RecomputedDropoutAttention
    from aceso_megatron.profiler.memory import SavedTensors

    heads, dim = 4, 8
    cfg = TransformerConfig(num_layers=1, hidden_size=heads * dim, num_attention_heads=heads, attention_dropout=0.1,
                            bf16=dtype == torch.bfloat16, params_dtype=dtype, masked_softmax_fusion=False,
                            use_cpu_initialization=True)

    def run(cls):
        torch.manual_seed(0)
        q, k, v = (torch.randn(S, B, heads, dim, dtype=dtype, requires_grad=True) for _ in range(3))
        core = cls(cfg, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
        model_parallel_cuda_manual_seed(3)
        with SavedTensors(exclude=[q, k, v]) as saved:
            out = core(q, k, v, None)
        kept = saved.nbytes
        out.float().square().sum().backward()
        return out.detach(), [t.grad for t in (q, k, v)], kept

    out, grads, kept = run(DotProductAttention)
    out_rc, grads_rc, kept_rc = run(RecomputedDropoutAttention)
    torch.testing.assert_close(out_rc, out, rtol=0, atol=0)
    for g_rc, g in zip(grads_rc, grads):
        torch.testing.assert_close(g_rc, g, rtol=0, atol=0)
    size = torch.finfo(dtype).bits // 8
    assert kept - kept_rc == B * heads * S * S * (size + size)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_analytic_unfused_core_bytes_match_stock_core(single_process, dtype, dropout):
    """The planner's unfused attention core (``search.costmodel.memory.unfused_core_bytes``) keeps what
    megatron-core's ``DotProductAttention`` keeps (softmax in fp32, unfused), Q/K/V aside. On CPU torch's dropout
    mask is a noise tensor of the dtype; the model counts CUDA's 1-byte mask, so that difference is added here."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from aceso_megatron.profiler.memory import SavedTensors
    from search.costmodel.memory import unfused_core_bytes

    heads, dim = 4, 8
    cfg = TransformerConfig(num_layers=1, hidden_size=heads * dim, num_attention_heads=heads,
                            attention_dropout=dropout, bf16=dtype == torch.bfloat16, params_dtype=dtype,
                            masked_softmax_fusion=False, use_cpu_initialization=True)
    core = DotProductAttention(cfg, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    model_parallel_cuda_manual_seed(3)
    q, k, v = (torch.randn(S, B, heads, dim, dtype=dtype, requires_grad=True) for _ in range(3))
    with SavedTensors(exclude=[q, k, v]) as saved:
        out = core(q, k, v, None)
    measured = saved.nbytes
    del out
    size = torch.finfo(dtype).bits // 8
    model = GPT.model_copy(update={"num_attention_heads": heads, "attention_dropout": dropout})
    kept, dropped = unfused_core_bytes(model, B, S, S, 1, float(size))
    cpu_mask_extra = (size - 1) * heads * S * S * B if dropout else 0
    causal_mask = S * S   # megatron-core's cached bool mask, one per sequence length (not per unit or batch)
    assert measured == kept + cpu_mask_extra + causal_mask
    assert (dropped > 0) == (dropout > 0)
