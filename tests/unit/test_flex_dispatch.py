"""The flex dispatcher (DeepEP / HybridEP) as it runs: destinations per token, node-deduplicated traffic, buffers.

Expected numbers are hand-computed from the formulas in search/costmodel/moe_primitives.py's docstring and
docs/costmodel.md ("flex"), or checked against an independent reference: a simulation of megatron-core 0.16.1's
``group_limited_topk`` selection on random router scores, and DeepEP's ``Config.get_nvl_buffer_size_hint`` /
``get_rdma_buffer_size_hint`` (csrc/legacy/config.hpp) written out term by term.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from search.spec.cluster import parse_cluster
from search.pricing import make_cost_model
from search.costmodel.analytic import AnalyticSource
from search.costmodel.comm import CommModel
from search.costmodel.moe_cost import moe_unit
from search.costmodel.moe_primitives import (deepep_buffer_bytes, flex_all_to_all_ms, flex_destinations,
                                             flex_token_bytes, hit_probability)
from search.spec.model import ModelSpec
from search.settings.moe_plan import MoEPlanSettings
from search.spec.training import TrainingSpec


def _prod(a: int, b: int, n: int) -> float:
    """(a (a-1) ... (a-n+1)) / (b (b-1) ... (b-n+1)) = C(a, n) / C(b, n)."""
    r = 1.0
    for i in range(n):
        r *= (a - i) / (b - i)
    return r


def test_plain_top_k_destinations_by_hand():
    """Qwen3-235B: 128 experts, top-8, EP 32 on 4 nodes of 8: 4 experts per rank, 32 per node."""
    p_rank = 1 - _prod(124, 128, 8)
    p_node = 1 - _prod(96, 128, 8)
    assert hit_probability(128, 8, 4) == pytest.approx(p_rank, rel=1e-12)
    R, D = flex_destinations(128, 8, 32, 8)
    assert R == pytest.approx(32 * p_rank, rel=1e-12)      # 7.36 ranks, not 8 copies
    assert D == pytest.approx(4 * p_node, rel=1e-12)       # 3.63 nodes
    assert D < 4 and R < 8


def test_group_limited_destinations_by_hand():
    """DeepSeek-V3: 256 experts in 8 groups of 32, 4 groups chosen, top-8 (2 per chosen group)."""
    # a node of 64 experts (2 groups): hit unless both its groups are left out: 1 - C(6, 4) / C(8, 4)
    assert hit_probability(256, 8, 64, 8, 4) == pytest.approx(1 - 15 / 70, rel=1e-12)
    # a rank of 4 experts inside a group: chosen (4/8) and one of its 2 experts among the 4: 1 - C(28,2)/C(32,2)
    assert hit_probability(256, 8, 4, 8, 4) == pytest.approx(0.5 * (1 - (28 * 27) / (32 * 31)), rel=1e-12)
    R, D = flex_destinations(256, 8, 32, 8, 8, 4)           # EP 32 over 4 nodes: 8 experts per rank
    assert D == pytest.approx(4 * (1 - 15 / 70), rel=1e-12)
    assert R == pytest.approx(32 * 0.5 * (1 - (24 * 23) / (32 * 31)), rel=1e-12)


def _simulate(E, k, G, M, block, n=20000, seed=0):
    """megatron-core 0.16.1 ``group_limited_topk`` on i.i.d. uniform scores: group score = sum of its top-(k/M)
    scores, the top-M groups kept, the top-k experts among them; the fraction of (token, block) pairs hit."""
    rng = np.random.default_rng(seed)
    s = rng.random((n, E))
    if G:
        top = np.sort(s.reshape(n, G, -1), axis=-1)[:, :, -(k // M):].sum(-1)
        keep = np.zeros((n, G), bool)
        np.put_along_axis(keep, np.argsort(-top, axis=1)[:, :M], True, 1)
        s = np.where(np.repeat(keep, E // G, axis=1), s, -1.0)
    idx = np.argsort(-s, axis=1)[:, :k]
    hit = np.zeros((n, E // block), bool)
    np.put_along_axis(hit, idx // block, True, 1)
    return hit.mean()


@pytest.mark.parametrize("E,k,G,M,block", [(128, 8, None, None, 32), (256, 8, 8, 4, 64), (256, 8, 8, 4, 4),
                                           (256, 8, 8, 4, 32), (256, 8, 8, 4, 128), (64, 6, 8, 3, 16)])
def test_destinations_against_megatron_group_limited_routing_simulated(E, k, G, M, block):
    assert hit_probability(E, k, block, G, M) == pytest.approx(_simulate(E, k, G, M, block), abs=0.01)


def test_flex_all_to_all_by_hand_and_node_deduplicated():
    """T 4096 tokens of 8192 bytes, top-8 over EP 32 on 4 nodes: the NIC carries T D 3/4 b, NVLink T R 7/8 b."""
    comm = SimpleNamespace(intra_gbps=360.0, inter_gbps=40.0)      # 450 / 50 GB/s x 0.8
    R, D = 7.36, 3.63
    nvl = 4096 * R * 7 / 8 * 8192 / (360e6 * 0.67 / 0.8)
    rdma = 4096 * D * 3 / 4 * 8192 / (40e6 * 0.87 / 0.8)
    t = flex_all_to_all_ms(comm, 4096, 8192, R, D, 32, 8, nvl_eff=0.67, rdma_eff=0.87)
    assert t == pytest.approx(0.010 + max(nvl, rdma), rel=1e-12)
    assert rdma > nvl
    # intra-node (one group of 8 in a node): NVLink only, intra latency, x the imbalance factor
    t8 = flex_all_to_all_ms(comm, 4096, 8192, 5.25, 1.0, 8, 8, imbalance=1.2)
    assert t8 == pytest.approx(0.003 + 1.2 * 4096 * 5.25 * 7 / 8 * 8192 / 360e6, rel=1e-12)
    # the alltoall dispatcher's NIC bytes for the same case: T k 3/4 b; flex's are D / k of them
    assert (4096 * D * 3 / 4) / (4096 * 8 * 3 / 4) == pytest.approx(D / 8)


def test_flex_token_bytes_as_deepep_packs_them():
    """hidden 4096 bf16 + SourceMeta 8 + top-8 int32 indices and fp32 weights, aligned to 16: 8264 -> 8272."""
    assert flex_token_bytes(4096, 2, 8) == 8272
    assert flex_token_bytes(4096, 2, 8, dispatch=False) == 8192


def test_deepep_buffer_sizes_by_hand():
    """megatron-core 0.16.1 fused_a2a.get_buffer at moe_deepep_num_sms 20 (10 channels), hidden_bytes 2 h."""
    per_tok = 8192 + 8 + 128 * 8 + 128 * 4 + 128 * 4           # hidden, SourceMeta, top-k idx / weights, scales
    nvl = 10 * 8 * (2 * 4 + 3) * 4 + 10 * 8 * 288 * per_tok     # EP 32: 8 NVL peers, 4 RDMA ranks, 288 tokens
    rdma = 10 * 4 * (8 * 2 + 2) * 2 * 4 + 10 * 4 * 128 * 2 * (per_tok + 16)
    r128 = lambda x: (x + 127) // 128 * 128                      # noqa: E731
    assert deepep_buffer_bytes(32, 8192) == (r128(nvl), r128(rdma))
    per_tok = 14336 + 2056
    assert deepep_buffer_bytes(8, 14336) == (r128(10 * 8 * (2 + 3) * 4 + 10 * 8 * 256 * per_tok), 0)   # 1 node
    per_tok = 8192 + 2056                                        # no config for 12: the 16-rank one's 288 tokens
    assert deepep_buffer_bytes(12, 8192)[0] == r128(10 * 8 * (2 + 3) * 4 + 10 * 8 * 288 * per_tok)


def _qwen_like() -> ModelSpec:
    return ModelSpec(name="moe-128x8", family="llama", num_layers=2, hidden_size=4096, num_attention_heads=32,
                     ffn_hidden_size=8192, seq_length=4096, vocab_size=32000, activation="swiglu",
                     normalization="rmsnorm", position_embedding="rope", add_bias_linear=False,
                     tied_embeddings=False, params_dtype="bf16",
                     moe={"num_experts": 128, "moe_router_topk": 8, "moe_ffn_hidden_size": 1536})


def test_flex_unit_prices_the_deduplicated_exchange_and_no_etp_gather():
    """EP 32 over 4 H100 nodes, b 1, s 4096, tp 1: flex = the hand-computed flex exchange each way (fwd + bwd),
    and below alltoall's one copy per routed expert over the network."""
    m = _qwen_like()
    cl = parse_cluster("4x8-h100")
    src = AnalyticSource(m, cl, TrainingSpec(global_batch_size=8), CommModel(cl))
    T, h = 4096, 4096
    R = 32 * (1 - _prod(124, 128, 8))
    D = 4 * (1 - _prod(96, 128, 8))

    def one(b):
        nvl = T * R * 7 / 8 * b / (450e6 * 0.67)
        rdma = T * D * 3 / 4 * b / (50e6 * 0.87)
        return 0.010 + max(nvl, rdma)
    d, c = one(8272), one(8192)
    flex, *_ = moe_unit(src, 1.0, 4096, 1, False, 32, 1, MoEPlanSettings(token_dispatcher="flex"))
    assert flex.ep_comm == pytest.approx(2 * (d + c), rel=1e-9)
    a2a, *_ = moe_unit(src, 1.0, 4096, 1, False, 32, 1, MoEPlanSettings())
    assert flex.ep_comm < 0.6 * a2a.ep_comm
    # tp 2 = etp 2 (SP): flex sends each token to both ETP ranks of its experts in the one exchange (group 64,
    # 8 per node = 8 nodes), no ETP all-gather / reduce-scatter
    src2 = AnalyticSource(m, parse_cluster("8x8-h100"), TrainingSpec(global_batch_size=8),
                          CommModel(parse_cluster("8x8-h100")))
    R2, D2 = 32 * (1 - _prod(124, 128, 8)), 8 * (1 - _prod(112, 128, 8))     # 4 EP ranks per node

    def two(b):
        return 0.010 + max(T / 2 * 2 * R2 * 7 / 8 * b / (450e6 * 0.67), T / 2 * D2 * 7 / 8 * b / (50e6 * 0.87))
    flex2, *_ = moe_unit(src2, 1.0, 4096, 2, True, 32, 2, MoEPlanSettings(token_dispatcher="flex"))
    assert flex2.ep_comm == pytest.approx(2 * (two(8272) + two(8192)), rel=1e-9)


def test_flex_buffer_in_stage_memory():
    """The DeepEP buffer counts once on a stage with MoE layers, in its own breakdown entry; not for alltoall."""
    m = _qwen_like()
    cm = make_cost_model(m, parse_cluster("4x8-h100"), TrainingSpec(global_batch_size=64))
    rc = np.zeros(4, np.int8)

    def stage(s):
        return cm.stage_cost(0, 1, 0, 0, 4, 1, 32, rc, 32, ep=32, etp=1, moe=s)
    flex, base = stage(MoEPlanSettings(token_dispatcher="flex")), stage(MoEPlanSettings())
    nvl, rdma = deepep_buffer_bytes(32, 8192)
    assert flex.memory_breakdown["dispatch_buffers"] == pytest.approx((nvl + rdma) / 2 ** 20, rel=1e-12)
    assert "dispatch_buffers" not in base.memory_breakdown


def test_hybridep_rate_from_0_17_is_its_benchmark_at_its_default_32_sms():
    """megatron-core 0.17+ (26.04 / 26.04.01) runs HybridEP at its own default of 32 SMs: its NVLink rate is the
    GB200 benchmark at 32 SMs (BF16, Torch API, dispatch and combine at 8-36 ranks, each x (n - 1) / n over 900 GB/s;
    e.g. 32 ranks' dispatch 484.22 x 31 / 32 / 900 = 0.5212), median 0.53, not a fit; through 0.16 (16 SMs) 0.49.
    A HybridEP exchange on GB200 NVL72 (EP 32 in the rack) then costs 0.49 / 0.53 of 26.02.01's in its bandwidth term."""
    import statistics
    from search.costmodel import release_constants as rcs
    from search.costmodel.moe_primitives import FLEX_NVL_EFF, HYBRIDEP_32SM_NVL, HYBRIDEP_32SM_NVL_EFF
    assert HYBRIDEP_32SM_NVL[32][0] * 31 / 32 / 900 == pytest.approx(0.5212, abs=1e-4)
    effs = [bw * (n - 1) / n / 900 for n, pair in HYBRIDEP_32SM_NVL.items() for bw in pair]
    assert round(statistics.median(effs), 2) == HYBRIDEP_32SM_NVL_EFF == 0.53
    assert rcs.value("HYBRIDEP_NVL_EFF", "26.04") == rcs.value("HYBRIDEP_NVL_EFF", "26.04.01") == 0.53
    assert rcs.value("HYBRIDEP_NVL_EFF", "26.02.01") == FLEX_NVL_EFF["blackwell"] == 0.49
    row = next(r for r in rcs.table("26.04.01") if r[0] == "HYBRIDEP_NVL_EFF")
    assert row[1] == 0.53 and "32 SMs" in row[2] and "fitted" not in row[2]
    # the exchange, by hand: EP 32 of one NVL72 rack (no RDMA), T = 4096 tokens, R distinct ranks of 32
    from search.costmodel.types import RunSettings
    m = _qwen_like()
    cl = parse_cluster("1x72-gb200")
    R = 32 * (1 - _prod(124, 128, 8))
    for release, eff in (("26.04", 0.53), ("26.02.01", 0.49)):
        src = AnalyticSource(m, cl, TrainingSpec(global_batch_size=8), CommModel(cl),
                             settings=RunSettings(release=release))
        want = sum(0.003 + 4096 * R * 31 / 32 * b / (900e6 * eff) for b in (8272, 8192))
        flex, *_ = moe_unit(src, 1.0, 4096, 1, False, 32, 1,
                            MoEPlanSettings(token_dispatcher="flex", flex_backend="hybridep"))
        assert flex.ep_comm == pytest.approx(2 * want, rel=1e-9)
