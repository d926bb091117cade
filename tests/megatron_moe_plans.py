"""Megatron-LM-expressible MoE / MLA / MTP plans for the export / import round trip (issue 22): the presets at full
depth (DeepSeek-V3 with and without MTP, Qwen3-30B-A3B, Qwen3-235B-A22B, Mixtral) and tiny models with what the
presets lack (a 0/1 layer list, capacity factor, forced balance (a benchmark setting), MLA without q_lora, 2 MTP layers, biases),
over every dispatcher, ep / etp folding, even / first-last / layout splits (embedding- and loss-accounting ones of
the published Qwen3-235B rows), vpp, cp, every recompute setting and the MoE overlaps.

Built from ``MegatronConfig`` (Megatron-LM's terms), as tests/megatron_plans.py.
"""

from __future__ import annotations

from search.spec.cluster import parse_cluster
from search.megatron.build import plan_from_config
from search.megatron.config import MegatronConfig, Recompute
from search.megatron.layout import distribution
from search.spec.model import ModelSpec
from search.settings.moe_plan import MoEPlanSettings
from search.spec.presets import load_model
from tests.megatron_plans import config_fields

DSV3, DSV3N = load_model("deepseek-v3"), load_model("deepseek-v3-no-mtp")
QWEN30, QWEN235, MIXTRAL = load_model("qwen3-30b-a3b"), load_model("qwen3-235b-a22b"), load_model("mixtral-8x7b")
_TINY = dict(name="custom", family="llama", num_layers=4, hidden_size=256, num_attention_heads=8, ffn_hidden_size=512,
             seq_length=256, vocab_size=1000, activation="swiglu", normalization="rmsnorm", position_embedding="rope",
             tied_embeddings=False, add_bias_linear=False, params_dtype="bf16")
TINY_LIST = ModelSpec(**_TINY, moe={"num_experts": 8, "moe_router_topk": 2, "moe_ffn_hidden_size": 128,
                                    "moe_shared_expert_intermediate_size": 256, "moe_layer_freq": [1, 0, 1, 1],
                                    "moe_expert_capacity_factor": 1.5, "moe_pad_expert_input_to_capacity": True,
                                    "moe_router_force_load_balancing": True,
                                    "moe_aux_loss_coeff": 0.01})
TINY_MLA = ModelSpec(**{**_TINY, "kv_channels": 32}, megatron={"qk_layernorm": True}, mtp_num_layers=2,
                     mla={"kv_lora_rank": 64, "qk_head_dim": 32, "qk_pos_emb_head_dim": 16, "v_head_dim": 32},
                     moe={"num_experts": 16, "moe_router_topk": 4, "moe_ffn_hidden_size": 64, "moe_layer_freq": 1,
                          "first_k_dense_layers": 1, "moe_router_score_function": "sigmoid",
                          "moe_router_num_groups": 4, "moe_router_group_topk": 2,
                          "moe_router_enable_expert_bias": True})
TINY_GELU = ModelSpec(name="custom", family="gpt", num_layers=4, hidden_size=256, num_attention_heads=8,
                      ffn_hidden_size=1024, seq_length=256, vocab_size=1000, params_dtype="bf16",
                      moe={"num_experts": 4, "moe_router_topk": 1, "moe_ffn_hidden_size": 512})
NONE, SEL = Recompute(), Recompute("selective", modules=("core_attn",))
FULL, BLOCK1 = Recompute("full", "uniform", 1), Recompute("full", "block", 1)
UP_PROJ = Recompute("selective", modules=("moe_act", "mla_up_proj"))    # MLA: the plan's mla_up_proj units


def _moe(dispatcher="alltoall", gg=True, pf=True, **kw) -> MoEPlanSettings:
    return MoEPlanSettings(token_dispatcher=dispatcher, grouped_gemm=gg, permute_fusion=pf, **kw)


A2A, FLEX, AG = _moe(), _moe("flex"), _moe("allgather", gg=False, pf=False)
QWEN235_SPLIT = distribution(94, 4, 12, embedding_counts=True, loss_counts=True)    # the published rows' split
DSV3_LAYOUT = (4,) * 15 + (1,)                                                   # Et*4|(t*4|)*14tmL

# id -> (model, layers per model chunk, pp, vpp, tp, cp, dp, ep, etp, moe settings, recompute, mbs, gbs, extra)
MOE_CASES = {
    "qwen30-ep8": (QWEN30, (48,), 1, 1, 1, 1, 8, 8, 1, A2A, NONE, 4, 512, {}),
    "qwen30-pp2-vpp24": (QWEN30, (1,) * 48, 2, 24, 1, 1, 8, 8, 1, A2A, NONE, 2, 512, {}),
    "qwen30-cp2-flex": (QWEN30, (24, 24), 2, 1, 1, 2, 4, 8, None, FLEX, SEL, 1, 64, {}),
    "qwen235-pp4-vpp12-account-split": (QWEN235, QWEN235_SPLIT, 4, 12, 1, 1, 64, 16, 1, FLEX, NONE, 2, 8192, {}),
    "qwen235-tp2-pp8-ep32": (QWEN235, distribution(94, 8, 1, 10, 12), 8, 1, 2, 1, 16, 32, 1, A2A, NONE, 1, 2048,
                             {"sp": True, "distributed_optimizer": True, "overlap_grad_reduce": True,
                              "overlap_param_gather": True}),
    "dsv3-pp16-layout-mtp": (DSV3, DSV3_LAYOUT, 16, 1, 1, 1, 16, 8, 1, A2A, NONE, 1, 2048, {}),
    "dsv3-pp4-vpp4-layout-mtp-flex": (DSV3, DSV3_LAYOUT, 4, 4, 1, 1, 64, 64, 1, FLEX, NONE, 1, 4096, {}),
    "dsv3-pp8-vpp4-loss-only-flex": (DSV3N, (1,) + (2,) * 30 + (0,), 8, 4, 1, 1, 32, 32, 1, FLEX, NONE, 1, 2048,
                                     {}),                                 # Bridge's 'Et|(tt|)*30L' (25.11, GB200)
    "dsv3-pp8-first-last": (DSV3N, (5,) + (8,) * 7, 8, 1, 1, 1, 32, 32, 1, A2A, SEL, 1, 1024, {}),
    "dsv3-mtp-pp2-even-uniform-full": (DSV3, (30, 31), 2, 1, 1, 1, 64, 64, None, A2A, FULL, 1, 1024, {}),
    "mixtral-tp2-ep4-etp2-allgather": (MIXTRAL, (16, 16), 2, 1, 2, 1, 4, 4, 2, AG, NONE, 1, 64, {"sp": True}),
    "mixtral-pp4-vpp2-overlap-ep-comm": (MIXTRAL, (4,) * 8, 4, 2, 1, 1, 8, 8, None,
                                         _moe(overlap_ep_comm=True), SEL, 1, 64, {}),
    "mixtral-etp-default-tp4": (MIXTRAL, (32,), 1, 1, 4, 1, 2, 2, None, A2A, BLOCK1, 1, 16, {"sp": True}),
    "tiny-list-shared-overlap": (TINY_LIST, (2, 2), 2, 1, 1, 1, 4, 2, 1, _moe(shared_expert_overlap=True), SEL,
                                 1, 16, {}),
    "tiny-list-ep1-allgather-block": (TINY_LIST, (4,), 1, 1, 2, 1, 2, 1, None, AG, BLOCK1, 2, 16, {"sp": True}),
    "tiny-mla-mtp2-even-full": (TINY_MLA, (2, 2), 2, 1, 1, 1, 2, 2, 1, A2A, FULL, 1, 16, {}),
    "tiny-mla-mtp2-layout-selective": (TINY_MLA, (1, 3), 2, 1, 1, 1, 4, 4, None, FLEX, SEL, 1, 16, {}),
    "tiny-mla-mtp2-up-proj-moe-act": (TINY_MLA, (2, 2), 2, 1, 1, 1, 2, 2, 1, A2A, UP_PROJ, 1, 16, {}),
    "tiny-mla-mtp2-vpp2-block": (TINY_MLA, (1, 1, 1, 1), 2, 2, 1, 1, 2, 2, 1, _moe(pf=False), BLOCK1, 1, 16, {}),
    "tiny-mla-mtp2-vpp2-embedding-only": (TINY_MLA, (0, 2, 1, 1), 2, 2, 1, 1, 2, 2, 1, A2A, NONE, 1, 16, {}),
    "tiny-gelu-bias-ep4-flex": (TINY_GELU, (4,), 1, 1, 1, 1, 4, 4, 1, _moe("flex", gg=False), NONE, 1, 16, {}),
    "tiny-list-padded-flex-hybridep": (TINY_LIST, (4,), 1, 1, 1, 1, 4, 4, 1, _moe("flex", flex_backend="hybridep"),
                                       NONE, 1, 16, {}),       # megatron-core pads expert input with hybridep only
}


def moe_case_config(name: str) -> MegatronConfig:
    model, chunks, pp, vpp, tp, cp, dp, ep, etp, moe, rc, mbs, gbs, extra = MOE_CASES[name]
    extra = dict(extra)
    return MegatronConfig(model=model, tp=tp, pp=pp, cp=cp, dp=dp, vpp=vpp, sequence_parallel=extra.pop("sp", False),
                          chunk_layers=chunks, recompute=rc, micro_batch_size=mbs, global_batch_size=gbs, ep=ep,
                          etp=etp, **config_fields(extra, moe=moe))


def moe_case_plan(name: str):
    cfg = moe_case_config(name)
    ws = cfg.world_size
    return plan_from_config(cfg, cluster=parse_cluster(f"{max(1, ws // 8)}x{min(ws, 8)}-h100"))
