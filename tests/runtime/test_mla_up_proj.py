"""The plan's ``mla_up_proj`` choice as the runtime runs it: megatron-core 0.16.1's ``recompute_modules``
["mla_up_proj"] on an MLA attention unit (``MLASelfAttention``: a ``CheckpointWithoutOutput`` over its Q/K/V up
projections and RoPE, discarded once the core attention has run, re-materialised in backward).

Checked on a tiny MLA model on CPU in one process (fp32):
* loss and every gradient equal those of the same model without recompute, and those of megatron-core's own
  ``MLASelfAttention`` built from a ``TransformerConfig`` with ``recompute_modules=["mla_up_proj"]`` (stock
  megatron-core, not the plugin's unit) equal its own without;
* what the stage keeps for backward (saved-tensor hooks; a storage ``CheckpointWithoutOutput`` released counts 0)
  falls by exactly the core attention's Q, K and V, ``s b n (2 (dq + dr) + dv)`` elements per MLA layer (by hand),
  and the cost model's ``mla_act_bytes`` frees the same;
* stock megatron-core's ``MLASelfAttention`` (its local layer spec, the core as ``model_specs.mla_core`` builds
  it) with the module frees the same bytes, with equal output and gradients.
"""

from __future__ import annotations

import pytest
import torch

from search.spec.model import ModelSpec

S, B = 32, 2
MLA = {"q_lora_rank": 32, "kv_lora_rank": 16, "qk_head_dim": 16, "qk_pos_emb_head_dim": 8, "v_head_dim": 12}
MODEL = ModelSpec(name="t", family="llama", num_layers=2, hidden_size=80, num_attention_heads=4, ffn_hidden_size=96,
                  seq_length=S, vocab_size=250, params_dtype="fp32", activation="swiglu", normalization="rmsnorm",
                  position_embedding="rope", tied_embeddings=False, add_bias_linear=False, mla=MLA)
QKV = S * B * 4 * (2 * (16 + 8) + 12)      # Q, K (dq + dr wide per head) and V (dv) of one MLA layer, elements
# megatron-core's unfused RoPE (no apex / TE on CPU) saves its cos and sin tables, S x dr each, for q_pos_emb and
# k_pos_emb: freed with the up projections too (up to 4 per layer; per sequence, not per token: not priced)
ROPE_TABLES = 4 * S * 8 * 4


@pytest.fixture(scope="module")
def single_process():
    from aceso_megatron.testing import free_port
    from aceso_megatron.testing.reference import init_single_process

    init_single_process(free_port())


def kept_now(saved) -> int:
    """Bytes of the storages autograd still keeps, each once, keyed by where they live now: a storage
    ``CheckpointWithoutOutput`` released (resized to 0) counts 0, and another tensor the allocator later put at its
    old address counts on its own (``SavedTensors.nbytes`` keys them by the address at save time)."""
    live = {}
    for refs in saved.kept.values():
        for r in refs:
            if (k := r()) is not None:
                st = k.t.untyped_storage()
                if st.data_ptr():
                    live[st.data_ptr()] = st.nbytes()
    return sum(live.values())


def stage_run(rc: str):
    """Loss and gradients of one forward/backward with ``rc`` on every attention unit (MLP units none), and the
    bytes the stage's forward keeps for backward (parameters excluded)."""
    from aceso_megatron.profiler.memory import SavedTensors
    from aceso_megatron.testing import make_batches
    from aceso_megatron.training.engine import build_runtime

    rcs = [rc if u.kind == "attention" else "none" for u in MODEL.units]
    raw = {"model": MODEL.model_dump(), "micro_batch_size": B, "global_batch_size": B,
           "stages": [{"num_gpus": 1, "tp": 1, "dp": 1, "start_unit": 0, "end_unit": MODEL.num_units,
                       "recompute": rcs}]}
    rt = build_runtime(raw, 0, 1, seed=5)
    batches = make_batches(MODEL, B, B, seed=2)
    loss = rt.forward_backward(iter(batches))
    grads = rt.full_grads()
    b = batches[0]
    kw = {"input_ids": b["tokens"], "position_ids": torch.arange(S).expand_as(b["tokens"]), "labels": b["labels"]}
    with SavedTensors(params=list(rt.stage_module.parameters())) as saved:
        out = rt.stage_module(**kw)
    kept = kept_now(saved)
    del out
    return loss, grads, kept


def test_mla_up_proj_frees_q_k_v_with_equal_loss_and_gradients(single_process):
    loss, grads, kept = stage_run("none")
    loss_up, grads_up, kept_up = stage_run("mla_up_proj")
    assert loss_up == pytest.approx(loss, rel=1e-7, abs=0)
    assert set(grads_up) == set(grads)
    for k, g in grads.items():
        torch.testing.assert_close(grads_up[k], g, rtol=1e-6, atol=1e-8, msg=k)
    freed = kept - kept_up
    assert MODEL.num_layers * QKV * 4 <= freed <= MODEL.num_layers * (QKV * 4 + ROPE_TABLES)   # fp32: by hand
    # the cost model frees the same per MLA attention unit
    from search.spec.cluster import parse_cluster
    from search.costmodel.analytic import AnalyticSource
    from search.costmodel.comm import CommModel
    from search.spec.training import TrainingSpec

    cl = parse_cluster("1x1-cpu")
    src = AnalyticSource(MODEL, cl, TrainingSpec(global_batch_size=B, precision="fp32"), CommModel(cl))
    from search.costmodel.mla_mtp import mla_act_bytes

    none, _, _, _, up = mla_act_bytes(src, B, S, 1)
    assert none - up == QKV * src.dt == QKV * 4


def _stock_attention(recompute: bool):
    """megatron-core's own MLASelfAttention (local spec) from a TransformerConfig with or without the module."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    import torch.nn.functional as F
    kw = {"recompute_granularity": "selective", "recompute_modules": ["mla_up_proj"]} if recompute else {}
    cfg = MLATransformerConfig(num_layers=1, hidden_size=80, num_attention_heads=4, ffn_hidden_size=96,
                               add_bias_linear=False, normalization="RMSNorm", gated_linear_unit=True,
                               activation_func=F.silu, use_cpu_initialization=True, params_dtype=torch.float32,
                               multi_latent_attention=True, rope_type="rope", **MLA, **kw)
    # megatron-core's local MLA layer spec; its core cannot be built as specified in 0.16.1 (model_specs.mla_core:
    # the single-process reference uses the same stand-in core)
    from model_specs.mla_core import with_mla_core
    spec = with_mla_core(get_gpt_layer_local_spec(multi_latent_attention=True)).submodules.self_attention
    torch.manual_seed(0)
    return build_module(spec, config=cfg, layer_number=1), cfg


def _stock_run(recompute: bool):
    from aceso_megatron.profiler.memory import SavedTensors

    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(1)        # CheckpointWithoutOutput saves and restores its RNG states
    att, cfg = _stock_attention(recompute)
    torch.manual_seed(1)
    x = torch.randn(S, B, 80, requires_grad=True)
    mask = torch.triu(torch.ones(S, S, dtype=torch.bool), 1)[None, None]
    with SavedTensors(exclude=[x], params=list(att.parameters())) as saved:
        out, _ = att(x, mask)
    kept = kept_now(saved)
    out.square().sum().backward()
    return out.detach(), x.grad, {n: p.grad for n, p in att.named_parameters()}, kept


def test_stock_megatron_core_mla_up_proj_frees_the_same(single_process, monkeypatch):
    import megatron.core.transformer.multi_latent_attention as mla
    monkeypatch.setattr(mla, "HAVE_TE", False)       # 0.16.1 tests isinstance(x, TELinear) with TELinear None here
    from patches import mla_without_te
    mla_without_te.apply()
    out0, gx0, gp0, kept0 = _stock_run(False)
    out1, gx1, gp1, kept1 = _stock_run(True)
    torch.testing.assert_close(out1, out0)
    torch.testing.assert_close(gx1, gx0)
    for n, g in gp0.items():
        torch.testing.assert_close(gp1[n], g, msg=n)
    assert QKV * 4 <= kept0 - kept1 <= QKV * 4 + ROPE_TABLES
    # the plugin's unit frees what stock megatron-core's frees
    assert stage_run("none")[2] - stage_run("mla_up_proj")[2] == MODEL.num_layers * (kept0 - kept1)
