"""Our MoE / MLA / MTP parameter counts (search.layers.moe_params) equal what megatron-core 0.16.1 allocates: tiny models
with every structural feature of the presets (GQA, q/k norms, biases, dense-first and every-N-th MoE layers,
shared experts, MLA with and without the query down-projection, an MTP layer, GPT-OSS's learnable softmax offset,
quick-GEGLU and kv_channels != hidden / heads) built as ``GPTModel`` with megatron-core's local block spec
(``get_gpt_decoder_block_spec``, SequentialMLP experts) on CPU in one process; the count is the sum of the model's
parameter numels. Then every MoE preset at full width on the meta device, and which layers megatron-core builds
with a sliding window against ``search.layers.layer_variants``.

The ModelSpec -> TransformerConfig translation below is this test's own, written from megatron-core's field names
(the runtime builds MoE stages: docs/runtime.md)."""

import pytest
import torch
import torch.nn.functional as F

from search.spec.model import ModelSpec
from search.layers.moe_params import counts

BASE = {"num_layers": 3, "hidden_size": 64, "num_attention_heads": 4, "ffn_hidden_size": 96, "seq_length": 32,
        "vocab_size": 250, "params_dtype": "fp32"}
LLAMA = {**BASE, "family": "llama", "activation": "swiglu", "normalization": "rmsnorm", "position_embedding": "rope",
         "tied_embeddings": False, "add_bias_linear": False}
MOE = {"num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 24}
MLA = {"q_lora_rank": 32, "kv_lora_rank": 16, "qk_head_dim": 16, "qk_pos_emb_head_dim": 8, "v_head_dim": 12}
CASES = {
    "mixtral-like": {**LLAMA, "num_query_groups": 2, "moe": MOE},
    "qwen3-like": {**LLAMA, "num_query_groups": 2, "kv_channels": 32, "megatron": {"qk_layernorm": True},
                   "moe": {**MOE, "num_experts": 8, "moe_router_topk": 4}},
    "gpt-bias-every-2nd": {**BASE, "family": "gpt", "moe": {**MOE, "moe_layer_freq": 2}},
    "deepseek-like": {**LLAMA, "megatron": {"qk_layernorm": True}, "mla": MLA, "mtp_num_layers": 1,
                      "moe": {**MOE, "moe_shared_expert_intermediate_size": 48, "first_k_dense_layers": 1,
                              "moe_router_score_function": "sigmoid", "moe_router_num_groups": 2,
                              "moe_router_group_topk": 1, "moe_router_enable_expert_bias": True}},
    # Qwen2-MoE: q/k/v biases, a shared expert scaled by its sigmoid gate (one 1 x h weight per MoE layer)
    "qwen2-moe-like": {**LLAMA, "megatron": {"add_qkv_bias": True},
                       "moe": {**MOE, "moe_shared_expert_intermediate_size": 48, "moe_shared_expert_gate": True}},
    "mla-no-q-lora-listed": {**LLAMA, "mla": {**MLA, "q_lora_rank": None}, "moe": {**MOE, "moe_layer_freq": [1, 0, 1]}},
    # GPT-OSS: head_dim != hidden / heads, biases on attention, router and experts, learnable softmax offset,
    # quick-GEGLU with offset and clamp, sliding window on every 2nd layer (search.layers.layer_variants)
    "gpt-oss-like": {**LLAMA, "add_bias_linear": True, "num_query_groups": 2, "kv_channels": 8,
                     "activation": "quick_geglu", "glu_linear_offset": 1.0, "activation_func_clamp_value": 7.0,
                     "softmax_type": "learnable", "window_size": [7, 0], "window_attn_skip_freq": 2, "moe": MOE},
}


@pytest.fixture(scope="module")
def single_process():
    from aceso_megatron.testing import free_port
    from aceso_megatron.testing.reference import init_single_process

    init_single_process(free_port())


def _config(m: ModelSpec):
    """rope_type rope for MLA: yarn (the default) only rescales, adds no parameter, and builds on the GPU."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    from megatron.core.activations import quick_gelu

    act = {"swiglu": F.silu, "quick_geglu": quick_gelu}.get(m.activation, F.gelu)
    kw = dict(num_layers=m.num_layers, hidden_size=m.hidden_size, num_attention_heads=m.num_attention_heads,
              num_query_groups=m.num_query_groups, kv_channels=m.kv_channels, ffn_hidden_size=m.ffn_hidden_size,
              add_bias_linear=m.add_bias_linear, normalization="RMSNorm" if m.normalization == "rmsnorm" else "LayerNorm",
              gated_linear_unit=m.gated_mlp, activation_func=act, use_cpu_initialization=True,
              params_dtype=torch.float32, **(m.megatron or {}))
    for f in ("window_attn_skip_freq", "softmax_type", "glu_linear_offset", "activation_func_clamp_value"):
        if getattr(m, f) is not None:
            kw[f] = getattr(m, f)
    if m.window_size is not None:
        kw["window_size"] = tuple(m.window_size)
    if m.moe is not None:
        e = m.moe
        kw.update(num_moe_experts=e.num_experts, moe_router_topk=e.moe_router_topk,
                  moe_ffn_hidden_size=e.moe_ffn_hidden_size,
                  moe_shared_expert_intermediate_size=e.moe_shared_expert_intermediate_size,
                  moe_shared_expert_gate=e.moe_shared_expert_gate,
                  moe_layer_freq=e.moe_layer_freq if isinstance(e.moe_layer_freq, list) or not e.first_k_dense_layers
                  else [int(e.is_moe_layer(i)) for i in range(m.num_layers)],
                  moe_router_score_function=e.moe_router_score_function, moe_router_num_groups=e.moe_router_num_groups,
                  moe_router_group_topk=e.moe_router_group_topk,
                  moe_router_enable_expert_bias=e.moe_router_enable_expert_bias, moe_grouped_gemm=False,
                  moe_token_dispatcher_type="allgather")   # alltoall makes a CUDA stream
    if m.mtp_num_layers:
        kw["mtp_num_layers"] = m.mtp_num_layers
    if m.mla is None:
        return TransformerConfig(**kw)
    a = m.mla
    return MLATransformerConfig(**kw, multi_latent_attention=True, rope_type="rope", q_lora_rank=a.q_lora_rank,
                                kv_lora_rank=a.kv_lora_rank, qk_head_dim=a.qk_head_dim,
                                qk_pos_emb_head_dim=a.qk_pos_emb_head_dim, v_head_dim=a.v_head_dim)


class _CoreStandIn(torch.nn.Module):
    """megatron-core's local DotProductAttention takes no MLA ``k_channels`` (only TE's does); the core attention
    holds no parameters, so a parameter-free stand-in leaves the count as it is."""

    def __init__(self, *args, **kwargs):
        super().__init__()


def _mla_core_stand_in(spec) -> None:
    for layer in spec.layer_specs:
        layer.submodules.self_attention.submodules.core_attention = _CoreStandIn


def _megatron_model(m: ModelSpec, monkeypatch):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_mtp_block_spec

    cfg = _config(m)
    # megatron-core 0.16.1 allocates the learnable softmax_offset on torch.cuda.current_device(): here, the CPU
    # (or the meta device the caller builds on)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: torch.get_default_device())
    spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False)
    if m.mla is not None:
        _mla_core_stand_in(spec)
        import megatron.core.transformer.multi_latent_attention as mla   # 0.16.1 tests isinstance(x, TELinear)
        monkeypatch.setattr(mla, "HAVE_TE", False)                       # with TELinear None here
    mtp = get_gpt_mtp_block_spec(cfg, spec, use_transformer_engine=False) if m.mtp_num_layers else None
    model = GPTModel(cfg, spec, vocab_size=m.padded_vocab_size, max_sequence_length=m.seq_length,
                     position_embedding_type="rope" if m.position_embedding == "rope" else "learned_absolute",
                     share_embeddings_and_output_weights=m.tied_embeddings, mtp_block_spec=mtp)
    return model


def _megatron_numel(m: ModelSpec, monkeypatch) -> int:
    return sum(p.numel() for p in _megatron_model(m, monkeypatch).parameters())


@pytest.mark.parametrize("name", sorted(CASES))
def test_count_equals_megatron_core_numel(single_process, name, monkeypatch):
    m = ModelSpec.model_validate({"name": name, **CASES[name]})
    assert counts(m).total == _megatron_numel(m, monkeypatch)


# Each MoE preset at full width on the meta device (no memory), cut to the fewest layers that keep every layer kind
# it has: its dense-first layers, one MoE layer, and the MTP layer. Counts are linear in the layers of each kind, so
# these fix the count of the whole preset.
PRESET_DEPTH = {"mixtral-8x7b": 1, "mixtral-8x22b": 1, "qwen3-30b-a3b": 1, "qwen3-235b-a22b": 1, "deepseek-v3": 4,
                "deepseek-v3-no-mtp": 4, "kimi-k2": 2, "gpt-oss-120b": 2, "gpt-oss-20b": 2}


@pytest.mark.parametrize("name", sorted(PRESET_DEPTH))
def test_preset_count_equals_megatron_core_at_full_width(single_process, name, monkeypatch):
    from search.spec.presets import load_model

    m = load_model(name, num_layers=PRESET_DEPTH[name])
    with torch.device("meta"):
        assert counts(m).total == _megatron_numel(m, monkeypatch)


@pytest.mark.parametrize("freq", [None, 2, 3, [0, 1, 1, 0, 1]])
def test_window_layers_are_megatron_cores(single_process, freq, monkeypatch):
    """The layers ``layer_variants.is_window_layer`` windows are the ones megatron-core builds with a window."""
    from search.layers.layer_variants import is_window_layer

    spec = {**CASES["gpt-oss-like"], "num_layers": 5, "window_attn_skip_freq": freq}
    m = ModelSpec.model_validate({"name": "w", **spec})
    built = [layer.self_attention.core_attention.scale_mask_softmax.window_size
             for layer in _megatron_model(m, monkeypatch).decoder.layers]
    assert [w is not None for w in built] == [is_window_layer(m, i) for i in range(5)]
    assert {w for w in built if w is not None} == {(7, 0)}

