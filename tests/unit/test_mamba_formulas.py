"""``search.layers.mamba``: FLOPs against a case counted by hand and against Megatron-LM's own projection terms, the
rules and the memory terms on small cases worked out here. Parameters and activation bytes against megatron-core's
``MambaLayer`` itself are in tests/runtime/test_mamba_layer.py."""

import pytest
from pydantic import ValidationError

from search.layers import mamba
from search.layers.mamba import Mamba2Spec

# hidden 8; H = 2 heads of P = 4 (d_inner 8), g = 1 group, N = 2, chunks of Q = 4, conv width 4
SMALL = Mamba2Spec(mamba_state_dim=2, mamba_head_dim=4, mamba_num_groups=1, mamba_num_heads=2, chunk_size=4)


def test_flops_of_a_case_counted_by_hand():
    f = mamba.forward_flops(SMALL, 8, seq=6)          # 6 tokens: 2 chunks of 4, the last one padded
    assert f.in_proj == 2 * 6 * 8 * (8 + 8 + 2 + 2 + 2)    # z, x, B, C, dt
    assert f.conv1d == 2 * 6 * (8 + 2 + 2) * 4             # depthwise over x, B, C
    # C B^T per group and chunk (4 x 2 x 4), masked product per head and chunk (4 x 4 x 4), chunk states and
    # read-out per head over 8 padded steps (2 x 4 each), state hand-off per head and chunk (2 x 4)
    macs = 1 * 2 * 4 * 4 * 2 + 2 * 2 * 4 * 4 * 4 + 2 * 8 * 2 * 4 + 2 * 2 * 2 * 4 + 2 * 8 * 2 * 4
    assert macs == 608 and f.scan == 2 * macs
    assert f.out_proj == 2 * 6 * 8 * 8
    assert f.total == f.in_proj + f.conv1d + f.scan + f.out_proj
    assert f.elementwise == 6 * (4 * 2 + 7 * 8)


def test_projections_equal_megatron_lm_where_its_assumption_holds():
    """Megatron-LM's ``mamba_layer_flops`` (megatron/training/training.py) takes d_inner = 2 h: with 128 heads of 64
    at h = 4096 (Nemotron-3 Super) its in_proj and out_proj terms are ours."""
    m = Mamba2Spec(mamba_num_heads=128)
    s, h, d_in, g, n, heads = 8192, 4096, 8192, 8, 128, 128
    f = mamba.forward_flops(m, h, seq=s)
    assert f.in_proj == 2 * s * h * (2 * d_in + 2 * g * n + heads)
    assert f.out_proj == 2 * s * d_in * h
    assert f.scan < 0.05 * f.total       # the scan is a few percent of the layer at this shape


def test_scan_cost_is_the_papers_order_when_n_p_q_agree():
    """Dao & Gu 2024, section 6: with N = P = Q the SSD algorithm costs O(s N^2) per head: here exactly
    (g/H + 3 + 1/N) s N^2 multiply-adds per head."""
    m = Mamba2Spec(mamba_state_dim=64, mamba_head_dim=64, mamba_num_groups=1, mamba_num_heads=8, chunk_size=64)
    s = 64 * 10
    assert mamba.scan_macs(m, 512, s) == 8 * s * 64 * 64 * (1 / 8 + 3 + 1 / 64)


def test_heads_default_to_expand_times_hidden():
    assert mamba.shape(Mamba2Spec(), 4096).heads == 128                   # 2 x 4096 / 64
    with pytest.raises(ValueError, match="mamba_head_dim"):
        mamba.shape(Mamba2Spec(mamba_head_dim=48), 100)
    with pytest.raises(ValidationError, match="multiple of mamba_num_groups"):
        Mamba2Spec(mamba_num_heads=12, mamba_num_groups=8)
    with pytest.raises(ValidationError, match="Extra inputs"):
        Mamba2Spec.model_validate({"d_state": 16})


def test_tp_and_cp_rules_on_nemotron_3_nano():
    nano = Mamba2Spec(mamba_num_heads=64, mamba_num_groups=8)
    assert mamba.tp_refusal(nano, 2688, 8) is None
    assert "mamba_num_groups (8)" in mamba.tp_refusal(nano, 2688, 16)
    assert mamba.cp_refusal(nano, 2688, 1, 8) is None
    assert mamba.cp_refusal(nano, 2688, 1, 16) is None                   # 16 CP ranks repeat each group twice
    assert "multiple of context_parallel_size (3)" in mamba.cp_refusal(nano, 2688, 1, 3)
    assert mamba.cp_refusal(nano, 2688, 8, 8) is None                    # 8 heads and 1 group per TP rank
    assert "heads per TP rank (8)" in mamba.cp_refusal(nano, 2688, 8, 16)
    assert mamba.fp8_refusal(nano, 2688) is None                         # 2 x 4096 + 2 x 8 x 128 + 64


def test_activation_bytes_with_tp_sp_and_repeated_groups():
    m = Mamba2Spec(mamba_state_dim=16, mamba_head_dim=8, mamba_num_groups=2, mamba_num_heads=8)   # d_inner 64
    plain = mamba.act_bytes(m, 32, 2)
    assert plain == (2 * 32, 2 * (128 + 2 * 2 * 16 + 8), 2 * 64, 2 * 64 + 4 * 2, 2 * 64)
    sharded = mamba.act_bytes(m, 32, 2, tp=2, sp=True)
    assert sharded == (2 * 16, 2 * (64 + 2 * 1 * 16 + 4), 2 * 32, 2 * 32 + 4 * 1, 2 * 32)
    # cp 4 over 1 group per TP rank: each CP rank holds B and C of its group for the whole sequence, i.e. 4 groups'
    # worth per token of its quarter of the sequence
    repeated = mamba.act_bytes(m, 32, 2, tp=2, cp=4)
    assert repeated.zxbcdt == 2 * (64 + 2 * 4 * 16 + 4)
    assert mamba.cp_all_to_all_elems(m, 32, 2, 4) == (64 + 2 * 4 * 16 + 4 + 32) * 3 / 4


def test_state_memory():
    m = Mamba2Spec(mamba_num_heads=128)      # Nemotron-3 Super's mixer
    per_chunk = 128 * 64 * 128
    assert mamba.scan_state_bytes(m, 4096, 8192, 2) == 64 * per_chunk * (4 + 2)
    assert mamba.scan_state_bytes(m, 4096, 8193, 2, tp=2) == 65 * per_chunk // 2 * 6
    assert mamba.inference_state_bytes(m, 4096, 2) == ((8192 + 2 * 8 * 128) * 4 + 128 * 64 * 128) * 2


def test_parameters_of_nemotron_3_super_mixer():
    p = mamba.params(Mamba2Spec(mamba_num_heads=128), 4096)
    assert p.in_proj == 4096 * (2 * 8192 + 2 * 8 * 128 + 128)
    assert p.conv1d == (8192 + 2 * 8 * 128) * 5
    assert (p.dt_bias, p.A_log, p.D, p.norm, p.pre_norm) == (128, 128, 128, 8192, 4096)
    assert p.total == 109_640_064
    with pytest.raises(ValueError, match="tensor_model_parallel_size"):
        mamba.params(Mamba2Spec(mamba_num_heads=128), 4096, tp=16)
