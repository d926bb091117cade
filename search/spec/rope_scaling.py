"""RoPE scaling (``ModelSpec.rope_scaling``): Llama 3.x's frequency scaling and YaRN, in megatron-core 0.16.1's terms.

- ``llama3``: ``GPTModel(rope_scaling=True, rope_scaling_factor=factor)``; ``RotaryEmbedding._apply_scaling`` divides
  the low frequencies by ``factor`` and interpolates the middle band with its fixed ``low_freq_factor`` 1,
  ``high_freq_factor`` 4 and ``original_max_position_embeddings`` 8192 (Llama 3.1 / 3.2 / 3.3's values; a Hugging Face
  config with others is refused by the import). Megatron-LM ``--use-rope-scaling --rope-scaling-factor F``,
  Megatron-Bridge ``model.rope_scaling`` / ``model.rope_scaling_factor``.
- ``yarn``: multi-latent attention's YaRN (``MLATransformerConfig`` ``rope_type`` yarn with ``rotary_scaling_factor``,
  ``original_max_position_embeddings``, ``beta_fast``, ``beta_slow``, ``mscale``, ``mscale_all_dim``: DeepSeek-V3's
  40 / 4096 / 32 / 1 / 1.0 / 1.0). Megatron-LM core_v0.16.1 writes ``--rope-type yarn --rotary-scaling-factor
  --mscale --mscale-all-dim`` and has no flag for the other three (``MLATransformerConfig``'s 4096 / 32 / 1 run):
  other values are refused for Megatron-LM with one line (``refusal``). On standard attention (GPT-OSS)
  megatron-core 0.16.1's ``GPTModel`` reads ``yarn_*`` attributes its ``TransformerConfig`` lacks and Megatron-LM
  asserts ``rope_type`` rope: the spec refuses it.

What it costs: nothing. The rotary tables are computed once per sequence length, and YaRN's ``mscale`` changes the
softmax scale, not the work, so time and memory are the unscaled RoPE's.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

# megatron-core 0.16.1: RotaryEmbedding._apply_scaling's fixed band (llama3) and MLATransformerConfig's YaRN defaults
LLAMA3_BAND = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
YARN_DEFAULTS = {"original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0,
                 "mscale_all_dim": 0.0}
YARN_FIELDS = ("original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")
NO_MLA_FLAG = ("original_max_position_embeddings", "beta_fast", "beta_slow")   # no Megatron-LM core_v0.16.1 flag


class RopeScaling(BaseModel):
    """How RoPE's frequencies are scaled for a longer context (megatron-core's names)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)

    type: Literal["llama3", "yarn"] = Field(description="llama3 (Llama 3.1's frequency scaling: megatron-core's "
                                            "rope_scaling) or yarn (multi-latent attention's YaRN).")
    factor: float = Field(gt=0, le=1e4, description="Context extension factor (llama3: rope_scaling_factor; yarn: "
                          "rotary_scaling_factor).")
    original_max_position_embeddings: int | None = Field(
        None, gt=0, le=1 << 24, description="yarn: the context the model was pretrained at (default 4096).")
    beta_fast: float | None = Field(None, gt=0, le=1e4, description="yarn: fast-rotation boundary (default 32).")
    beta_slow: float | None = Field(None, gt=0, le=1e4, description="yarn: slow-rotation boundary (default 1).")
    mscale: float | None = Field(None, ge=0, le=1e4, description="yarn: attention temperature scale (default 1.0).")
    mscale_all_dim: float | None = Field(None, ge=0, le=1e4, description="yarn: mscale of every dimension "
                                         "(default 0.0).")

    def yarn(self, name: str) -> float | int:
        """A YaRN field's value, megatron-core's default when unset."""
        v = getattr(self, name)
        return YARN_DEFAULTS[name] if v is None else v


def yarn(factor: float, **fields) -> dict:
    """A YaRN ``rope_scaling`` as data, each field at megatron-core's default left out (one form per scaling)."""
    return {"type": "yarn", "factor": factor, **{k: v for k, v in fields.items() if v != YARN_DEFAULTS[k]}}


def check(model) -> None:
    """Cross-field rules (ValueError, one line naming the field and the fix)."""
    r = model.rope_scaling
    if r is None:
        return
    if model.position_embedding != "rope":
        raise ValueError(f"rope_scaling is for position_embedding rope, not {model.position_embedding}; remove it")
    if r.type == "yarn" and model.mla is None:
        raise ValueError("rope_scaling type yarn on standard attention: megatron-core 0.16.1 runs YaRN with "
                         "multi-latent attention only (Megatron-LM asserts rope_type rope); remove rope_scaling")
    if r.type == "llama3":
        extra = [f for f in YARN_FIELDS if getattr(r, f) is not None]
        if extra:
            raise ValueError(f"rope_scaling.{extra[0]} is a yarn field; llama3 scaling takes factor only (megatron-core "
                             "fixes its band at Llama 3.1's)")
        if model.mla is not None:
            raise ValueError("rope_scaling type llama3 with multi-latent attention: megatron-core applies it to "
                             "standard attention only; use type yarn")


def refusal(model) -> str | None:
    """One line when Megatron-LM core_v0.16.1's flags cannot carry ``model``'s YaRN, else None."""
    r = model.rope_scaling
    if r is None or r.type != "yarn":
        return None
    given = [f for f in NO_MLA_FLAG if r.yarn(f) != YARN_DEFAULTS[f]]
    if given:
        return (f"model.rope_scaling.{given[0]} ({r.yarn(given[0])}): Megatron-LM core_v0.16.1 has no flag for it "
                f"(MLATransformerConfig's {YARN_DEFAULTS[given[0]]} runs); set it to that in the spec to accept "
                "the difference")
    return None


def runtime_kwargs(model) -> dict:
    """The ``MLATransformerConfig`` fields of an MLA model's RoPE (``rope_type`` rope when unscaled)."""
    r = model.rope_scaling
    if r is None or r.type != "yarn":
        return {"rope_type": "rope"}
    return {"rope_type": "yarn", "rotary_scaling_factor": r.factor, **{f: r.yarn(f) for f in YARN_FIELDS}}


def rotary_kwargs(model) -> dict:
    """``RotaryEmbedding`` / ``GPTModel`` arguments of a standard-attention model (Llama 3.x scaling)."""
    r = model.rope_scaling
    if r is None or r.type != "llama3":
        return {}
    return {"rope_scaling": True, "rope_scaling_factor": r.factor}
