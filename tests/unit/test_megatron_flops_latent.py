"""Megatron-LM's FLOP count of a LatentMoE GPT model per release (search/megatron/flops.py): core_v0.16.1's
``transformer_flops`` counts the routed experts at the hidden width, core_v0.17 on (0.17.1, 0.18.2, 0.19.0
``megatron/training/training.py``) at ``--moe-latent-size`` plus the latent up / down projections. The difference
is checked against a count written out by hand from 0.19.0's formula."""

from __future__ import annotations

from search.megatron.flops import num_floating_point_operations
from search.spec.presets import load_model


def _latent(m, size):
    return m.model_copy(update={"moe": m.moe.model_copy(update={"moe_latent_size": size})})


def test_latent_width_counts_from_0_17_and_not_in_0_16():
    base = load_model("qwen3-30b-a3b")       # h 2048, 48 MoE layers, moe_ffn 768, top-8, SwiGLU (3 GEMMs)
    m = _latent(base, 512)
    gbs, s = 4, base.seq_length
    old = num_floating_point_operations(m, gbs)
    assert old == num_floating_point_operations(base, gbs)                        # 0.16.1: l is not counted
    assert num_floating_point_operations(m, gbs, release=(0, 16)) == old
    # 0.19.0: per token and MoE layer, 3 x 2 x h x (f k 3 l / h + 2 l) instead of 3 x 2 x h x f k 3
    hidden = 6 * 2048 * 768 * 8 * 3
    latent = 6 * (768 * 8 * 3 * 512 + 2 * 2048 * 512)
    want = old + gbs * s * 48 * (latent - hidden)
    for rel in ((0, 17), (0, 18), (0, 19)):
        assert num_floating_point_operations(m, gbs, release=rel) == want
    assert num_floating_point_operations(base, gbs, release=(0, 19)) == old      # no latent: the same count
