"""A stage's rotary embedding, built as stock ``GPTModel`` builds it for the model's ``rope_scaling``.

Standard attention only (multi-latent attention applies its own RoPE, from ``MLATransformerConfig``):

- plain or Llama 3.x-scaled RoPE: ``RotaryEmbedding`` (``GPTModel(position_embedding_type="rope", rope_scaling=...)``);
- YaRN (GPT-OSS's rope scaling): ``YarnRotaryEmbedding`` with the ``yarn_*`` config attributes
  (``GPTModel(position_embedding_type="yarn")``, megatron-core 0.16.1 to 0.19.2). Its forward returns the angle
  table and the concentration factor; ``GPTModel`` passes the table on and drops the factor, because each
  attention scales cos / sin by the factor it reads from its own config (``attention.py``
  ``_yarn_get_concentration_factor_from_config``: 0.16.1 per call, 0.19 once when built). So the factor reaches
  the units through their config: ``config.stage_config`` sets the ``yarn_*`` attributes on it (as Megatron-LM's
  ``_apply_yarn_config_from_args`` does) before any unit is built.

``GPTModel`` builds ``YarnRotaryEmbedding`` without a CP group (it falls back to the global one); a stage has no
global groups, so it is given the stage's, as its plain RoPE is.
"""

from __future__ import annotations

import torch
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import YarnRotaryEmbedding

from search.spec.model import ModelSpec
from search.spec.rope_scaling import rotary_kwargs, yarn_config, yarn_on_standard_attention


def position_embedding_type(model: ModelSpec) -> str:
    """``GPTModel``'s ``position_embedding_type`` for ``model`` (the stock reference builds with it)."""
    if model.position_embedding != "rope":
        return "learned_absolute"
    return "yarn" if yarn_on_standard_attention(model) else "rope"


def build(model: ModelSpec, config, cp_group) -> RotaryEmbedding | None:
    """The stage's rotary module (None: learned positions, or MLA's own RoPE)."""
    if model.position_embedding != "rope" or model.mla is not None:
        return None
    common = dict(kv_channels=config.kv_channels, rotary_percent=model.rotary_percent,
                  rotary_interleaved=config.rotary_interleaved, rotary_base=model.rotary_base,
                  use_cpu_initialization=config.use_cpu_initialization, cp_group=cp_group)
    if not yarn_on_standard_attention(model):
        return RotaryEmbedding(**common, **rotary_kwargs(model))   # Llama 3.x scaling as GPTModel passes it
    y = {k[len("yarn_"):]: getattr(config, k) for k in yarn_config(model)}   # read back as GPTModel reads them
    y["scaling_factor"] = y.pop("rotary_scaling_factor")
    return YarnRotaryEmbedding(**common, **y)


def table(module: RotaryEmbedding | None, seq_len: int) -> torch.Tensor | None:
    """The angle table for ``seq_len`` positions (YaRN's concentration factor dropped, as ``GPTModel`` drops it)."""
    if module is None:
        return None
    out = module(seq_len)
    return out[0] if isinstance(module, YarnRotaryEmbedding) else out
