"""The core attention of megatron-core's local MLA spec (torch, megatron-core).

megatron-core 0.16.1's ``get_gpt_layer_local_spec(multi_latent_attention=True)`` (and the MoE block spec built from
it) gives ``MLASelfAttention`` the local ``DotProductAttention`` as its core, but ``MultiLatentAttention`` builds
the core with ``k_channels`` / ``v_channels`` (query/key heads ``qk_head_dim + qk_pos_emb_head_dim`` wide, value
heads ``v_head_dim``), which ``DotProductAttention.__init__`` does not take: the stock local MLA layer cannot be
built. ``MLADotProductAttention`` is ``DotProductAttention`` taking them: its output is ``heads/tp x v_channels``
wide (upstream sizes it ``heads/tp x kv_channels``) and MLA has no grouped query heads (every head its own key
and value, whatever ``num_query_groups`` says). Same ops otherwise (its ``forward`` is upstream's). Both the runtime
and the single-process reference use it (``with_mla_core``), so the two run the same spec.
"""

from __future__ import annotations

import dataclasses

from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.utils import divide


class MLADotProductAttention(DotProductAttention):
    """``DotProductAttention`` with MLA's separate key and value head widths."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, k_channels=None, v_channels=None, cp_comm_type=None, pg_collection=None):
        super().__init__(config, layer_number, attn_mask_type, attention_type, attention_dropout=attention_dropout,
                         softmax_scale=softmax_scale, cp_comm_type=cp_comm_type, pg_collection=pg_collection)
        tp = self.pg_collection.tp.size()
        self.num_query_groups_per_partition = self.num_attention_heads_per_partition
        if v_channels is not None:
            self.hidden_size_per_partition = divide(v_channels * config.num_attention_heads, tp)


def with_mla_core(layer: ModuleSpec) -> ModuleSpec:
    """A layer spec whose ``MLASelfAttention`` has ``DotProductAttention`` as core -> ``MLADotProductAttention``
    (other specs unchanged)."""
    att = getattr(layer.submodules, "self_attention", None)
    sub = getattr(att, "submodules", None)
    core = getattr(sub, "core_attention", None)
    if not hasattr(sub, "kv_layernorm") or getattr(core, "module", core) is not DotProductAttention:
        return layer
    att = dataclasses.replace(att, submodules=dataclasses.replace(sub, core_attention=MLADotProductAttention))
    return dataclasses.replace(layer, submodules=dataclasses.replace(layer.submodules, self_attention=att))
