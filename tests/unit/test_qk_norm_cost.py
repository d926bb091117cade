"""The Q and K norms of a self-attention unit (``megatron.qk_layernorm``: Qwen3, the published Qwen3-30B-A3B and
Qwen3-235B-A22B Megatron-Bridge runs) priced where they act, against hand-computed numbers.

megatron-core's ``SelfAttention.get_query_key_value_tensors`` (core_v0.16.1 to core_v0.19.0) applies
``q_layernorm`` to the query heads and ``k_layernorm`` to the key groups after the QKV split (TENorm over each head's
head_dim): one norm kernel each, reading and writing ``s b (heads / t + groups per rank) head_dim`` elements, and
each keeps its input (and one fp32 rstd per head row) for backward. Before, the analytic model counted their
parameters only and said it ignored the field.

Constants: H100 HBM 3350 GB/s (datasheet) at ``kernels.MEM_EFF`` 0.8, ``kernels.LAUNCH_MS`` 5 us per kernel; the
element-wise backward at 1.5x the forward's bytes (the attention unit's convention).
"""

from __future__ import annotations

import pytest

from search.costmodel.analytic import AnalyticSource
from search.costmodel.comm import CommModel
from search.costmodel.memory import attention_act_bytes
from search.layers.dense import attention_launches
from search.spec.cluster import parse_cluster
from search.spec.model import ModelSpec
from search.spec.training import TrainingSpec

HBM = 3350e6 * 0.8      # bytes per ms the element-wise kernels reach on an H100
LAUNCH = 0.005          # ms per kernel


def model(qk: bool) -> ModelSpec:
    """Eight query heads of 128 in two groups (GQA), RoPE, RMSNorm: a small Qwen3-shaped layer."""
    return ModelSpec(name="qk", family="llama", num_layers=2, hidden_size=1024, num_attention_heads=8,
                     num_query_groups=2, ffn_hidden_size=2048, seq_length=1024, vocab_size=32000,
                     activation="swiglu", normalization="rmsnorm", position_embedding="rope",
                     add_bias_linear=False, tied_embeddings=False, params_dtype="bf16",
                     megatron={"qk_layernorm": True} if qk else None)


def source(qk: bool) -> AnalyticSource:
    cl = parse_cluster("1x8-h100")
    return AnalyticSource(model(qk), cl, TrainingSpec(global_batch_size=8), CommModel(cl))


# b 2, s 1024, tp 2: per rank 8 / 2 = 4 query heads and 2 / 2 = 1 key group of 128
ELEMS = 1024 * 2 * (4 + 1) * 128          # 1,310,720 elements the two norms read


def test_qk_norms_add_their_kernels_to_the_attention_unit_time_by_hand():
    """Forward: read + write 2 bytes each, 5,242,880 bytes at 2680 GB/s = 1.956 us, + 2 kernels (10 us);
    backward 1.5x the bytes (2.934 us) + 2 kernels."""
    on = source(True).attention(2, 1024, 2, sp=True)
    off = source(False).attention(2, 1024, 2, sp=True)
    assert on.fwd - off.fwd == pytest.approx(5_242_880 / HBM + 2 * LAUNCH, rel=1e-9)
    assert on.fwd - off.fwd == pytest.approx(0.011956, abs=1e-6)
    assert on.bwd - off.bwd == pytest.approx(7_864_320 / HBM + 2 * LAUNCH, rel=1e-9)
    assert on.bwd - off.bwd == pytest.approx(0.012935, abs=1e-6)


def test_qk_norms_keep_their_inputs_for_backward_by_hand():
    """Each norm keeps its input (2 bytes an element) and one fp32 rstd per head row (4 / 128 an element):
    2.03125 x 1,310,720 = 2,662,400 bytes more kept, with or without the core's recompute; full recompute keeps the
    unit input only (unchanged)."""
    on = attention_act_bytes(model(True), 2, 1024, 2, flash=True, sp=True)
    off = attention_act_bytes(model(False), 2, 1024, 2, flash=True, sp=True)
    assert [a - b for a, b in zip(on, off)] == pytest.approx([2_662_400, 2_662_400, 0, 2_662_400])
    # cross-attention (an encoder's keys) has no Q / K norms here
    cross_on = attention_act_bytes(model(True), 2, 1024, 2, flash=True, kv_len=512, sp=True)
    cross_off = attention_act_bytes(model(False), 2, 1024, 2, flash=True, kv_len=512, sp=True)
    assert cross_on == cross_off


def test_qk_norms_are_two_more_host_launches():
    """The attention part's forward launches (``costmodel.host``): 7 (+3 quantized), + 2 with the Q and K norms."""
    assert attention_launches(model(False), False) == {"attn": 7}
    assert attention_launches(model(True), False) == {"attn": 9}
    assert attention_launches(model(True), True) == {"attn": 12}


def test_qk_layernorm_is_priced_not_named_as_ignored():
    """The analytic model's note no longer says it ignores ``qk_layernorm`` (it prices it)."""
    from search.spec.megatron_fields import analytic_note
    assert analytic_note(model(True)) is None
