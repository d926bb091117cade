"""MoE cost primitives (search.costmodel.moe_primitives, which moe_cost.py prices with) against hand-computed
cases: the EP all-to-all on H100 nodes (NVLink 450 GB/s and a 50 GB/s NIC per GPU, x0.8 achieved) and the grouped
GEMM on an H100 (989 TFLOP/s bf16, 3.35 TB/s HBM, 132 SMs, 128x256 tiles, MAMF 0.803, sustained 0.83)."""

import pytest

from search.spec.cluster import parse_cluster
from search.costmodel.comm import CommModel
from search.costmodel.kernels import ShapeKernels
from search.costmodel.moe_primitives import (dispatch_bytes, ep_all_to_all_ms, ep_group_all_to_all_ms,
                                             grouped_gemm_efficiency, grouped_gemm_ms)

MB64 = 64 * 2**20


def test_dispatch_bytes():
    # 4096 tokens x top-8 x h 7168 x 2 bytes (DeepSeek-V3, bf16, one micro-batch of 4096 tokens on a rank)
    assert dispatch_bytes(4096, 8, 7168, 2) == 4096 * 8 * 7168 * 2


def test_all_to_all_inside_a_node():
    comm = CommModel(parse_cluster("2x8-h100"))
    # ep 8 in one node: 7/8 of the bytes over NVLink at 450 x 0.8 = 360 GB/s = 3.6e8 B/ms, latency 3 us
    assert ep_all_to_all_ms(comm, MB64, 8, 8) == pytest.approx(0.003 + MB64 * 7 / 8 / 3.6e8)


def test_all_to_all_across_nodes_is_bound_by_the_nic():
    comm = CommModel(parse_cluster("2x8-h100"))
    # ep 16 over 2 nodes, 8 per node: 7/16 over NVLink (3.6e8 B/ms), 8/16 through the NIC (50 x 0.8 = 4e7 B/ms)
    nic = MB64 * 8 / 16 / 4e7
    assert nic > MB64 * 7 / 16 / 3.6e8
    assert ep_all_to_all_ms(comm, MB64, 16, 8) == pytest.approx(0.010 + nic)
    assert ep_all_to_all_ms(comm, MB64, 16, 8, imbalance=1.5) == pytest.approx(0.010 + 1.5 * nic)
    # the same group found from its ranks (0..15, stride 1) on the cluster
    assert ep_group_all_to_all_ms(comm, MB64, 0, 1, 16) == ep_all_to_all_ms(comm, MB64, 16, 8)
    # a stride-8 group of 2 (one rank per node): half the bytes cross, none over NVLink
    assert ep_group_all_to_all_ms(comm, MB64, 0, 8, 2) == pytest.approx(0.010 + MB64 / 2 / 4e7)


def test_all_to_all_inside_an_nvl72_rack_stays_on_nvlink():
    comm = CommModel(parse_cluster("1x72-gb200"))
    # ep 64 of 72 GPUs in one NVLink domain: 63/64 at 900 x 0.8 = 720 GB/s
    assert ep_all_to_all_ms(comm, MB64, 64, 64) == pytest.approx(0.003 + MB64 * 63 / 64 / 7.2e8)
    assert ep_all_to_all_ms(comm, MB64, 1, 1) == 0.0


def _h100():
    return ShapeKernels("h100", 989e9, 3.35e9, 2.0)


def test_grouped_gemm_large_batch_is_compute_bound():
    # 8 experts x (4096 tokens x 7168) @ (7168 x 4096): 32 x 16 = 512 full tiles each, 4096 tiles = 32 waves of
    # 132 (31.03 rounded up): eff = 0.803 x 0.83 x 4096 / (32 x 132)
    eff = 0.803 * 0.83 * 4096 / (32 * 132)
    flops = 2.0 * 8 * 4096 * 4096 * 7168
    t = flops / (989e9 * eff) + 0.005
    assert grouped_gemm_ms(_h100(), 8, 4096, 4096, 7168) == pytest.approx(t)
    assert grouped_gemm_efficiency(_h100(), 8, 4096, 4096, 7168) == pytest.approx(flops / 989e9 / t)


def test_grouped_gemm_small_batch_is_bound_by_reading_the_weights():
    # 32 experts x 16 tokens: every expert's 7168 x 4096 weight is read for 16 rows of output
    nbytes = 2.0 * (16 * 7168 + 7168 * 4096 + 16 * 4096) * 32
    t_mem = nbytes / (3.35e9 * 0.80) + 0.005
    eff_c = 0.803 * 0.83 * (16 * 4096 / (16 * 128 * 256)) * 512 / (4 * 132)   # tile_util 1/8, 512 tiles in 4 waves
    t_c = 2.0 * 32 * 16 * 4096 * 7168 / (989e9 * eff_c) + 0.005
    assert t_mem > t_c
    assert grouped_gemm_ms(_h100(), 32, 16, 4096, 7168) == pytest.approx(t_mem)
    assert grouped_gemm_efficiency(_h100(), 32, 16, 4096, 7168) < 0.05           # far below peak


def test_grouped_gemm_efficiency_grows_with_tokens_per_expert():
    effs = [grouped_gemm_efficiency(_h100(), 32, m, 4096, 7168) for m in (8, 32, 128, 512, 2048)]
    assert effs == sorted(effs) and effs[-1] > 10 * effs[0]
    assert grouped_gemm_ms(_h100(), 32, 0, 4096, 7168) == 0.0
