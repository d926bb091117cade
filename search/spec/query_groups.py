"""Query groups over tensor parallelism: megatron-core's rule and the per-rank shape it builds.

megatron-core (``TransformerConfig.__post_init__``, 0.16.1 to 0.19) takes a tp that divides the attention heads and
either divides ``num_query_groups`` or is a multiple of it. When tp exceeds the groups (``Attention.__init__`` and
``get_query_key_value_tensors``, attention.py of 0.16.1 ~289-315 and ~1398-1476), the QKV GEMM is still split over
tp, its output is all-gathered over TP (reduce-scattered in backward), and each rank slices its one K/V group and
``heads / tp`` query heads of that group: the core runs with one group per rank. Megatron-Bridge's Nemotron-3 Nano
recipe runs tp 4 with 2 query groups this way.
"""

from __future__ import annotations

RULE = "megatron-core needs num_query_groups to be a multiple or a divisor of tensor_model_parallel_size"


def tp_refusal(num_attention_heads: int, groups: int, ffn_hidden_size: int, tp: int) -> str | None:
    """Why megatron-core refuses ``tp`` for these attention and MLP widths (None: it builds them)."""
    for name, value in (("num_attention_heads", num_attention_heads), ("ffn_hidden_size", ffn_hidden_size)):
        if value % tp:
            return f"tp ({tp}) must divide {name} ({value}); use a tp that divides it"
    if groups % tp and tp % groups:
        return (f"tp ({tp}) and num_query_groups ({groups}): {RULE}; use a tp that divides {groups} or that "
                f"{groups} divides")
    return None


def groups_per_rank(groups: int, tp: int) -> int:
    """K/V groups a rank's attention core holds: groups / tp, or one when tp exceeds the groups."""
    return max(groups // tp, 1)


def gathers_qkv(groups: int, tp: int) -> bool:
    """Whether the QKV GEMM's output is all-gathered over TP (tp above the query groups)."""
    return tp > groups
