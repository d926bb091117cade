"""Each software-stack feature's price against a hand-computed case (issue 34): the host launches and what a CUDA
graph removes and pins, the EP overlap's schedule with delayed weight gradients, Muon / dist_muon, the router's
dtype and fusion, the cross-entropy fusion, attention sinks, fine-grained offload, the per-rank capacity and paged
stash, Megatron FSDP's main dtypes; and the release table."""

import pytest

from search.spec.cluster import parse_cluster
from search.pricing import make_cost_model
from search.costmodel import release_constants as rcs
from search.costmodel.analytic import AnalyticSource
from search.costmodel.comm import CommModel
from search.costmodel.ep_overlap import LayerTimes, layer_pair_ms, saving_ms
from search.costmodel.host import GRAPH_BUFFERS, exposed_host_ms, host_launches, part_launches
from search.costmodel.memory import MB
from search.layers.moe import EXPERT_LAUNCHES
from search.costmodel.optimizers import MUON_BYTES, muon_matrices, ns_flops
from search.costmodel.types import Features, StackKey
from search.settings.moe_plan import MoEPlanSettings
from search.spec.plan import uniform_plan
from search.settings.releases import for_megatron, resolve
from search.spec.training import TrainingSpec
from tests.unit.test_moe_cost import tiny_moe


# ----- host launches and CUDA graphs ---------------------------------------------------------------------------
def test_launch_counts_by_hand():
    """tiny_moe (8 experts, no groups, no expert bias, no aux loss), force-balanced: attention 7 launches (bf16), the
    router 1 gate + 2 random logits + 7 top-k steps + 1 bias count = 11 (learned routing: 9, no random logits), the
    preprocess 16, the rest 9 + 6 per local expert (ep 4: 2 experts)."""
    m = tiny_moe(moe_router_force_load_balancing=True)
    assert part_launches(tiny_moe(), "moe", False, 2, MoEPlanSettings())["moe_router"] == 9
    assert part_launches(m, "attention", False, 0) == {"attn": 7}
    assert part_launches(m, "attention", True, 0) == {"attn": 10}
    parts = part_launches(m, "moe", False, 2, MoEPlanSettings())
    assert parts == {"moe_router": 11, "moe_preprocess": 16, "moe_rest": 9 + EXPERT_LAUNCHES * 2}
    fused = part_launches(m, "moe", False, 2, MoEPlanSettings(router_fusion=True))
    assert fused["moe_router"] == 1 + 2 + 4 + 1
    padded = tiny_moe(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True)
    assert part_launches(padded, "moe", False, 2)["moe_preprocess"] == 5


def test_cuda_graphs_remove_their_parts_launches():
    parts = {"attn": 7, "moe_router": 9, "moe_preprocess": 16, "moe_rest": 21}
    assert host_launches(parts, frozenset()) == 53
    assert host_launches(parts, frozenset({"moe_router", "moe_preprocess"})) == 7 + 1 + 1 + 21
    assert host_launches(parts, frozenset({"attn", "moe_router", "moe_preprocess"})) == 1 + 1 + 1 + 21
    assert host_launches(parts, frozenset({"attn", "mlp", "moe", "layer"})) == 4          # whole layers
    assert host_launches(parts, frozenset({"full_iteration"})) == 0


def test_exposed_host_time_by_hand():
    # synchronised (dropless): the forward against the host, and the part right after the wait against its own
    # device time; not (or one wait per EP-overlap pair): the host forward against the layer's whole device time
    assert exposed_host_ms(5.0, 2.0, 10.0, True) == pytest.approx(3.0)
    assert exposed_host_ms(1.0, 2.0, 0.0, True) == 0.0
    assert exposed_host_ms(5.0, 4.0, 10.0, True, 3.0, 1.0) == pytest.approx(2.0)     # the experts' launches
    assert exposed_host_ms(5.0, 4.0, 10.0, True, 3.0, 2.5) == pytest.approx(1.0)     # the layer's
    assert exposed_host_ms(8.0, 2.0, 4.0, False) == pytest.approx(2.0)
    assert exposed_host_ms(5.0, 2.0, 4.0, False) == 0.0


def _table(m, moe=None, graphs=frozenset(), cl="1x8-h100", release="", b=1.0, ep=4):
    from search.costmodel.types import RunSettings, TableStack
    cluster = parse_cluster(cl)
    src = AnalyticSource(m, cluster, TrainingSpec(global_batch_size=8), CommModel(cluster), kernels="flat",
                         settings=RunSettings(release=release))
    stack = TableStack(graphs) if graphs else None
    return src, src.unit_table(b, 1, ep=ep, etp=1, moe=moe or MoEPlanSettings(), stack=stack)


# The host CPU's single-core boost clock of each GPU's DGX system (datasheets; docs/costmodel.md): the host time per
# launch is HOST_LAUNCH_MS at DGX B200's 4.0 GHz, scaled by 4.0 / the host's clock; Grace hosts as fitted.
DGX_HOST_GHZ = {"h100": 3.8, "h200": 3.8, "b200": 4.0, "b300": 4.6, "gb200": None, "gb300": None}


def _launch_by_hand(gpu: str, release: str = "") -> float:
    ghz = DGX_HOST_GHZ[gpu]
    return rcs.value("HOST_LAUNCH_MS", release) * (4.0 / ghz if ghz else 1.0)


def test_host_launch_time_follows_the_host_clock_by_hand():
    """DGX H100 / H200: Xeon Platinum 8480C, 3.8 GHz max boost; DGX B200: Xeon Platinum 8570, 4.0; DGX B300: Xeon
    6776P, 4.6 (Priority Core Turbo); GB200 / GB300: Grace, no x86 clock: the fitted time per launch. 26.04.01's
    HOST_LAUNCH_MS is 0.045 ms: 0.045 x 4 / 4.6 = 0.03913 ms on a DGX B300, 0.04737 on a DGX H100."""
    from search.costmodel.host import launch_ms
    from search.spec.cluster import gpu_record
    for gpu, ghz in DGX_HOST_GHZ.items():
        assert gpu_record(gpu).host_cpu_ghz == ghz
        assert launch_ms(gpu, "26.04.01") == pytest.approx(_launch_by_hand(gpu, "26.04.01"), rel=1e-12)
    assert launch_ms("b300", "26.04.01") == pytest.approx(0.045 * 4 / 4.6, rel=1e-12)
    assert launch_ms("h100", "26.04.01") == pytest.approx(0.045 * 4 / 3.8, rel=1e-12)
    assert launch_ms("gb200", "26.04.01") == launch_ms("b200", "26.04.01") == pytest.approx(0.045, rel=1e-12)


@pytest.mark.parametrize("cl", ["1x8-h100", "1x8-b300", "1x8-gb200"])
def test_unit_table_host_wait_by_hand(cl):
    """A tiny dropless layer is host-bound: the moe unit's forward is its kernels plus launches x the host's time
    per launch (HOST_LAUNCH_MS at the DGX host's clock) minus the layer's device forward (7 + 11 + 16 + 21 = 55
    launches), or the experts' 21 launches minus the moe unit's device forward where that is more; graphs of
    moe_router + moe_preprocess leave 7 + 1 + 1 + 21 (force-balanced routing, as the published rows run)."""
    m = tiny_moe(moe_router_force_load_balancing=True)
    launch = _launch_by_hand(cl.split("-")[1])
    src0, bare = _table(m, cl=cl)
    i = [u.kind for u in m.units].index("moe")
    dev = bare.fwd_ms[i - 1] + bare.fwd_ms[i] - bare.host_ms[i]
    dev_moe = bare.fwd_ms[i] - bare.host_ms[i]
    for graphs, launches in ((frozenset(), 55), (frozenset({"moe_router", "moe_preprocess"}), 30)):
        _, t = _table(m, graphs=graphs, cl=cl)
        host = launches * launch
        want = max(host - dev, 21 * launch - dev_moe)
        assert want > 0                                     # the case under test
        assert t.host_ms[i] == pytest.approx(want, rel=1e-9)
        assert t.fwd_ms[i] == pytest.approx(dev_moe + want, rel=1e-9)
        assert t.recompute_ms[i, 2] == pytest.approx(t.fwd_ms[i], rel=1e-9)   # full recompute re-waits


def test_hybrid_moe_layer_after_mamba_waits_on_the_host_by_hand():
    """A hybrid pattern's MoE layer after a Mamba one (``ME``, 32 of Nemotron-3 Super's 40) syncs like any dropless
    layer, so it is host-bound the same way: the Mamba unit's 17 launches (bf16; megatron-core 0.19 MambaMixer, 20
    quantized) + the router's 9 (learned routing, no aux loss) + the preprocess's 16 + the rest's 9 + 6 x 2 local
    experts = 63, against the Mamba and moe units' device forward, or the rest's 21 against the moe unit's."""
    from tests.unit.test_hybrid_model_spec import _model
    m = _model("ME", hidden_size=256, num_attention_heads=4, ffn_hidden_size=512, seq_length=256,
               moe={"num_experts": 8, "moe_router_topk": 2, "moe_ffn_hidden_size": 64})
    assert part_launches(m, "mamba", False, 0) == {"mamba": 17}
    assert part_launches(m, "mamba", True, 0) == {"mamba": 20}
    launch = _launch_by_hand("h100")                        # _table's cluster: 1x8-h100
    _, t = _table(m)
    assert [u.kind for u in m.units] == ["mamba", "moe"]
    dev_moe = t.fwd_ms[1] - t.host_ms[1]
    want = max((17 + 9 + 16 + 21) * launch - (t.fwd_ms[0] + dev_moe), 21 * launch - dev_moe)
    assert want > 0                                         # the case under test
    assert t.host_ms[1] == pytest.approx(want, rel=1e-9)
    assert t.fwd_ms[1] == pytest.approx(dev_moe + want, rel=1e-9)


# A dropless layer with a large shared expert (tiny_moe, b 1, s 1024 = T tokens, tp 1, ep 4, flat kernels on H100):
# megatron-core's MoELayer.forward runs the shared expert (not overlapped), the router and the dispatcher's
# preprocess before the dispatch waits on the host (moe_layer.py custom_forward, 0.16.1 and 0.19).
FS = 262144         # the shared expert's width: ~2 ms of forward, so its time decides what the wait exposes


def _before_wait_by_hand(dispatcher: str, overlap: bool) -> float:
    """The moe unit's forward before the wait: the gating GEMM (T, E, h), the norm (2 dt T h), the scores and top-k
    (T E (dt + 3 x 4 + 1)) and, alltoall only (synchronised before the EP all-to-all, after permutation 1), half the
    fused permute / unpermute bytes (dt T h + T k (dt h + 4)); the shared expert's two GEMMs (gelu: fc1 (T, fs, h),
    fc2 (T, h, fs), one flat kernel group) and its activation (2 dt T fs) unless overlapped with the dispatch;
    allgather: its all-gather of tokens, probs and routing map over the 4 EP ranks, which the ``.cpu()`` waits on."""
    from search.costmodel.kernels import GPU_EFFICIENCY, LAUNCH_MS
    from tests.unit.test_moe_cost import HBM, NVLINK, PEAK
    e = GPU_EFFICIENCY["h100"]
    T, h, E, k, dt = 1024, 1024, 8, 2, 2
    gemm = lambda flops: flops / (PEAK * e.gemm) + LAUNCH_MS          # noqa: E731
    mem = lambda nbytes: nbytes / (HBM * e.mem) + LAUNCH_MS           # noqa: E731
    permute = dt * T * h + T * k * (dt * h + 4)
    out = gemm(2 * T * E * h) + mem(2 * dt * T * h + T * E * (dt + 13) + (permute / 2 if dispatcher == "alltoall"
                                                                          else 0.0))
    if not overlap:
        out += gemm(2 * T * FS * h + 2 * T * h * FS) + mem(2 * dt * T * FS)
    if dispatcher == "allgather":
        out += 3 * 0.003 + 3 / 4 * 4 * T * (h * dt + E * 5) / NVLINK        # ring all-gather over 4 ranks
    return out


@pytest.mark.parametrize("dispatcher,overlap", [("alltoall", False), ("alltoall", True), ("flex", False),
                                                ("allgather", False)])
def test_moe_forward_before_the_host_wait_by_hand(dispatcher, overlap):
    from search.costmodel.moe_cost import moe_unit
    m = tiny_moe(moe_router_force_load_balancing=True, moe_shared_expert_intermediate_size=FS)
    src, _ = _table(m)
    cfg = MoEPlanSettings(token_dispatcher=dispatcher, shared_expert_overlap=overlap)
    cost = moe_unit(src, 1.0, 1024, 1, False, 4, 1, cfg)[0]
    assert cost.fwd_before_wait == pytest.approx(_before_wait_by_hand(dispatcher, overlap), rel=1e-9)
    assert cost.fwd_before_wait < cost.fwd


def test_pre_dispatch_work_hides_no_launch_after_the_wait_by_hand():
    """The experts' 21 launches, made after the wait, hide only behind the moe unit's device time after the
    dispatch: exposed max(30 L - D_layer, 21 L - (D_moe - before)) (graphs of moe_router + moe_preprocess: 7 + 1 + 1
    + 21 launches of L ms each). The shared expert's ~2 ms before the wait hid all of it when the launches were
    priced against the whole D_moe (max(30 L - D_layer, 21 L - D_moe) < 0 here); now ~0.94 ms is exposed."""
    m = tiny_moe(moe_router_force_load_balancing=True, moe_shared_expert_intermediate_size=FS)
    launch = _launch_by_hand("h100")
    _, t = _table(m, graphs=frozenset({"moe_router", "moe_preprocess"}))
    i = [u.kind for u in m.units].index("moe")
    assert t.host_ms is not None                             # f2e66ec priced no wait here
    dev_moe = t.fwd_ms[i] - t.host_ms[i]
    dev = t.fwd_ms[i - 1] + dev_moe
    before = _before_wait_by_hand("alltoall", False)
    assert max(30 * launch - dev, 21 * launch - dev_moe) < 0               # what the whole unit's time hid
    want = max(30 * launch - dev, 21 * launch - (dev_moe - before))
    assert want > 0.9
    assert t.host_ms[i] == pytest.approx(want, rel=1e-9)
    assert t.fwd_ms[i] == pytest.approx(dev_moe + want, rel=1e-9)
    # the same shared expert beside the dispatch (moe_shared_expert_overlap) runs after the wait: it hides them
    _, ov = _table(m, moe=MoEPlanSettings(shared_expert_overlap=True), graphs=frozenset({"moe_router",
                                                                                          "moe_preprocess"}))
    assert ov.host_ms is None or ov.host_ms[i] == 0.0


def test_graph_buffers_by_hand():
    """GRAPH_BUFFERS tensors of dt s b h per captured unit and micro-batch in flight: 2 layers, attention and moe
    captured, 1 stage (one micro-batch in flight), b 1 s 1024 h 1024 bf16."""
    m = tiny_moe()
    cl = parse_cluster("1x4-h100")
    plan = uniform_plan(m, 1, 1, 4, 4, 8, cluster=cl).model_copy(update={"moe": MoEPlanSettings()})
    plan = plan.model_copy(update={"stages": [plan.stages[0].model_copy(update={"ep": 4, "etp": 1})]})
    cm = make_cost_model(m, cl, TrainingSpec(global_batch_size=8))
    feats = Features.of_plan(plan)._replace(stack=StackKey(graphs=frozenset({"attn", "moe_router"}),
                                                           graph_impl="transformer_engine"))
    sc = cm.stage_cost(0, 1, 0, 0, m.num_units, 1, 4, [0] * m.num_units, 4, features=feats, ep=4, etp=1,
                       moe=plan.moe)
    want = 2 * 2 * GRAPH_BUFFERS * 2 * 1024 * 1 * 1024 / MB     # 2 layers x 2 units x buffers x bytes, 1 in flight
    assert sc.memory_breakdown["cuda_graphs"] == pytest.approx(want)


# ----- EP overlap -----------------------------------------------------------------------------------------------
def test_layer_pair_schedule_by_hand():
    """comm: c_b | d_f -> d_b | c_f; comp: attn_f | mlp_b -> dw -> mlp_f | attn_b (model_chunk_schedule_plan.run).
    attn_f 2, attn_b 3, mlp_f 4, mlp_b 5 (dgrad), dw 0, every all-to-all 1: c_b ends 1; attn_f 2; mlp_b starts 2,
    ends 7; d_f starts 2, ends 3; d_b starts max(3, 7) = 7, ends 8; mlp_f starts max(7, 3), ends 11; c_f starts 11,
    ends 12; attn_b starts max(11, 8), ends 14: 14 (sequential 18, saving 4: all the communication)."""
    x = LayerTimes(2, 3, 0, 4, 5, 0, 1, 1, 1, 1)
    assert layer_pair_ms(x) == pytest.approx(14.0)
    assert saving_ms(x) == pytest.approx(4.0)
    # long all-to-alls: d_f 6 -> mlp_f waits for it: mlp_b 2..7, d_f 2..8, d_b 8..9, mlp_f 8..12, c_f 12..13,
    # attn_b 12..15
    y = LayerTimes(2, 3, 0, 4, 5, 0, 6, 1, 1, 1)
    assert layer_pair_ms(y) == pytest.approx(15.0)
    # tax: 10% of the hidden communication
    assert layer_pair_ms(x, 0.1) == pytest.approx(14.0 + 0.1 * 4.0)


def test_delayed_wgrad_hides_the_dispatch_backward():
    """Without delay_wgrad_compute the dispatch backward waits for the whole mlp backward (dgrad 3 + wgrad 2);
    with it only for the dgrad, and runs beside the wgrad: d_b 4 long, mlp_f 1. Without: mlp_b 2..7, d_f 2..3, d_b
    7..11, mlp_f 7..8, c_f 11..12, attn_b (waits d_b) 11..14. With: mlp_b 2..5, dw 5..7, d_b 5..9, mlp_f 7..8, c_f
    9..10, attn_b 9..12."""
    no = LayerTimes(2, 3, 0, 1, 5, 0, 1, 1, 4, 1)
    yes = LayerTimes(2, 3, 0, 1, 3, 2, 1, 1, 4, 1)
    assert layer_pair_ms(no) == pytest.approx(14.0)
    assert layer_pair_ms(yes) == pytest.approx(12.0)


# ----- optimizers -----------------------------------------------------------------------------------------------
def test_newton_schulz_flops_by_hand():
    # 5 iterations of X <- aX + (bA + cA^2)X, A = X X^T on a 1024 x 4096 shard: 4 m^2 n + 2 m^3 each
    assert ns_flops(1024, 4096) == pytest.approx(5 * (4 * 1024 ** 2 * 4096 + 2 * 1024 ** 3))
    assert ns_flops(4096, 1024) == ns_flops(1024, 4096)


def test_muon_matrices_of_a_gqa_attention_by_hand():
    """QKV split into q, k, v (muon_split_qkv): q (heads x d / tp, h), k and v (groups x d / tp, h); proj (h, q / tp)."""
    from search.spec.model import ModelSpec
    m = ModelSpec(name="g", family="llama", num_layers=2, hidden_size=1024, num_attention_heads=16,
                  num_query_groups=4, ffn_hidden_size=2048, seq_length=1024, vocab_size=32000, activation="swiglu",
                  normalization="rmsnorm", position_embedding="rope", add_bias_linear=False, tied_embeddings=False)
    assert muon_matrices(m, "attention", 2) == [(512, 1024, 1), (128, 1024, 2), (1024, 512, 1)]
    assert muon_matrices(m, "mlp", 2) == [(2048, 1024, 1), (1024, 1024, 1)]


def _muon_cost(optimizer: str, dist: bool = False):
    m = tiny_moe()
    dense = m.model_copy(update={"moe": None, "name": "tiny"})
    cl = parse_cluster("1x8-h100")
    tr = TrainingSpec(global_batch_size=16, micro_batch_sizes=[1], optimizer=optimizer)
    cm = make_cost_model(dense, cl, tr)
    plan = uniform_plan(dense, 1, 1, 8, 8, 16, cluster=cl, distributed_optimizer=dist)
    return cm, plan, cm.evaluate(plan)


def test_muon_states_and_step_by_hand():
    """Muon keeps 8 B per 2-D weight (fp32 main + momentum) where Adam keeps 12, unsharded; its step adds the
    Newton-Schulz FLOPs at the bf16 GEMM ceiling and MUON_BYTES per Muon parameter; dist_muon shards states and step
    over dp 8, all-reduces the gradients and all-gathers the parameters."""
    cm, plan, adam = _muon_cost("adam")
    _, _, muon = _muon_cost("muon")
    _, _, dist = _muon_cost("dist_muon")
    d = cm.model
    mats = [x for k in ("attention", "mlp") for x in muon_matrices(d, k, 1)]
    muon_params = d.num_layers * sum(r * c * n for r, c, n in mats)
    assert adam.stages[0].memory_breakdown["optimizer"] - muon.stages[0].memory_breakdown["optimizer"] == \
        pytest.approx(muon_params * (12 - 8) / MB)
    ns = d.num_layers * sum(n * ns_flops(r, c) for r, c, n in mats)
    hbm = cm.cluster.gpu.hbm_gbps * 1e6 * 0.8
    want = muon_params * (MUON_BYTES / hbm - cm._opt_ms_per_param) + ns / cm._ns_rate
    assert muon.stages[0].optimizer_ms - adam.stages[0].optimizer_ms == pytest.approx(want, rel=1e-6)
    assert dist.stages[0].memory_breakdown["optimizer"] == pytest.approx(
        muon.stages[0].memory_breakdown["optimizer"] / 8, rel=1e-6)
    assert "param_gather" in dist.stages[0].comm and "param_gather" not in muon.stages[0].comm
    assert dist.stages[0].comm["dp"][0] + dist.stages[0].comm["dp"][1] == pytest.approx(
        muon.stages[0].comm["dp"][0] + muon.stages[0].comm["dp"][1])          # both all-reduce the gradients


# ----- router, loss, sinks --------------------------------------------------------------------------------------
def test_router_dtype_runs_the_gate_at_the_fp32_rate():
    """moe_router_dtype fp32: the gate GEMM on the fp32 kernel model, the logits read at 4 bytes, the input's cast
    (dt + 4) T h; moe_router_fusion: the scores not written and re-read (2 x 4 T E fewer bytes)."""
    from search.costmodel.moe_cost import moe_parts
    m = tiny_moe()
    cl = parse_cluster("1x8-h100")
    src = AnalyticSource(m, cl, TrainingSpec(global_batch_size=8), CommModel(cl), kernels="flat")
    T, E, h = 1024, 8, 1024
    base = moe_parts(src, 1.0, 1024, 1, False, 4, 1, MoEPlanSettings())["router"][0]
    wide = moe_parts(src, 1.0, 1024, 1, False, 4, 1, MoEPlanSettings(router_dtype="fp32"))["router"][0]
    k, k32 = src.kern, src.kern_wide("fp32")
    extra_bytes = (4 - 2) * T * E + (2 + 4) * T * h
    want = base - k.gemm([(T, E, h)]) + k32.gemm([(T, E, h)]) + extra_bytes / (k.hbm * k.eff.mem)
    assert wide == pytest.approx(want, rel=1e-9)
    fused = moe_parts(src, 1.0, 1024, 1, False, 4, 1, MoEPlanSettings(router_fusion=True))["router"][0]
    assert base - fused == pytest.approx(2 * 4 * T * E / (k.hbm * k.eff.mem), rel=1e-9)


def test_te_cross_entropy_keeps_only_the_gradient():
    """--cross-entropy-fusion-impl te: the head keeps dt per logit instead of the fp32 softmax (4) and has no
    transient; its passes are 2 dt forward and 2 dt backward beyond the read."""
    from search.costmodel.types import TableStack
    m = tiny_moe().model_copy(update={"moe": None, "name": "tiny"})
    cl = parse_cluster("1x8-h100")
    src = AnalyticSource(m, cl, TrainingSpec(global_batch_size=8), CommModel(cl), kernels="flat")
    plain, te = src.unit_table(1.0, 1), src.unit_table(1.0, 1, stack=TableStack(ce_fusion="te"))
    logits = 1024 * m.padded_vocab_size
    assert plain.head_act_mb - te.head_act_mb == pytest.approx((4 - 2) * logits / MB)
    assert te.head_peak_mb == 0.0 and plain.head_peak_mb == pytest.approx(2 * logits / MB)
    k = src.kern                       # flat kernels: the unfused loss moves 24 bytes per logit beyond the read
    assert plain.head_fwd_ms - te.head_fwd_ms == pytest.approx((k.ce_bytes[0] - 4) * logits / (k.hbm * k.eff.mem),
                                                               rel=1e-9)


def test_attention_sinks_scale_the_fused_attention(monkeypatch):
    """A learnable softmax offset runs cuDNN's sink attention at SINK_ATTN_SCALE of the vanilla rate: the core's
    forward (its launch excepted) divided by the scale; vanilla models are untouched."""
    from search.costmodel import analytic
    m = tiny_moe().model_copy(update={"moe": None, "name": "tiny"})
    sink = m.model_copy(update={"softmax_type": "learnable"})
    cl = parse_cluster("1x8-b200")
    monkeypatch.setitem(rcs.BASE, "SINK_ATTN_SCALE", {"hopper": 1.0, "blackwell": 0.25})
    monkeypatch.setattr(rcs, "FITS", {k: (v[0], {}, {}) for k, v in rcs.FITS.items()})
    monkeypatch.setattr(rcs, "POOLED", {})
    tr = TrainingSpec(global_batch_size=8)
    a = AnalyticSource(m, cl, tr, CommModel(cl))._core(1.0, 1024, 1024, 1, True)
    b = AnalyticSource(sink, cl, tr, CommModel(cl))._core(1.0, 1024, 1024, 1, True)
    from search.costmodel.kernels import LAUNCH_MS
    assert b[0] - LAUNCH_MS == pytest.approx((a[0] - LAUNCH_MS) / 0.25)
    assert analytic.sink_attention_scale(m, "", "b200") == 1.0


# ----- fine-grained offload, capacity, FSDP dtypes ----------------------------------------------------------------
def test_offload_input_bytes_by_hand():
    from search.costmodel.stack_cost import offload_input_bytes
    m = tiny_moe()
    # core_attn: Q, K, V = dt s b (q + 2 kv) / t; attn_proj: dt s b q / t; expert_fc1: dt m h, m = etp T k
    assert offload_input_bytes(m, "attention", "core_attn", 1, 1024, 1, False, 2) == 2 * 1024 * 3 * 1024
    assert offload_input_bytes(m, "attention", "attn_proj", 1, 1024, 2, True, 2) == 2 * 1024 * 1024 / 2
    assert offload_input_bytes(m, "moe", "expert_fc1", 1, 1024, 1, False, 2, 4, 1) == 2 * 1024 * 2 * 1024
    assert offload_input_bytes(m, "moe", "moe_act", 1, 1024, 1, False, 2, 4, 1) == 2 * 2048 * 512


# What megatron-core moves (core_v0.16.1 to core_v0.19.0 alike): stack_cost.moves. 4 layers of 4096 hidden, 32 heads
# (MHA), seq 8192, one sequence per rank at tp 1, pp 1 (one micro-batch in flight; the last layer's copy in flight)
OFF_MODEL = dict(name="tiny-gpt", family="llama", num_layers=4, hidden_size=4096, num_attention_heads=32,
                 ffn_hidden_size=11008, seq_length=8192, vocab_size=32000, activation="swiglu",
                 normalization="rmsnorm", position_embedding="rope", add_bias_linear=False, tied_embeddings=False,
                 params_dtype="bf16")
QKV_MIB = 2 * 8192 * 3 * 4096 / 2**20          # core_attn: Q, K, V, dt s b (q + 2 kv) / t = 192 MiB per layer
H_MIB = 2 * 8192 * 4096 / 2**20                # attn_proj (dt s b q / t) and the norms' input (dt s b h): 64 MiB


def _offload_stage(modules, recompute, attention="flash", model=None, fraction=1.0):
    """(the fine_grained_offload memory term, the offload_copies term) of the one-stage plan, 8 H100s, dp 8."""
    import numpy as np

    from search.costmodel.types import RC_CODE
    from search.spec.model import ModelSpec
    m = model or ModelSpec(**OFF_MODEL)
    cm = make_cost_model(m, parse_cluster("1x8-h100"), TrainingSpec(global_batch_size=64, attention=attention))
    units = m.units
    rc = np.array([RC_CODE[recompute(u.kind)] for u in units], dtype=np.int8)
    sk = StackKey(offload_modules=tuple(modules), offload_fraction=fraction)
    c = cm.stage_cost(0, 1, 0, 0, len(units), 1, 8, rc, 8, features=Features(stack=sk))
    return c.memory_breakdown.get("fine_grained_offload", 0.0), c.terms.get("offload_copies", 0.0)


def test_offload_under_full_recompute_moves_nothing():
    """megatron-core's config accepts the offload with full recompute (no check in any release's __post_init__),
    but the checkpointed forward runs without grad and saves no module input, so nothing goes to the host: no
    memory off the GPU, no copies (before: 3 x 192 MiB "saved" on top of full recompute's savings)."""
    assert _offload_stage(["core_attn"], lambda k: "none")[0] == pytest.approx(-3 * QKV_MIB)
    assert _offload_stage(["core_attn"], lambda k: "full") == (0.0, 0.0)
    assert _offload_stage(["core_attn", "attn_proj"], lambda k: "full") == (0.0, 0.0)


def test_core_attn_offload_is_skipped_where_the_core_attention_is_recomputed():
    """``Attention.forward`` (0.16.1 attention.py:1134-1190; 0.19.0 :1541-1597) offloads the core's input only on the
    path that does not checkpoint it: with ``--recompute-modules core_attn`` only attn_proj's input (the core's
    output) moves."""
    def sel(k):
        return "selective" if k == "attention" else "none"
    assert _offload_stage(["core_attn"], sel) == (0.0, 0.0)
    assert _offload_stage(["core_attn", "attn_proj"], sel)[0] == pytest.approx(-3 * H_MIB)
    assert _offload_stage(["core_attn", "attn_proj"], lambda k: "none")[0] == pytest.approx(-3 * (QKV_MIB + H_MIB))


def test_norms_fused_by_transformer_engine_are_not_moved():
    """transformer-engine's spec fuses the pre-attention norm into linear_qkv and the dense MLP's into linear_fc1
    (``TELayerNormColumnParallelLinear``; ``input_layernorm`` / ``pre_mlp_layernorm`` are ``IdentityOp``: 0.16.1
    gpt_layer_specs.py ``get_gpt_layer_with_transformer_engine_spec``, :271-291), whose offload ``TransformerLayer``
    skips (``not isinstance(..., IdentityOp)``, 0.16.1 transformer_layer.py:448-457; 0.19.0 :1430-1438): nothing
    moves. megatron-core's local spec keeps them as separate norms (``get_gpt_layer_local_spec``): their input,
    dt s b h, moves. An MoE layer keeps its pre-MLP norm under TE too (``backend.layer_norm()`` where
    ``num_experts``, :291): moved."""
    for norm in ("attn_norm", "mlp_norm"):
        assert _offload_stage([norm], lambda k: "none") == (0.0, 0.0)
        assert _offload_stage([norm], lambda k: "none", attention="unfused")[0] == pytest.approx(-3 * H_MIB)
    m = tiny_moe()          # 2 layers, h 1024, s 1024: one layer's residual stream off the GPU (the last in flight)
    assert _offload_stage(["mlp_norm"], lambda k: "none", model=m)[0] == pytest.approx(-2 * 1024 * 1024 / 2**20)
    assert _offload_stage(["attn_norm"], lambda k: "none", model=m) == (0.0, 0.0)


def test_the_offload_fraction_and_margin_count_groups_as_megatron_core_does():
    """megatron-core 0.19 ``post_warmup_callback`` (fine_grained_activation_offload.py:566-626): a group is one
    module's input in one layer; each module's last group stays on the GPU (the margin), then of a chunk's other
    groups that move bytes the last ``int(n (1 - fraction))`` stay. 4 dense layers, core_attn, fraction 0.6: the
    margin keeps layer 3, int(3 x 0.4) = 1 more stays (layer 2): layers 0 and 1 move (before: int(4 x 0.6) = 2
    layers counted, less the last one in flight, 1 x 192 MiB). A hybrid M-M*-M-M (Nemotron-H's layers) has one
    attention layer: core_attn's only group is its margin, so nothing moves (before: its 192 MiB counted moved,
    the fraction taken over all eight layers)."""
    from tests.hybrid_plans import MAMBA8
    assert _offload_stage(["core_attn"], lambda k: "none", fraction=0.6)[0] == pytest.approx(-2 * QKV_MIB)
    assert _offload_stage(["core_attn", "attn_proj"], lambda k: "none", fraction=0.5)[0] == \
        pytest.approx(-(QKV_MIB + H_MIB) - QKV_MIB)    # 6 groups besides the margin, 3 move: L0 both, L1 core_attn
    assert _offload_stage(["core_attn"], lambda k: "none", model=MAMBA8) == (0.0, 0.0)


def test_capacity_and_paged_stash_memory_by_hand():
    """moe_expert_rank_capacity_factor c = 1.5: (c - 1) x the experts' fc1 and activation inputs more per MoE layer
    in flight; paged stash: 0.10 x them (the 1.10 page factor) plus one layer's capacity buffer."""
    from search.costmodel.stack_cost import PAGED_STASH_FACTOR, offload_input_bytes
    m = tiny_moe()
    cl = parse_cluster("1x4-b200")
    per = sum(offload_input_bytes(m, "moe", x, 1, 1024, 1, False, 2, 4, 1) for x in ("expert_fc1", "moe_act"))
    cm = make_cost_model(m, cl, TrainingSpec(global_batch_size=8))
    for stash, want in ((False, 0.5 * per * 2), (True, (PAGED_STASH_FACTOR - 1) * per * 2 + 0.5 * per)):
        s = MoEPlanSettings(token_dispatcher="flex", flex_backend="hybridep", rank_capacity_factor=1.5,
                            paged_stash=stash)
        sc = cm.stage_cost(0, 1, 0, 0, m.num_units, 1, 4, [0] * m.num_units, 4, ep=4, etp=1, moe=s)
        assert sc.memory_breakdown["moe_capacity"] == pytest.approx(want / MB)


# ----- releases --------------------------------------------------------------------------------------------------
def test_release_table_resolves_containers_and_megatron_versions():
    assert resolve(None)[0] == "26.04.01"
    assert resolve("25.11") == ("25.11", None)
    assert resolve("0.16")[0] == "26.02.01" and resolve("core_v0.16.1")[0] == "26.02.01"
    assert resolve("0.17.0")[0] == "26.04.01"
    rel, note = for_megatron("0.19.2")
    assert rel == "26.04.01" and "0.19.2" in note
    name, note = resolve("26.03")
    assert name == "26.02.01" and "nearest older" in note
    from search.io.errors import AcesoError
    for bad in ("0.12", "nope"):
        with pytest.raises(AcesoError):
            resolve(bad)
    name, note = resolve("24.01")           # an MLPerf submission's NeMo 24.04: the nearest priced, the oldest
    assert name == "25.09" and "older than every container" in note


def test_release_constants_fall_back_to_the_nearest_older_fit(monkeypatch):
    monkeypatch.setattr(rcs, "FITS", {"25.09": (("25.09",), {"GROUPED_K0_LP": 1.0}, {"GROUPED_K0_LP": 3}),
                                      "25.11": (("25.11",), {}, {}),
                                      "26.04.01": (("26.04", "26.04.01"), {"GROUPED_K0_LP": 3.0}, {})})
    assert rcs.value("GROUPED_K0_LP", "25.11") == 1.0          # 25.11 has none: 25.09's
    assert rcs.value("GROUPED_K0_LP", "26.04") == 3.0
    assert rcs.value("GROUPED_K0_LP", "26.02") == 1.0          # 26.02 has no fit: the nearest older group
    assert rcs.value("HOST_LAUNCH_MS", "25.09") == rcs.BASE["HOST_LAUNCH_MS"]
    assert rcs.fit_of("26.02.01") == "25.11"


# ----- the search's stack choices ----------------------------------------------------------------------------------
def test_megatron_lm_search_takes_cuda_graphs_where_the_moe_layers_are_host_bound():
    """A dropless Qwen3-30B-A3B of 4 layers at mbs 1 on 8 H100s is host-bound (its dispatcher synchronises): the
    finalist priced under the transformer-engine graphs of attn / moe_router / moe_preprocess loses their launches'
    host time, so the megatron-lm target's variants take them, and the exported plan carries them; the aceso target
    (whose runtime captures no graph) does not offer them."""
    from search.costmodel.types import Features
    from search.planner.dispatchers import Dispatchers, graph_candidates
    from search.planner.state import Evaluator, State, to_plan
    from search.costmodel.types import Shape
    from search.spec.presets import load_model
    from search.megatron.expressible import megatron_config
    from search.megatron.names import megatron_lm_args
    m = load_model("qwen3-30b-a3b", num_layers=4)
    cl = parse_cluster("1x8-h100")
    tr = TrainingSpec(global_batch_size=16, micro_batch_sizes=[1])
    cm = make_cost_model(m, cl, tr)
    st = State(8, (Shape(1, 8, 1, False, 8, 1),), tuple(m.layer_starts[:1]) + (m.num_units,),
               Features(True, True, True))
    e = Evaluator(cm, 16, None, "megatron-lm").evaluate(st, charge=False, exact=True)
    assert e.fits
    best = Dispatchers(cm, 16, "megatron-lm").best(e)
    assert best.iteration_ms < e.iteration_ms
    stack = best.state.features.stack
    assert stack is not None and stack.graphs in {g.graphs for g in graph_candidates(m, "megatron-lm")}
    plan = to_plan(best, m, cl, 16, "analytic", predicted=False)
    flags = " ".join(sum(megatron_lm_args(megatron_config(plan)).values(), []))
    assert "--cuda-graph-impl transformer_engine --cuda-graph-scope" in flags
    assert graph_candidates(m, "aceso") == [] and graph_candidates(load_model("gpt-1.3b"), "megatron-lm") == []


# ----- import / export ---------------------------------------------------------------------------------------------
STACK_LINE = ("--num-layers 4 --hidden-size 1024 --num-attention-heads 8 --ffn-hidden-size 2048 --seq-length 1024 "
              "--max-position-embeddings 1024 --position-embedding-type rope --normalization RMSNorm --swiglu "
              "--untie-embeddings-and-output-weights --disable-bias-linear --attention-dropout 0.0 "
              "--hidden-dropout 0.0 --num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 512 "
              "--expert-model-parallel-size 4 --moe-token-dispatcher-type alltoall --moe-grouped-gemm "
              "--moe-permute-fusion --moe-router-dtype fp32 --moe-router-fusion --pipeline-model-parallel-size 2 "
              "--num-virtual-stages-per-pipeline-rank 2 --overlap-moe-expert-parallel-comm --delay-wgrad-compute "
              "--cuda-graph-impl transformer_engine --cuda-graph-scope attn moe_router moe_preprocess "
              "--fine-grained-activation-offloading --offload-modules core_attn attn_proj "
              "--cross-entropy-loss-fusion --cross-entropy-fusion-impl te --optimizer dist_muon "
              "--micro-batch-size 1 --global-batch-size 16 --bf16 --tokenizer-type NullTokenizer "
              "--vocab-size 31999")


def test_stack_flags_import_and_export_round_trip():
    """The flags Megatron-Bridge's 2026 recipes set read into the plan's fields, export as the same flags (each a
    core_v0.16.1 flag), and the exported line reads back to the same plan."""
    from search.megatron.cmdline import megatron_flags
    from search.megatron.expressible import megatron_config
    from search.megatron.importer import read_megatron
    from search.megatron.script import args_line
    from search.megatron.versions import release
    plan = read_megatron(STACK_LINE, world_size=8, release="26.04.01").plan
    assert plan.stack.cuda_graphs.impl == "transformer_engine"
    assert plan.stack.cuda_graphs.scope == ("attn", "moe_router", "moe_preprocess")
    assert plan.stack.offload.modules == ("core_attn", "attn_proj") and plan.stack.offload.fraction == 1.0
    assert plan.stack.cross_entropy_fusion == "te"
    assert plan.moe.overlap_ep_comm and plan.moe.delay_wgrad and plan.moe.router_fusion
    assert plan.moe.router_dtype == "fp32"
    assert plan.settings.optimizer == "dist_muon" and plan.settings.release == "26.04.01"
    # written for core_v0.17.1, the newest Megatron-LM that runs --cross-entropy-fusion-impl te (0.18+ refuse it and
    # get native: tests/unit/test_te_loss_fusion_export.py)
    line = args_line(megatron_config(plan), release("0.17"))
    flags = {t for t in line.split() if t.startswith("--")}
    assert flags - megatron_flags() == set()
    for f in ("--cuda-graph-impl", "--delay-wgrad-compute", "--moe-router-dtype", "--moe-router-fusion",
              "--fine-grained-activation-offloading", "--cross-entropy-fusion-impl", "--optimizer"):
        assert f in flags
    back = read_megatron(line, world_size=8, release="26.04.01", version="0.17").plan
    assert back.model_dump(exclude={"predicted"}) == plan.model_dump(exclude={"predicted"})


@pytest.mark.parametrize("edit,needle", [
    ("--cuda-graph-scope attn moe_router moe_preprocess", "--cuda-graph-scope attn bogus"),
    ("--optimizer dist_muon", "--optimizer dist_muon --use-distributed-optimizer"),
    ("--optimizer dist_muon", "--optimizer sgd"),
    ("--offload-modules core_attn attn_proj", "--offload-modules attn_proj"),
    ("--overlap-moe-expert-parallel-comm --delay-wgrad-compute", "--delay-wgrad-compute"),
])
def test_stack_flags_megatron_refuses_are_one_line_errors(edit, needle):
    from search.io.errors import AcesoError
    from search.megatron.importer import read_megatron
    line = STACK_LINE.replace(edit, needle)
    with pytest.raises(AcesoError) as e:
        read_megatron(line, world_size=8)
    assert "\n" not in str(e.value)


# ----- whole-layer CUDA graphs on dropless MoE -----------------------------------------------------------------------
def _graphed(scope, moe_spec=None, moe=None, impl="transformer_engine"):
    import pydantic

    from search.settings.stack import CudaGraphs, StackSettings
    plan = uniform_plan(tiny_moe(**(moe_spec or {})), 1, 1, 4, 4, 8, cluster=parse_cluster("1x4-h100"))
    data = plan.model_dump()
    data["settings"]["stack"] = StackSettings(cuda_graphs=CudaGraphs(impl=impl, scope=tuple(scope))).model_dump()
    data["settings"]["moe"] = (moe or MoEPlanSettings()).model_dump()
    try:
        type(plan).model_validate(data)
    except pydantic.ValidationError as e:
        return str(e)
    return None


@pytest.mark.parametrize("impl", ["transformer_engine", "local"])
def test_whole_layer_graphs_on_dropless_moe_are_refused(impl):
    """An empty scope graphs whole layers (megatron-core 0.16.1 / 0.19 ``_layer_is_graphable``: every layer;
    ``MoETransformerLayer``: one manager for the layer). A dropless MoE layer's dispatcher copies its token counts to
    the host and waits for them inside the layer (``MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize``:
    ``d2h_event.synchronize()``, skipped only with ``drop_and_pad``), which a stream capture cannot hold. Before,
    only an explicit ``moe`` scope was refused on dropless MoE."""
    why = _graphed((), impl=impl)
    assert why is not None and "stack.cuda_graphs.scope empty (whole layers) on dropless MoE" in why
    assert "use scope moe_router moe_preprocess (with attn) or pad the expert input" in why
    # what megatron-core captures: drop-and-pad layers whole, dropless ones up to the dispatch
    padded = {"moe_expert_capacity_factor": 1.0, "moe_pad_expert_input_to_capacity": True}
    assert _graphed((), padded, impl=impl) is None
    assert _graphed(("attn", "moe_router", "moe_preprocess"), impl=impl) is None
    # 0.19's per-rank capacity bounds HybridEP's buffers: no host sync (``_HybridEPManager.num_permuted_tokens``)
    bounded = MoEPlanSettings(token_dispatcher="flex", flex_backend="hybridep", rank_capacity_factor=1.5)
    assert _graphed((), moe=bounded, impl=impl) is None


def test_whole_layer_graph_flags_on_dropless_moe_are_one_line_at_import():
    from search.io.errors import AcesoError
    from search.megatron.importer import read_megatron
    line = STACK_LINE.replace("--cuda-graph-scope attn moe_router moe_preprocess ", "") \
        .replace("--overlap-moe-expert-parallel-comm --delay-wgrad-compute ", "")
    assert "--cuda-graph-impl transformer_engine" in line and "--cuda-graph-scope" not in line
    with pytest.raises(AcesoError, match="whole layers") as e:
        read_megatron(line, world_size=8)
    assert "\n" not in str(e.value)
