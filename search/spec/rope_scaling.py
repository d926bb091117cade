"""RoPE scaling (``ModelSpec.rope_scaling``): Llama 3.x's frequency scaling and YaRN, in megatron-core's terms.

- ``llama3``: ``GPTModel(rope_scaling=True, rope_scaling_factor=factor)``; ``RotaryEmbedding._apply_scaling`` divides
  the low frequencies by ``factor`` and interpolates the middle band with its fixed ``low_freq_factor`` 1,
  ``high_freq_factor`` 4 and ``original_max_position_embeddings`` 8192 (Llama 3.1 / 3.2 / 3.3's values; a Hugging Face
  config with others is refused by the import). Megatron-LM ``--use-rope-scaling --rope-scaling-factor F``,
  Megatron-Bridge ``model.rope_scaling`` / ``model.rope_scaling_factor``.
- ``yarn`` with multi-latent attention: ``MLATransformerConfig`` ``rope_type`` yarn with ``rotary_scaling_factor``,
  ``original_max_position_embeddings``, ``beta_fast``, ``beta_slow``, ``mscale``, ``mscale_all_dim`` (DeepSeek-V3's
  40 / 4096 / 32 / 1 / 1.0 / 1.0). Megatron-LM (every release: ``core_transformer_config_from_args`` fills the
  config by the flags' names) writes ``--rope-type yarn --rotary-scaling-factor --mscale --mscale-all-dim`` and has no
  flag for the other three (``MLATransformerConfig``'s 4096 / 32 / 1 run): other values are refused for Megatron-LM
  with one line (``refusal``). MLA's ``YarnRotaryEmbedding`` always rounds the correction range (it is not passed
  ``correction_range_round_to_int``), so ``correction_range_round_to_int`` false is refused with MLA.
- ``yarn`` on standard attention (GPT-OSS): ``GPTModel(position_embedding_type="yarn")``, which builds
  ``YarnRotaryEmbedding`` from the config attributes ``yarn_rotary_scaling_factor``,
  ``yarn_original_max_position_embeddings``, ``yarn_beta_fast``, ``yarn_beta_slow``, ``yarn_mscale``,
  ``yarn_mscale_all_dim`` and ``yarn_correction_range_round_to_int`` (megatron-core 0.16.1 to 0.19.2; no
  ``TransformerConfig`` field holds them, ``getattr`` without a default reads them), and scales cos / sin by the
  concentration factor ``yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim)`` (attention.py
  ``_yarn_get_concentration_factor_from_config``). Megatron-LM sets those attributes from core_v0.19.0 on
  (``argument_utils._apply_yarn_config_from_args``: ``--position-embedding-type yarn``, ``--rotary-scaling-factor``,
  ``--yarn-original-max-position-embeddings``, ``--yarn-beta-fast``, ``--yarn-beta-slow``, ``--mscale``,
  ``--mscale-all-dim``, ``--[no-]yarn-correction-range-round-to-int``); core_v0.16.1 and core_v0.17.1 reject the
  position type (argparse choices) and assert ``rope_type`` rope, core_v0.18.2 takes the position type but sets no
  ``yarn_*`` attribute (``GPTModel`` raises AttributeError): ``megatron_lm_refusal`` names the release to use.
  ``YarnRotaryEmbedding`` computes its frequencies over all ``kv_channels`` whatever ``rotary_percent`` says, so
  partial rotary with YaRN is refused (``check``).

What it costs: nothing. The rotary tables are computed once per sequence length, and YaRN's ``mscale`` scales cos and
sin (a concentration factor folded into the tables) or the softmax scale, not the work, so time and memory are the
unscaled RoPE's (Megatron-LM turns rope fusion off for ``--position-embedding-type yarn``; the cost model prices
RoPE's element-wise traffic the same with or without the fusion).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

# megatron-core 0.16.1: RotaryEmbedding._apply_scaling's fixed band (llama3) and MLATransformerConfig's YaRN defaults
LLAMA3_BAND = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
YARN_DEFAULTS = {"original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0,
                 "mscale_all_dim": 0.0}
YARN_FIELDS = ("original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")
NO_MLA_FLAG = ("original_max_position_embeddings", "beta_fast", "beta_slow")   # no Megatron-LM flag sets MLA's
YARN_STANDARD_SINCE = (0, 19)     # the first Megatron-LM release that sets GPTModel's yarn_* config attributes
# Megatron-Bridge v0.3.1: the Llama, GPT and Qwen3-MoE recipes aceso writes for a standard-attention model other than
# GPT-OSS's quick GEGLU (search.megatron.bridge.recipe_for) build a provider with no yarn_* attributes
# (search/megatron/data/bridge_fields_v0.3.1.json), so Bridge skips such overrides; the GPT-OSS recipes' provider
# has them and runs the model's YaRN (search.megatron.bridge.yarn_refusal)
BRIDGE_REFUSAL = ("model.rope_scaling (type yarn, standard attention): the Megatron-Bridge v0.3.1 recipe aceso "
                  "writes for this model (Llama, GPT or Qwen3-MoE; only the GPT-OSS recipes' provider holds the yarn_* "
                  "fields) would skip them and train plain RoPE; use --target / --to megatron-lm (Megatron-LM "
                  "core_v0.19.0) or --target aceso (the aceso runtime)")


class RopeScaling(BaseModel):
    """How RoPE's frequencies are scaled for a longer context (megatron-core's names)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)

    type: Literal["llama3", "yarn"] = Field(description="llama3 (Llama 3.1's frequency scaling: megatron-core's "
                                            "rope_scaling) or yarn (YaRN: multi-latent attention's rope_type yarn, "
                                            "standard attention's position_embedding_type yarn).")
    factor: float = Field(gt=0, le=1e4, description="Context extension factor (llama3: rope_scaling_factor; yarn: "
                          "rotary_scaling_factor).")
    original_max_position_embeddings: int | None = Field(
        None, gt=0, le=1 << 24, description="yarn: the context the model was pretrained at (default 4096).")
    beta_fast: float | None = Field(None, gt=0, le=1e4, description="yarn: fast-rotation boundary (default 32).")
    beta_slow: float | None = Field(None, gt=0, le=1e4, description="yarn: slow-rotation boundary (default 1).")
    mscale: float | None = Field(None, ge=0, le=1e4, description="yarn: attention temperature scale (default 1.0).")
    mscale_all_dim: float | None = Field(None, ge=0, le=1e4, description="yarn: mscale of every dimension "
                                         "(default 0.0).")
    correction_range_round_to_int: bool | None = Field(
        None, description="yarn on standard attention: round the correction range's ends to integers (megatron-core's "
        "yarn_correction_range_round_to_int, Hugging Face's truncate; default true; GPT-OSS: false).")

    def yarn(self, name: str) -> float | int:
        """A YaRN field's value, megatron-core's default when unset."""
        v = getattr(self, name)
        return YARN_DEFAULTS[name] if v is None else v


def yarn(factor: float, **fields) -> dict:
    """A YaRN ``rope_scaling`` as data, each field at megatron-core's default left out (one form per scaling;
    ``correction_range_round_to_int``'s default is true)."""
    defaults = {**YARN_DEFAULTS, "correction_range_round_to_int": True}
    return {"type": "yarn", "factor": factor, **{k: v for k, v in fields.items() if v != defaults[k]}}


def check(model) -> None:
    """Cross-field rules (ValueError, one line naming the field and the fix)."""
    r = model.rope_scaling
    if r is None:
        return
    if model.position_embedding != "rope":
        raise ValueError(f"rope_scaling is for position_embedding rope, not {model.position_embedding}; remove it")
    if r.type == "yarn" and model.mla is None and model.rotary_percent != 1.0:
        raise ValueError(f"rope_scaling type yarn with rotary_percent {model.rotary_percent}: megatron-core's "
                         "YarnRotaryEmbedding scales every kv_channels dimension (it ignores rotary_percent); remove "
                         "rotary_percent or rope_scaling")
    if r.type == "yarn" and model.mla is not None and r.correction_range_round_to_int is False:
        raise ValueError("rope_scaling.correction_range_round_to_int false with multi-latent attention: MLA's "
                         "YarnRotaryEmbedding always rounds the correction range; remove the field")
    if r.type == "llama3":
        extra = [f for f in (*YARN_FIELDS, "correction_range_round_to_int") if getattr(r, f) is not None]
        if extra:
            raise ValueError(f"rope_scaling.{extra[0]} is a yarn field; llama3 scaling takes factor only (megatron-core "
                             "fixes its band at Llama 3.1's)")
        if model.mla is not None:
            raise ValueError("rope_scaling type llama3 with multi-latent attention: megatron-core applies it to "
                             "standard attention only; use type yarn")


def yarn_on_standard_attention(model) -> bool:
    r = model.rope_scaling
    return r is not None and r.type == "yarn" and model.mla is None


def refusal(model) -> str | None:
    """One line when no Megatron-LM release's flags carry an MLA model's YaRN, else None (standard attention's
    YaRN: ``megatron_lm_refusal``, per release)."""
    r = model.rope_scaling
    if r is None or r.type != "yarn" or model.mla is None:
        return None
    given = [f for f in NO_MLA_FLAG if r.yarn(f) != YARN_DEFAULTS[f]]
    if given:
        return (f"model.rope_scaling.{given[0]} ({r.yarn(given[0])}): Megatron-LM has no flag for it with "
                f"multi-latent attention (MLATransformerConfig's {YARN_DEFAULTS[given[0]]} runs); set it to that in "
                "the spec to accept the difference")
    return None


def megatron_lm_refusal(model, version: tuple[int, int], label: str) -> str | None:
    """One line when Megatron-LM ``version`` (``label``: its name) does not build ``model``'s YaRN on standard
    attention (module docstring), else None."""
    if not yarn_on_standard_attention(model):
        return None
    if version < YARN_STANDARD_SINCE:
        return (f"model.rope_scaling (type yarn, standard attention): {label} does not build it (Megatron-LM "
                "sets the yarn_* config attributes GPTModel's position_embedding_type yarn reads from core_v0.19.0 "
                "on); give --megatron-version 0.19")
    if model.mtp_num_layers:
        return (f"model.rope_scaling (type yarn) with model.mtp_num_layers ({model.mtp_num_layers}): {label}'s "
                "validate_args asserts MTP runs with position embedding rope or none; remove one of them")
    return None


def yarn_config(model) -> dict:
    """The ``yarn_*`` config attributes ``GPTModel(position_embedding_type="yarn")`` reads (standard attention),
    every one stated."""
    r = model.rope_scaling
    return {"yarn_rotary_scaling_factor": r.factor,
            **{f"yarn_{f}": r.yarn(f) for f in YARN_FIELDS},
            "yarn_correction_range_round_to_int": r.correction_range_round_to_int is not False}


def runtime_kwargs(model) -> dict:
    """The ``MLATransformerConfig`` fields of an MLA model's RoPE (``rope_type`` rope when unscaled)."""
    r = model.rope_scaling
    if r is None or r.type != "yarn" or model.mla is None:
        return {"rope_type": "rope"}
    return {"rope_type": "yarn", "rotary_scaling_factor": r.factor, **{f: r.yarn(f) for f in YARN_FIELDS}}


def rotary_kwargs(model) -> dict:
    """``RotaryEmbedding`` / ``GPTModel`` arguments of a standard-attention model (Llama 3.x scaling)."""
    r = model.rope_scaling
    if r is None or r.type != "llama3":
        return {}
    return {"rope_scaling": True, "rope_scaling_factor": r.factor}
