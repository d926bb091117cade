"""Architecture fields a converted model carries beyond the base flags, as Megatron-LM core_v0.16.1 flags (both ways)
and Megatron-Bridge ``model`` fields: the QKV bias, the norm epsilon, the top-k scaling factor, the init std and the
MTP loss weight of the ``megatron`` block, ``rotary_percent`` and ``rope_scaling`` (``search.spec.rope_scaling``).

Megatron-LM (``megatron/training/arguments.py``): ``--add-qkv-bias`` (``TransformerConfig.add_qkv_bias``; implied by
the linear biases: ``validate_args`` sets it unless ``--disable-bias-linear``), ``--norm-epsilon`` (``layernorm_epsilon``,
default 1e-5), ``--moe-router-topk-scaling-factor``, ``--init-method-std`` (0.02), ``--mtp-loss-scaling-factor``
(0.1), ``--rotary-percent`` (default 1.0), ``--use-rope-scaling``
``--rope-scaling-factor`` (default 8.0; standard attention only), and for multi-latent attention ``--rope-type``
(None: ``MLATransformerConfig``'s yarn), ``--rotary-scaling-factor`` (1.0), ``--mscale`` (1.0), ``--mscale-all-dim``
(0.0); YaRN at factor 1 is plain RoPE (``yarn_get_mscale`` is 1 and both frequency sets are equal). YaRN on standard
attention (core_v0.19.0 on: ``search.spec.rope_scaling``): ``--position-embedding-type yarn`` (``names.py`` writes
it) with ``--rotary-scaling-factor``, ``--yarn-original-max-position-embeddings``, ``--yarn-beta-fast``,
``--yarn-beta-slow``, ``--mscale``, ``--mscale-all-dim`` and ``--[no-]yarn-correction-range-round-to-int``, every one
written (``_apply_yarn_config_from_args`` defaults them as ``YarnRotaryEmbedding`` does). Hooked in through
``layer_variant_flags`` (its ``read`` / ``write`` / ``bridge`` / ``FLAG_KINDS`` carry these too).
"""

from __future__ import annotations

from search.spec import rope_scaling as rs
from search.spec.hf_arch import NORM_EPSILON   # megatron-core TransformerConfig.layernorm_epsilon (--norm-epsilon)
from search.io.errors import AcesoError

FLAG_KINDS: dict[str, str] = {"--add-qkv-bias": "bool", "--norm-epsilon": "float",
                              "--moe-router-topk-scaling-factor": "float", "--rotary-percent": "float",
                              "--use-rope-scaling": "bool", "--rope-scaling-factor": "float", "--rope-type": "str",
                              "--rotary-scaling-factor": "float", "--mscale": "float", "--mscale-all-dim": "float",
                              "--init-method-std": "float", "--mtp-loss-scaling-factor": "float",
                              "--yarn-original-max-position-embeddings": "int", "--yarn-beta-fast": "float",
                              "--yarn-beta-slow": "float", "--yarn-correction-range-round-to-int": "bool",
                              "--no-yarn-correction-range-round-to-int": "bool"}
ROUND, NO_ROUND = "--yarn-correction-range-round-to-int", "--no-yarn-correction-range-round-to-int"
# megatron block field -> Megatron-LM flag (a value flag; add_qkv_bias is a switch)
BLOCK_FLAGS = {"layernorm_epsilon": "--norm-epsilon", "moe_router_topk_scaling_factor": "--moe-router-topk-scaling-factor",
               "init_method_std": "--init-method-std", "mtp_loss_scaling_factor": "--mtp-loss-scaling-factor"}
# the block fields read back only where a command line states another value than Megatron-LM's default (a model at
# the default carries none, as for the norm epsilon): the weights' init std and the MTP loss weight (Nemotron-3
# Super's 0.014 and 0.3, which Megatron-Bridge's Nano recipe, its export's recipe, would otherwise set to its own)
STATED = {"init_method_std": 0.02, "mtp_loss_scaling_factor": 0.1}


def read(f) -> dict:
    """The ``ModelSpec`` fields the flags of ``f`` set: ``megatron`` entries, ``rotary_percent``, ``rope_scaling``."""
    block: dict = {}
    if f.has("--add-qkv-bias") and f.has("--disable-bias-linear"):
        block["add_qkv_bias"] = True
    eps = f.get("--norm-epsilon", NORM_EPSILON)
    if not 0 < eps < 1:
        raise AcesoError(f"--norm-epsilon {eps}: give a small positive number (below 1)")
    if eps != NORM_EPSILON:
        block["layernorm_epsilon"] = eps
    if f.has("--moe-router-topk-scaling-factor") and f.has("--num-experts"):
        block["moe_router_topk_scaling_factor"] = _positive(f, "--moe-router-topk-scaling-factor")
    for field, default in STATED.items():
        if f.get(BLOCK_FLAGS[field], default) != default:
            block[field] = _positive(f, BLOCK_FLAGS[field])
    out: dict = {"megatron": block} if block else {}
    percent = f.get("--rotary-percent", 1.0)
    if not 0 < percent <= 1:
        raise AcesoError(f"--rotary-percent {percent}: give a fraction in (0, 1]")
    if percent != 1.0:
        out["rotary_percent"] = percent
    out["rope_scaling"] = _rope_scaling(f)
    return out


def _rope_scaling(f) -> dict | None:
    mla = f.has("--multi-latent-attention")
    kind = f.get("--rope-type")
    if kind not in (None, "rope", "yarn"):
        raise AcesoError(f"--rope-type {kind}: use rope or yarn")
    if kind == "yarn" and not mla:
        raise AcesoError("--rope-type yarn without --multi-latent-attention: Megatron-LM asserts 'Common attention "
                         "only support rope_type=\"rope\"'; give --position-embedding-type yarn (core_v0.19.0 on)")
    if mla:
        factor = _positive(f, "--rotary-scaling-factor", 1.0)
        if kind == "rope" or factor <= 1.0:
            return None                  # YaRN at factor 1 is RoPE
        return rs.yarn(factor, mscale=f.get("--mscale", 1.0), mscale_all_dim=f.get("--mscale-all-dim", 0.0))
    if f.value("--position-embedding-type") == "yarn":
        return _standard_yarn(f)
    if f.has("--use-rope-scaling"):
        return {"type": "llama3", "factor": _positive(f, "--rope-scaling-factor", 8.0)}
    return None


def _standard_yarn(f) -> dict:
    """``--position-embedding-type yarn`` as ``_apply_yarn_config_from_args`` (core_v0.19.0) sets the config (an
    older release: refused, ``rs.megatron_lm_refusal`` says why)."""
    if f.release.version < rs.YARN_STANDARD_SINCE:
        raise AcesoError(f"--position-embedding-type yarn: {f.release.label} does not build YaRN on standard "
                         "attention (GPTModel's yarn_* config attributes are set from core_v0.19.0 on); read the "
                         "script with --megatron-version 0.19")
    if f.has(ROUND) and f.has(NO_ROUND):
        raise AcesoError(f"{ROUND} and {NO_ROUND} together: give one")
    orig = f.get("--yarn-original-max-position-embeddings", rs.YARN_DEFAULTS["original_max_position_embeddings"])
    if orig < 1:
        raise AcesoError(f"--yarn-original-max-position-embeddings {orig}: give a positive length")
    return rs.yarn(_positive(f, "--rotary-scaling-factor", 1.0), original_max_position_embeddings=orig,
                   beta_fast=_positive(f, "--yarn-beta-fast", rs.YARN_DEFAULTS["beta_fast"]),
                   beta_slow=_positive(f, "--yarn-beta-slow", rs.YARN_DEFAULTS["beta_slow"]),
                   mscale=f.get("--mscale", 1.0), mscale_all_dim=f.get("--mscale-all-dim", 0.0),
                   correction_range_round_to_int=not f.has(NO_ROUND))


def _positive(f, flag: str, default: float | None = None) -> float:
    v = f.get(flag, default)
    if not v > 0:
        raise AcesoError(f"{flag} {v}: give a positive factor")
    return v


def write(m) -> list[str]:
    """Megatron-LM flags of the fields a ``ModelSpec`` sets (none for a spec without them)."""
    block = m.megatron or {}
    out = ["--add-qkv-bias"] if block.get("add_qkv_bias") and not m.add_bias_linear else []
    out += [x for k, flag in BLOCK_FLAGS.items() if k in block for x in (flag, repr(float(block[k])))]
    if m.rotary_percent != 1.0:
        out += ["--rotary-percent", repr(float(m.rotary_percent))]
    r = m.rope_scaling
    if r is not None and r.type == "llama3":
        out += ["--use-rope-scaling", "--rope-scaling-factor", repr(float(r.factor))]
    elif r is not None and m.mla is None:      # --position-embedding-type yarn: names.py
        y = rs.yarn_config(m)
        out += ["--rotary-scaling-factor", repr(float(r.factor)), "--yarn-original-max-position-embeddings",
                str(y["yarn_original_max_position_embeddings"]), "--yarn-beta-fast", repr(float(y["yarn_beta_fast"])),
                "--yarn-beta-slow", repr(float(y["yarn_beta_slow"])), "--mscale", repr(float(y["yarn_mscale"])),
                "--mscale-all-dim", repr(float(y["yarn_mscale_all_dim"])),
                ROUND if y["yarn_correction_range_round_to_int"] else NO_ROUND]
    elif r is not None:
        out += ["--rope-type", "yarn", "--rotary-scaling-factor", repr(float(r.factor)), "--mscale",
                repr(float(r.yarn("mscale"))), "--mscale-all-dim", repr(float(r.yarn("mscale_all_dim")))]
    return out


def bridge(m) -> dict:
    """Megatron-Bridge ``model`` fields (``TransformerConfig`` / ``GPTModelProvider`` names) of the same fields."""
    block = m.megatron or {}
    out: dict = {k: block[k] for k in ("add_qkv_bias", *BLOCK_FLAGS) if k in block}
    # the norm epsilon always: a recipe of another model sets its own (the Qwen3 recipe, which runs every GPT MoE
    # model without MLA, 1e-6; Mixtral's and GPT-OSS's configs say 1e-5)
    out["layernorm_epsilon"] = block.get("layernorm_epsilon", NORM_EPSILON)
    if m.rotary_percent != 1.0:
        out["rotary_percent"] = m.rotary_percent
    r = m.rope_scaling
    if r is not None and r.type == "llama3":
        out.update(rope_scaling=True, rope_scaling_factor=r.factor)
    elif r is not None and m.mla is not None:
        out.update({k: v for k, v in rs.runtime_kwargs(m).items()})
    elif r is not None:             # YaRN on standard attention: the GPT-OSS recipes' provider runs it
        from .bridge import yarn_refusal
        if (why := yarn_refusal(m)) is not None:
            raise AcesoError(why)
        out.update(position_embedding_type="yarn", **rs.yarn_config(m))
    return out


def refusal(m) -> str | None:
    """Why no Megatron-LM release's flags express the model's RoPE scaling (None: some can; per release:
    ``release_refusal``)."""
    return rs.refusal(m)


def release_refusal(m, rel) -> str | None:
    """Why Megatron-LM ``rel`` (``versions.Release``) does not build the model's RoPE scaling (None: it does)."""
    return rs.megatron_lm_refusal(m, rel.version, rel.label)
