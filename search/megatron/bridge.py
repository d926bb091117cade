"""The plan as Megatron-Bridge recipe overrides (``aceso export --to megatron-bridge``), checked against v0.3.1.

Bridge builds a ``ConfigContainer`` from a recipe function (``megatron.bridge.recipes``) and merges overrides in
its structure: a YAML file (``process_config_with_overrides(cfg, config_filepath=...)``) or Hydra-style
``section.field=value`` arguments (``scripts/training/run_recipe.py --recipe NAME ...``). The recipe only supplies
what the plan does not set (optimizer, scheduler, data, logging): every model, parallel, recompute and batch field
of the plan is overridden (head width and query groups by value, so a recipe's own defaults cannot leak in). The activation function is a Python callable a YAML cannot set, so the recipe is chosen
by it: SwiGLU models start from a Llama recipe, GELU models from ``gpt3_175b_pretrain_config``; SwiGLU MoE models
from ``qwen3_30b_a3b_pretrain_config``, MLA models from ``deepseek_v3_pretrain_config`` (whose provider has the
MLA fields) and quick-GEGLU (GPT-OSS) models from a GPT-OSS recipe (whose provider runs YaRN on standard attention:
``GPT_OSS_RECIPES``); the router's pre-softmax, top-k scaling and dtype are always written (the model's and the
plan's), so the recipe's never stand in. T5: Bridge v0.3.1
has no T5 pretraining recipe (refused). bf16 is the recipes' default precision (no override); fp16 / fp32 set the
recipe's ``mixed_precision``, which the Llama recipes hold as a name and the GPT recipe as a config object.
Gradient reduction: ``ddp.grad_reduce_in_fp32`` is the plan's (``settings``), and ``mixed_precision`` says the same
(Bridge's ``mixed_precision.setup`` copies its own over the DDP one): the recipe's name where its default agrees
(``bf16_mixed``: fp32, ``fp16_mixed``: fp16), else a ``MixedPrecisionConfig`` object (``_target_``).
"""

from __future__ import annotations

import json
import re
import shlex

from search.io.errors import AcesoError
from search.spec.plan import ParallelPlan
from search.settings.precision import recipe
from .config import MegatronConfig
from .names import bridge_fields, comm_overlap_dp_fields
from .versions import release

# fields Bridge v0.3.1 holds as a property with a setter, not a dataclass field (data/bridge_fields_v0.3.1.json
# "settable"): a YAML merge sets them (setattr), its struct-mode Hydra CLI only with ++ (add or override)
FORCE_ADD = ("dataset.seq_length",)

# recipe -> how it holds mixed_precision ("name": a recipe name string; "object": a MixedPrecisionConfig)
RECIPES = {"llama3_8b_pretrain_config": "name", "llama3_70b_pretrain_config": "name",
           "llama2_7b_pretrain_config": "name", "gpt3_175b_pretrain_config": "object",
           "qwen3_30b_a3b_pretrain_config": "name", "deepseek_v3_pretrain_config": "object",
           # recipes/gpt_oss/gpt_oss.py: _pretrain_common's "bf16_mixed" (recipes/common.py:124), no comm_overlap
           "gpt_oss_20b_pretrain_config": "name", "gpt_oss_120b_pretrain_config": "name"}
# The GPT-OSS recipes (v0.3.1 recipes/gpt_oss/gpt_oss.py:25, 144) build their provider from the HF config
# (AutoBridge ... to_megatron_provider): activation_func quick_gelu (gpt_oss_bridge.py:89, a callable no YAML sets)
# and YaRN as transformers runs it: position_embedding_type yarn and the yarn_* attributes set on the provider
# (conversion/model_bridge.py:387-396 from rope_scaling, 449-459 setattr; gpt_oss_bridge.py:101-105: factor 32,
# original 4096, beta 32 / 1, round_to_int false; yarn_mscale / yarn_mscale_all_dim None, which megatron-core's
# _yarn_get_concentration_factor reads as 0.1 ln(factor) + 1, transformers' attention factor). A YAML override of a
# yarn_* attribute applies there (omegaconf_utils._apply_overrides sets what hasattr finds) and is skipped with a
# warning on any other recipe's provider, so only these recipes run a model's YaRN on standard attention.
GPT_OSS_RECIPES = ("gpt_oss_20b_pretrain_config", "gpt_oss_120b_pretrain_config")
# what the GPT-OSS providers set that a quick-GEGLU model without it must override (megatron-core's defaults)
_GPT_OSS_LAYER_DEFAULTS = {"window_size": None, "window_attn_skip_freq": None, "softmax_type": "vanilla",
                           "glu_linear_offset": 0.0, "activation_func_clamp_value": None}
# recipes with a comm_overlap section (CommOverlapConfig) in v0.3.1 whose TP overlap the YAML states (the plan's;
# the userbuffer config None: transformer-engine's default, since a recipe's is for one shape): the GPT recipe's
# (tp_comm_overlap on), llama2_7b's (off: recipes/llama/llama2.py:118) and llama3_70b's (on, with a userbuffer
# config for h8192 tp4: recipes/llama/llama3.py:737); llama3_8b and qwen3_30b_a3b have none (common.py:
# comm_overlap=None), deepseek_v3's also holds the EP overlap (below)
_TP_OVERLAP_SECTION = ("gpt3_175b_pretrain_config", "llama2_7b_pretrain_config", "llama3_70b_pretrain_config")
_DTYPES = {"bf16": "torch.bfloat16", "fp16": "torch.float16", "fp32": "torch.float32"}


def recipe_for(c: MegatronConfig) -> str:
    return _recipe_of(c.model)


def _recipe_of(m) -> str:
    if m.is_t5:
        raise AcesoError("--to megatron-bridge: Megatron-Bridge v0.3.1 has no T5 pretraining recipe; use "
                         "--to megatron-lm (pretrain_t5.py)")
    if m.activation == "gelu":
        return "gpt3_175b_pretrain_config"
    if m.activation == "quick_geglu":     # GPT-OSS's activation: only its recipes' provider has it
        return "gpt_oss_120b_pretrain_config" if m.name.startswith("gpt-oss-120b") else "gpt_oss_20b_pretrain_config"
    if m.mla is not None:           # its model is an MLAModelProvider (MLATransformerConfig + GPTModelProvider)
        return "deepseek_v3_pretrain_config"
    if m.moe is not None:
        return "qwen3_30b_a3b_pretrain_config"
    if m.name.startswith("llama3-70b"):
        return "llama3_70b_pretrain_config"
    return "llama2_7b_pretrain_config" if m.name.startswith("llama2") else "llama3_8b_pretrain_config"


# recipe -> its loss fusion's impl: every recipe the export writes sets ``cross_entropy_loss_fusion = True`` (as do
# the providers' defaults: v0.3.1 gpt_provider.py:185, mamba_provider.py:117; v0.6.0 gpt_provider.py:204,
# hybrid_provider.py:147) with this ``cross_entropy_fusion_impl``, the same at v0.3.1 and v0.6.0 (whose names are
# aliases of the *_h100_bf16 recipes): v0.3.1 recipes/llama/llama3.py:269-270 / 702-703, llama2.py:77-78,
# gpt/gpt3_175b.py:80-81, qwen/qwen3_moe.py:79-80, deepseek/deepseek_v3.py:134-135, nemotronh/nemotronh.py:89-90 /
# 190-191 / 293-294 / 396-397, nemotronh/nemotron_3_nano.py:89-90; v0.6.0 recipes/llama/h100/llama3.py:279-280 /
# 761-762, llama/h100/llama2.py:78-79, gpt/h100/gpt3_175b.py:91-92, qwen/h100/qwen3_moe.py:88-89,
# deepseek/h100/deepseek_v3.py:173-174, nemotronh/h100/nemotronh.py:124-125 / 261-262 / 402-403 / 544-545,
# nemotronh/h100/nemotron_3_nano.py:166-167; gpt_oss/gpt_oss.py:94-95 / 212-213 (v0.6.0 gpt_oss/h100/gpt_oss.py:109,
# 233). te is transformer-engine's parallel_cross_entropy (TE 2.2+; the
# containers Bridge runs in ship 2.7 to 2.14, search/settings/releases.py).
RECIPE_CE_FUSION = {"gpt_oss_20b_pretrain_config": "native", "gpt_oss_120b_pretrain_config": "native",
                    "llama3_8b_pretrain_config": "te", "llama3_70b_pretrain_config": "te",
                    "llama2_7b_pretrain_config": "native", "gpt3_175b_pretrain_config": "native",
                    "qwen3_30b_a3b_pretrain_config": "te", "deepseek_v3_pretrain_config": "te",
                    "nemotronh_4b_pretrain_config": "native", "nemotronh_8b_pretrain_config": "native",
                    "nemotronh_47b_pretrain_config": "native", "nemotronh_56b_pretrain_config": "native",
                    "nemotron_3_nano_pretrain_config": "native"}


def recipe_ce_fusion(model) -> str | None:
    """The ``cross_entropy_fusion_impl`` (the loss fused) of the recipe ``aceso export --to megatron-bridge`` writes
    ``model``'s YAML for, which a Bridge user keeps: what a Bridge-target plan is priced with (None: a T5 model,
    which no Bridge recipe runs)."""
    if model.is_t5:
        return None
    if model.mamba is not None:
        from .bridge_hybrid import recipe_for as hybrid_recipe
        return RECIPE_CE_FUSION[hybrid_recipe(model)]
    return RECIPE_CE_FUSION[_recipe_of(model)]


def with_recipe_loss(settings, own, model):
    """``settings`` (how Megatron-Bridge runs a plan whose own settings are ``own``: ``target_settings``) with the
    recipe's loss fusion (``recipe_ce_fusion``) where the plan is another framework's and states none: Bridge's
    default, as a Bridge-target search prices it. A Bridge plan's own settings are what its YAML states (a loss
    fusion or ``cross_entropy_loss_fusion: false``): kept."""
    if settings.framework != "megatron-bridge" or own.framework == "megatron-bridge" or \
            (settings.stack is not None and settings.stack.cross_entropy_fusion):
        return settings
    ce = recipe_ce_fusion(model)
    if ce is None:
        return settings
    from search.settings.stack import StackSettings
    stack = (settings.stack or StackSettings()).model_copy(update={"cross_entropy_fusion": ce})
    return settings.model_copy(update={"stack": stack})


def yarn_refusal(model) -> str | None:
    """Why the Bridge recipe ``model`` is written for would not run its YaRN on standard attention (None: it does,
    or the model has none): only the GPT-OSS recipes' provider holds the yarn_* attributes (``GPT_OSS_RECIPES``)."""
    from search.spec.rope_scaling import BRIDGE_REFUSAL, yarn_on_standard_attention
    if not yarn_on_standard_attention(model) or model.is_t5 or _recipe_of(model) in GPT_OSS_RECIPES:
        return None
    return BRIDGE_REFUSAL


def overrides(c: MegatronConfig) -> tuple[str, dict[str, object]]:
    """``(recipe, {section: {field: value} or a value for the whole section})``."""
    recipe = recipe_for(c)
    out: dict[str, object] = dict(bridge_fields(c))
    if recipe in GPT_OSS_RECIPES:       # the recipe's GPT-OSS layer never stands in for the model's
        model = out["model"]
        model.update({k: v for k, v in _GPT_OSS_LAYER_DEFAULTS.items() if k not in model})
        model.setdefault("num_moe_experts", None)
    if recipe in _TP_OVERLAP_SECTION:
        out["comm_overlap"] = {"tp_comm_overlap": c.settings.tp_comm_overlap, "tp_comm_overlap_cfg": None}
        if recipe == "gpt3_175b_pretrain_config":     # its embedding wgrad deferral
            out["comm_overlap"]["defer_embedding_wgrad_compute"] = c.pp > 1
    elif recipe == "deepseek_v3_pretrain_config":
        # its CommOverlapConfig(tp_comm_overlap=False) also holds the EP overlap, which Bridge copies to the model
        moe = c.settings.moe
        out["comm_overlap"] = {"tp_comm_overlap": c.settings.tp_comm_overlap, "overlap_moe_expert_parallel_comm":
                               bool(moe and moe.overlap_ep_comm)}
    elif c.settings.tp_comm_overlap:
        raise AcesoError(f"--to megatron-bridge: tp_comm_overlap needs a comm_overlap section, which v0.3.1's "
                         f"{recipe} does not have; set cfg.comm_overlap = CommOverlapConfig(tp_comm_overlap=True) "
                         "in Python, or export --to megatron-lm")
    if "comm_overlap" in out:       # its DP defaults would replace the plan's (names.comm_overlap_dp_fields)
        from .bridge_hybrid import BRIDGE_CORE
        out["comm_overlap"].update(comm_overlap_dp_fields(c, BRIDGE_CORE))
    mp = _mixed_precision(c, RECIPES[recipe])
    if mp is not _KEEP:
        out["mixed_precision"] = mp
    return recipe, out


_KEEP = object()
_NAME_DEFAULT = {"bf16": ("bf16_mixed", True), "fp16": ("fp16_mixed", False)}   # (recipe name, its grad fp32)


def _mixed_precision(c: MegatronConfig, held_as: str) -> object:
    """The ``mixed_precision`` override (``_KEEP``: none). Bridge's ``mixed_precision.setup`` copies its
    ``grad_reduce_in_fp32`` over ``ddp.grad_reduce_in_fp32``, so it must say the plan's gradient dtype too.
    ``held_as`` ``"whole"``: a whole ``MixedPrecisionConfig`` object whatever the recipe holds (a name or an
    object: Bridge v0.6.0's Nemotron recipes differ per GPU)."""
    fp32 = c.settings.grad_reduce_in_fp32 or c.precision == "fp32"
    if c.settings.low_precision is not None:
        return _low_precision_object(c, fp32, held_as)
    if held_as == "object":     # merged field by field into the recipe's MixedPrecisionConfig
        if c.precision == "bf16":
            return {"grad_reduce_in_fp32": fp32}
        dt = _DTYPES[c.precision]
        return {"bf16": False, "fp16": c.precision == "fp16", "params_dtype": dt, "pipeline_dtype": dt,
                "grad_reduce_in_fp32": fp32}
    if c.precision == "fp32":
        return None             # no mixed precision: ddp.grad_reduce_in_fp32 stands as written
    name, default = _NAME_DEFAULT[c.precision]
    if fp32 == default and held_as == "name":
        return _KEEP if c.precision == "bf16" else name
    dt = {"_target_": _DTYPES[c.precision], "_call_": False}    # the recipe's name replaced by a config object
    return {"_target_": "megatron.bridge.training.mixed_precision.MixedPrecisionConfig", c.precision: True,
            "params_dtype": dt, "pipeline_dtype": dt, "autocast_enabled": False, "grad_reduce_in_fp32": fp32}


def _low_precision_object(c: MegatronConfig, fp32: bool, held_as: str) -> dict:
    """A low-precision plan's ``mixed_precision``: Bridge's ``MixedPrecisionConfig`` fields of the recipe
    (``fp8``/``fp8_recipe`` or ``fp4``/``fp4_recipe``, ``fp8_param_gather``, the bf16 first/last layers), which
    ``mixed_precision.setup`` copies onto the model and DDP configs."""
    low = c.settings.low_precision
    if low.per_module:
        raise AcesoError("--to megatron-bridge: settings.low_precision.per_module is not written: Bridge v0.3.1's "
                         "model.quant_recipe holds a megatron-core RecipeConfig object, not a YAML mapping; export "
                         "--to megatron-lm (the script writes --te-precision-config-file)")
    r = recipe(low.recipe)
    fmt, name = r.flags[1], r.flags[3]
    out: dict[str, object] = {"grad_reduce_in_fp32": fp32}
    if r.gemm == "fp8":
        out.update({"fp8": fmt, "fp8_recipe": name, "fp8_param_gather": low.param_gather,
                    "fp8_param": low.param_gather})
        if low.reuse_grad_buf:
            out["reuse_grad_buf_for_mxfp8_param_ag"] = True
    else:
        out.update({"fp4": fmt, "fp4_recipe": name})
    if low.bf16_layers_start or low.bf16_layers_end:
        out.update({"first_last_layers_bf16": True, "num_layers_at_start_in_bf16": low.bf16_layers_start,
                    "num_layers_at_end_in_bf16": low.bf16_layers_end})
    if held_as == "object":
        return out
    dt = {"_target_": "torch.bfloat16", "_call_": False}
    return {"_target_": "megatron.bridge.training.mixed_precision.MixedPrecisionConfig", "bf16": True,
            "params_dtype": dt, "pipeline_dtype": dt, "autocast_enabled": False, **out}


def _value(v: object) -> str:
    """A Hydra override / YAML scalar."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, list):
        return "[" + ",".join(_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {_value(x)}" for k, x in v.items()) + "}"     # YAML / Hydra flow mapping
    s = str(v)
    return s if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.\-]*", s) and s not in ("null", "true", "false") \
        else json.dumps(s)


def _items(ov: dict[str, object]):
    for section, fields in ov.items():
        if not isinstance(fields, dict) or "_target_" in fields:
            yield section, fields
            continue
        for k, v in fields.items():
            yield f"{section}.{k}", v


def cli_overrides(c: MegatronConfig, made: tuple[str, dict] | None = None) -> str:
    """``--recipe NAME section.field=value ...`` for ``scripts/training/run_recipe.py``, shell-quoted, one line;
    ``made``: ``(recipe, overrides)`` made elsewhere (a hybrid model's, ``bridge_hybrid.py``)."""
    recipe, ov = made or overrides(c)
    return shlex.join(["--recipe", recipe] + [f"{'++' if k in FORCE_ADD else ''}{k}={_value(v)}"
                                              for k, v in _items(ov)]) + "\n"


def write_yaml(plan: ParallelPlan, c: MegatronConfig, source: str, made: tuple[str, dict] | None = None,
               bridge: tuple[str, str] = ("Megatron-Bridge v0.3.1", "0.16")) -> str:
    """The overrides as a YAML file; ``bridge``: (the Bridge release, the megatron-core it runs) they are for."""
    from .. import __version__
    from .script import header
    recipe, ov = made or overrides(c)
    gpn, nodes = (plan.cluster.gpus_per_node, plan.cluster.num_nodes) if plan.cluster else (c.world_size, 1)
    intro = f"Megatron-Bridge overrides written by aceso {__version__} from {source}."
    lines = [f"# {h}" for h in [intro] + header(plan, c, source, release(bridge[1]))[2:]] + [
        f"# {bridge[0]} overrides (ConfigContainer structure; it runs megatron-core {bridge[1]}) for the recipe "
        f"megatron.bridge.recipes.{recipe}.",
        "# Python: cfg = process_config_with_overrides(" + recipe + "(), config_filepath=\"THIS.yaml\")",
        f"# CLI: torchrun --nproc-per-node {gpn} --nnodes {nodes} scripts/training/run_recipe.py "
        "$(aceso export PLAN --to megatron-bridge --args-only)",
        "# Data: the recipe's (mock data); tokenizer: NullTokenizer with the plan's vocabulary. Replace both with yours."]
    for section, fields in ov.items():
        if not isinstance(fields, dict):
            lines.append(f"{section}: {_value(fields)}")
            continue
        lines.append(f"{section}:")
        lines += [f"  {k}: {_value(v)}" for k, v in fields.items()]
    return "\n".join(lines) + "\n"
