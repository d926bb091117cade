"""Megatron-LM-expressible plans for the export / import round trip and the megatron-core checks (GPT, Llama,
GPT-OSS's layer fields, T5; pp 1-8, VPP, SP, CP, uneven first/last and layout splits, every recompute setting,
precisions, local layers).

Built from ``MegatronConfig`` (Megatron-LM's own terms), so each case says which Megatron-LM form it exercises.
"""

from __future__ import annotations

from search.spec.cluster import parse_cluster
from search.megatron.build import plan_from_config
from search.megatron.config import MegatronConfig, Recompute
from search.settings.plan_settings import PlanSettings
from search.spec.presets import load_model
from tests.tiny_models import GPT as TINY_GPT
from tests.tiny_models import LLAMA as TINY_LLAMA

GPT8, GPT12 = load_model("gpt-1.3b", num_layers=8), load_model("gpt-1.3b", num_layers=12)
LLAMA8, LLAMA12 = load_model("llama3-8b", num_layers=8), load_model("llama3-8b", num_layers=12)
T5 = load_model("t5-770m", num_layers=4)
# GPT-OSS's layer fields on a dense model (search.layers.layer_variants): sliding window on every 2nd layer, learnable
# softmax offset, clamped quick-GEGLU with offset, biases, head_dim 64 != hidden / heads
OSS8 = LLAMA8.model_copy(update={"name": "custom", "aceso_db_key": None, "activation": "quick_geglu",
                                 "glu_linear_offset": 1.0, "activation_func_clamp_value": 7.0,
                                 "softmax_type": "learnable", "window_size": [127, 0], "window_attn_skip_freq": 2,
                                 "add_bias_linear": True, "kv_channels": 64})
NONE, SEL, FULL = Recompute(), Recompute("selective", modules=("core_attn",)), Recompute("full", "uniform", 1)


def block(n: int) -> Recompute:
    return Recompute("full", "block", n)


# id -> (model, layers per model chunk, pp, vpp, tp, cp, dp, recompute, per-rank micro-batch, global batch, extra)
CASES = {
    "gpt-pp1-dp8": (GPT8, (8,), 1, 1, 1, 1, 8, NONE, 1, 64, {}),
    "gpt-pp2-selective": (GPT8, (4, 4), 2, 1, 2, 1, 2, SEL, 2, 64, {}),
    "gpt-pp2-first-layers-full": (GPT8, (3, 5), 2, 1, 1, 1, 4, FULL, 1, 64, {}),
    "gpt-pp4-layout-block1": (GPT8, (1, 2, 3, 2), 4, 1, 2, 1, 1, block(1), 4, 64, {}),
    "gpt-pp4-vpp2-sp": (GPT8, (1,) * 8, 4, 2, 2, 1, 1, NONE, 2, 64, {"sp": True}),
    "gpt-pp8-full": (GPT8, (1,) * 8, 8, 1, 1, 1, 1, FULL, 2, 64, {}),
    "gpt-pp3-first": (GPT8, (2, 3, 3), 3, 1, 1, 1, 2, NONE, 2, 96, {}),
    "gpt-pp3-first-last": (GPT8, (3, 2, 3), 3, 1, 2, 1, 1, SEL, 1, 96, {}),
    "gpt-pp3-last": (GPT8, (2, 2, 4), 3, 1, 1, 1, 1, block(2), 4, 96, {}),
    "gpt-pp2-vpp2-layout-block2": (GPT8, (1, 3, 2, 2), 2, 2, 2, 1, 2, block(2), 1, 64, {}),
    "gpt-cp2-sp-distopt": (GPT8, (4, 4), 2, 1, 2, 2, 1, NONE, 2, 64,
                           {"sp": True, "distributed_optimizer": True, "overlap_grad_reduce": True,
                            "overlap_param_gather": True}),
    "gpt-fp32-local": (GPT8.model_copy(update={"params_dtype": "fp32"}), (4, 4), 2, 1, 1, 1, 2, FULL, 1, 32,
                       {"attention": "unfused"}),
    "gpt-pp2-vpp3-layout": (GPT12, (2, 1, 3, 2, 2, 2), 2, 3, 1, 1, 4, NONE, 1, 64, {}),
    "llama-pp1-tp4-sp-block2": (LLAMA8, (8,), 1, 1, 4, 1, 2, block(2), 1, 64, {"sp": True}),
    "llama-pp2-vpp2-layout-selective": (LLAMA8, (2, 1, 3, 2), 2, 2, 2, 1, 2, SEL, 1, 64,
                                        {"distributed_optimizer": True, "overlap_grad_reduce": True}),
    "llama-pp4-tp-comm-overlap": (LLAMA8, (2, 2, 2, 2), 4, 1, 2, 1, 1, FULL, 1, 64,
                                  {"sp": True, "tp_comm_overlap": True, "attention": "flash"}),
    "llama-pp2-first-cp2": (LLAMA8, (5, 3), 2, 1, 1, 2, 2, NONE, 1, 64, {}),
    "llama-pp4-vpp2-first-last": (LLAMA12, (2, 1, 1, 2, 2, 1, 1, 2), 4, 2, 1, 1, 2, NONE, 1, 64, {}),
    "llama-fp16-pp4-vpp2": (LLAMA8.model_copy(update={"params_dtype": "fp16"}), (1,) * 8, 4, 2, 2, 1, 1, SEL,
                            1, 32, {}),
    "oss-pp2-window-selective": (OSS8, (4, 4), 2, 1, 2, 1, 2, SEL, 1, 64, {"attention": "flash"}),
    "gpt-pp2-vpp2-layout-embedding-loss-only": (GPT8, (0, 4, 4, 0), 2, 2, 1, 1, 4, NONE, 1, 64, {}),  # E|t*4|t*4|L
    "llama-pp2-layout-embedding-only": (LLAMA8, (0, 8), 2, 1, 2, 1, 2, SEL, 1, 64, {}),             # E|t*8L
    "gpt-pp4-layout-loss-only-full": (GPT8, (3, 3, 2, 0), 4, 1, 1, 1, 2, FULL, 1, 64, {}),         # ...|t*2|L
    "tiny-gpt-pp2": (TINY_GPT, (1, 1), 2, 1, 2, 1, 1, FULL, 2, 16, {}),
    "tiny-llama-gqa-selective": (TINY_LLAMA, (2,), 1, 1, 2, 1, 2, SEL, 2, 16, {"sp": True}),
    "t5-tp2": (T5, (8,), 1, 1, 2, 1, 4, NONE, 1, 64, {}),
    "t5-selective-sp": (T5, (8,), 1, 1, 2, 1, 4, SEL, 1, 64, {"sp": True}),
    "t5-block1": (T5, (8,), 1, 1, 1, 1, 8, block(1), 1, 64, {}),
    "t5-fp32-full": (T5.model_copy(update={"params_dtype": "fp32"}), (8,), 1, 1, 4, 1, 2, FULL, 2, 64, {}),
}


def case_config(name: str) -> MegatronConfig:
    model, chunks, pp, vpp, tp, cp, dp, rc, mbs, gbs, extra = CASES[name]
    extra = dict(extra)
    return MegatronConfig(model=model, tp=tp, pp=pp, cp=cp, dp=dp, vpp=vpp, sequence_parallel=extra.pop("sp", False),
                          chunk_layers=chunks, recompute=rc, micro_batch_size=mbs, global_batch_size=gbs,
                          **config_fields(extra))


def config_fields(extra: dict, **settings) -> dict:
    """``MegatronConfig`` keywords from a case's extras: its plan-wide switches (``PlanSettings`` fields) in the
    one ``settings`` record, the rest as they are."""
    switches = {k: extra.pop(k) for k in list(extra) if k in PlanSettings.model_fields}
    return {**extra, "settings": PlanSettings(framework="megatron-lm", **switches, **settings)}


def case_plan(name: str, with_cluster: bool = True):
    """The case's plan, on H100 nodes of up to 8 GPUs (with the analytic prediction when the case names the
    attention kernel)."""
    cfg = case_config(name)
    ws = cfg.world_size
    cluster = parse_cluster(f"{max(1, ws // 8)}x{min(ws, 8)}-h100") if with_cluster else None
    plan = plan_from_config(cfg, cluster=cluster)
    if cfg.attention and cluster:          # the kernel a plan assumed is recorded with its prediction
        from search.cli.import_cmd import predict
        plan = plan.model_copy(update={"predicted": predict(plan, cfg.attention)})
    return plan
