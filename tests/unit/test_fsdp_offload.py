"""Megatron FSDP and CPU activation offload: the schema fields and their rules (search/settings/fsdp.py), each cost formula
against a hand-computed case (costmodel/sharding.py, costmodel/offload.py), and the Megatron-LM / Bridge flags both
ways (every exported flag in core_v0.16.1's list; export -> import gives the same plan at the same price)."""

import json
from pathlib import Path

import pytest

from search.spec.cluster import parse_cluster
from search.pricing import make_cost_model
from search.costmodel.memory import MB
from search.costmodel.offload import HOST_LINK_EFFICIENCY, host_link_gbps, offload_ms
from search.costmodel.sharding import IN_FLIGHT_LAYERS, fsdp_buffer_mb, per_micro_batch, state_divisors
from search.costmodel.types import RunSettings
from search.io.errors import AcesoError
from search.settings.fsdp import ActivationOffload, MegatronFSDP, shards
from search.megatron import megatron_config
from search.megatron.cmdline import megatron_flags
from search.megatron.importer import read_megatron
from search.megatron.names import bridge_fields
from search.megatron.script import argv
from search.spec.plan import parse_plan, uniform_plan
from search.settings.plan_settings import target_settings
from search.spec.presets import load_model
from search.spec.training import TrainingSpec

MODEL = load_model("llama3-8b", num_layers=4)
CLUSTER = parse_cluster("1x8-h100")
ON = dict(overlap_grad_reduce=True, overlap_param_gather=True)


def _plan(strategy=None, offload=0, recompute="none", pp=1, **kw):
    feats = dict(ON, **kw)
    if strategy:
        feats["megatron_fsdp"] = MegatronFSDP(data_parallel_sharding_strategy=strategy)
    if offload:
        feats["activation_offload"] = ActivationOffload(num_layers=offload)
    p = uniform_plan(MODEL, pp, 1, 8 // pp, 8 // pp, 64, recompute, CLUSTER, **feats)
    return p.model_copy(update={"settings": target_settings("megatron-lm", p.settings, "bf16", grad_reduce_in_bf16=True)})


def _on_runtime(p):
    """``p`` as the aceso runtime runs it (its switches under the runtime's defaults)."""
    return p.model_copy(update={"settings": target_settings("runtime", p.settings)})


def _cm():
    return make_cost_model(MODEL, CLUSTER, TrainingSpec(global_batch_size=64), settings=RunSettings())


# ----- schema ---------------------------------------------------------------------------------------------------
def test_plans_without_the_fields_read_and_the_fields_round_trip():
    old = json.loads(_plan(distributed_optimizer=True).to_json())
    assert "megatron_fsdp" not in old and parse_plan(old).megatron_fsdp is None
    new = _plan("optim_grads", offload=2)
    back = parse_plan(json.loads(new.to_json()))
    assert back.megatron_fsdp.data_parallel_sharding_strategy == "optim_grads"
    assert back.activation_offload.num_layers == 2


@pytest.mark.parametrize("n,kw,needle", [
    (4, {}, "activation_offload.num_layers (4) must be below the model's 4 layers"),
    (1, dict(pp=2), "activation_offload needs one pipeline stage"),
    (1, dict(recompute="full"), "does not work with activation recompute"),
])
def test_offload_rules_are_one_line(n, kw, needle):
    raw = json.loads(_plan(distributed_optimizer=True, **kw).to_json())
    raw["settings"]["activation_offload"] = {"num_layers": n}
    with pytest.raises(AcesoError) as e:
        parse_plan(raw)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_bad_strategy_names_the_field():
    raw = json.loads(_plan(distributed_optimizer=True).to_json())
    raw["settings"]["megatron_fsdp"] = {"data_parallel_sharding_strategy": "zero3"}
    with pytest.raises(AcesoError, match="data_parallel_sharding_strategy"):
        parse_plan(raw)


def test_a_v4_plan_with_a_switch_at_the_top_level_says_where_it_moved():
    raw = json.loads(_plan(distributed_optimizer=True).to_json()) | {"activation_offload": {"num_layers": 1}}
    with pytest.raises(AcesoError) as e:
        parse_plan(raw)
    assert "activation_offload: a plan-wide switch, kept in settings since schema version 4; move it to " \
           "settings.activation_offload" in str(e.value) and "\n" not in str(e.value)


def test_overlap_param_gather_is_allowed_with_fsdp_alone():
    assert _plan("optim_grads_params").overlap_param_gather


# ----- memory -----------------------------------------------------------------------------------------------------
def test_what_each_strategy_shards():
    assert [shards(s) for s in (None, "no_shard", "optim", "optim_grads", "optim_grads_params")] == [
        (False, False, False), (False, False, False), (False, False, True), (False, True, True), (True, True, True)]
    assert state_divisors("", 8, True) == (1, 1, 8) and state_divisors("optim_grads", 8, False) == (1, 8, 8)


@pytest.mark.parametrize("strategy,w_div,g_div,o_div", [
    ("no_shard", 1, 1, 1), ("optim", 1, 1, 8), ("optim_grads", 1, 8, 8), ("optim_grads_params", 8, 8, 8)])
def test_state_memory_by_strategy_hand_computed(strategy, w_div, g_div, o_div):
    """pp 1, tp 1: every rank holds the model's P parameters: bf16 weight 2 B, bf16 gradient 2 B, 12 B of fp32
    master weight and Adam m, v; the strategy divides them by the DP group (8)."""
    P = MODEL.num_parameters
    bd = _cm().evaluate(_plan(strategy)).stages[0].memory_breakdown
    assert bd["params"] == pytest.approx(2 * P / w_div / MB)
    assert bd["grads"] == pytest.approx(2 * P / g_div / MB)
    assert bd["optimizer"] == pytest.approx(12 * P / o_div / MB)
    layer = MODEL.unit_params("attention") + MODEL.unit_params("mlp")
    per_layer = (2 if w_div > 1 else 0) + (2 if g_div > 1 else 0)
    assert bd.get("fsdp_buffers", 0.0) == pytest.approx(2 * layer * per_layer / MB)


def test_buffer_formula():
    assert IN_FLIGHT_LAYERS == 2
    assert fsdp_buffer_mb("optim_grads_params", 8, 2**20, 2.0, 4.0) == pytest.approx(2 * 6.0)
    assert fsdp_buffer_mb("optim_grads", 8, 2**20, 2.0, 4.0) == pytest.approx(2 * 4.0)
    assert fsdp_buffer_mb("optim", 8, 2**20, 2.0, 4.0) == 0.0
    assert fsdp_buffer_mb("optim_grads_params", 1, 2**20, 2.0, 4.0) == 0.0


# ----- time -------------------------------------------------------------------------------------------------------
def test_per_micro_batch_collectives_hand_computed():
    """4 layers, 8 MB of weights and 8 MB of gradients, 1 ms per MB for either collective (no latency): each
    layer's bucket takes 2 ms. Forward (100 ms): the gathers queue behind the layers, the last bucket shows (2 ms),
    the hidden 6 ms tax the compute 10% (0.6). Backward (100 ms): the same gathers, then the reduce-scatters in what
    they leave (100 - 6 ms): again 2 + 0.6 each."""
    ms = lambda b: b / 1e6    # noqa: E731
    exp, ag, rs = per_micro_batch("optim_grads_params", 8, (8e6, 8e6), 4, 100.0, 100.0, ms, ms, 0.1, True, True)
    assert exp == pytest.approx((2.6, 5.2))
    assert ag == pytest.approx((5.2, 12.0)) and rs == pytest.approx((2.6, 6.0))
    exp, ag, rs = per_micro_batch("optim_grads", 8, (8e6, 8e6), 4, 100.0, 100.0, ms, ms, 0.1, True, True)
    assert exp == pytest.approx((0.0, 2.6)) and ag == (0.0, 0.0)
    # a backward too short: 8 ms of reduce-scatter behind 4 ms -> max(2, 8 - 4 * 3/4) = 5 exposed, 3 hidden
    exp, _, rs = per_micro_batch("optim_grads", 8, (8e6, 8e6), 4, 1.0, 4.0, ms, ms, 0.0, True, True)
    assert rs == pytest.approx((5.0, 3.0))
    # no overlap: all of it; no_shard / optim reduce once per iteration instead
    assert per_micro_batch("optim_grads", 8, (8e6, 8e6), 4, 1.0, 4.0, ms, ms, 0.0, True, False)[0] == (0.0, 8.0)
    assert per_micro_batch("optim", 8, (8e6, 8e6), 4, 1.0, 4.0, ms, ms, 0.0, True, True)[0] == (0.0, 0.0)


def test_fsdp_prices_in_the_plan():
    """optim_grads_params reduce-scatters every micro-batch and all-gathers in forward and backward: per iteration
    M times one micro-batch's collectives; no per-iteration DP reduction and no step all-gather."""
    cm = _cm()
    base = cm.evaluate(_plan(distributed_optimizer=True))
    z3 = cm.evaluate(_plan("optim_grads_params"))
    c = z3.stages[0].comm
    assert "dp" not in c and "param_gather" not in c
    assert c["fsdp_param_gather"][1] > 0 and c["fsdp_grad_reduce"][1] > 0
    assert z3.iteration_ms > base.iteration_ms
    assert z3.max_memory_mb < base.max_memory_mb
    z1 = cm.evaluate(_plan("optim"))      # the distributed optimizer's price, to the bit
    assert z1.iteration_ms == pytest.approx(base.iteration_ms) and z1.max_memory_mb == pytest.approx(base.max_memory_mb)


def test_host_link_and_offload_hand_computed():
    """H100: PCIe Gen5 x16, 64 GB/s per direction x 0.8. 1 GiB per layer: 2^30 / 51.2e9 s = 20.97 ms per copy;
    3 layers behind 10 ms each: 3 x 10.97 exposed, 3 x 10 hidden; behind 30 ms: all hidden."""
    assert host_link_gbps("h100") == pytest.approx(64 * HOST_LINK_EFFICIENCY)
    assert host_link_gbps("gb200") == pytest.approx(450 * HOST_LINK_EFFICIENCY)
    x = 2**30 / 51.2e6
    assert offload_ms(1024.0, 3, 10.0, 51.2) == pytest.approx((3 * (x - 10.0), 30.0))
    assert offload_ms(1024.0, 3, 30.0, 51.2) == pytest.approx((0.0, 3 * x))


def test_offload_in_the_plan_moves_all_but_one_layer():
    """Offloading 2 of 4 (identical) layers moves both off the activations x (1 + 5%); the one in flight stays
    only while the last layers run, so the peak adds what of it the loss transient does not cover."""
    cm = _cm()
    a = cm.evaluate(_plan(distributed_optimizer=True)).stages[0]
    b = cm.evaluate(_plan(distributed_optimizer=True, offload=2)).stages[0]
    t = cm.unit_table(8 / 8, 1)
    layer = float(t.act_mb[0, 0] + t.act_mb[1, 0]) * 1.05
    bd = b.memory_breakdown
    assert a.memory_breakdown["activations"] - bd["activations"] == pytest.approx(2 * layer)
    assert bd["offload_in_flight"] == pytest.approx(max(0.0, layer - bd["recompute_peak"]))
    assert a.memory_mb - b.memory_mb == pytest.approx(2 * layer - bd["offload_in_flight"])
    assert "offload" in b.comm and b.fwd_ms >= a.fwd_ms


def test_fsdp_with_fp8_param_gather_stores_and_gathers_one_byte():
    """optim_grads_params over 8 with fp8-tensorwise + param gather: the sharded weights 1 B per linear parameter
    instead of 2 (-1 B / 8 each) and the in-flight layer buffers 1 B per linear weight; hand-computed on the model's
    linear parameters."""
    plan = _plan("optim_grads_params")
    bf = _cm().evaluate(plan).stages[0].memory_breakdown
    fp8 = make_cost_model(MODEL, CLUSTER, TrainingSpec(global_batch_size=64, precision="fp8-tensorwise",
                                                       fp8_param_gather=True), settings=RunSettings())
    mem = fp8.evaluate(plan).stages[0].memory_breakdown
    t = fp8.unit_table(1, 1)
    linear = float(t.weight_params[fp8._lp_mask].sum())
    assert (bf["params"] - mem["params"]) * MB == pytest.approx(linear / 8)
    layer = float(t.weight_params[:2].sum())        # one layer's linear weights (attention + MLP units)
    assert (bf["fsdp_buffers"] - mem["fsdp_buffers"]) * MB == pytest.approx(IN_FLIGHT_LAYERS * layer, rel=1e-3)


def test_offload_with_recompute_never_fits():
    cm = _cm()
    st = cm.stage_cost(0, 1, 0, 0, MODEL.num_units, 1, 8, [2] * MODEL.num_units, 8,
                       features=cm._default_features._replace(offload_layers=1))
    assert not st.fits


# ----- Megatron-LM / Bridge flags ------------------------------------------------------------------------------
@pytest.mark.parametrize("strategy,offload", [("optim_grads_params", 2), ("optim", 0), (None, 3)])
def test_export_flags_are_core_flags_and_round_trip_to_the_same_plan_and_price(strategy, offload):
    plan = _plan(strategy, offload=offload, distributed_optimizer=strategy is None)
    args = argv(megatron_config(plan))
    flags = [a for a in args if a.startswith("--")]
    assert set(flags) <= megatron_flags()
    if strategy:
        i = args.index("--data-parallel-sharding-strategy")
        assert "--use-megatron-fsdp" in args and args[i + 1] == strategy
        assert args[args.index("--ckpt-format") + 1] == "fsdp_dtensor"
    if offload:
        assert args[args.index("--cpu-offloading-num-layers") + 1] == str(offload)
    back = read_megatron(" ".join(args), world_size=8, cluster=CLUSTER).plan
    assert back.megatron_fsdp == plan.megatron_fsdp and back.activation_offload == plan.activation_offload
    if strategy:       # Megatron-LM 0.18+ (the default release) runs the distributed optimizer with FSDP
        assert "--use-distributed-optimizer" in args and back.distributed_optimizer
        plan = plan.model_copy(update={"distributed_optimizer": True})
    assert back.model_dump(exclude={"predicted"}) == plan.model_dump(exclude={"predicted"})
    cm = _cm()
    assert cm.evaluate(back).iteration_ms == cm.evaluate(plan).iteration_ms


def test_bridge_fields():
    out = bridge_fields(megatron_config(_plan("optim_grads", offload=1)))
    assert out["ddp"]["use_megatron_fsdp"] and out["ddp"]["data_parallel_sharding_strategy"] == "optim_grads"
    assert out["model"]["cpu_offloading"] and out["model"]["cpu_offloading_num_layers"] == 1
    assert out["checkpoint"] == {"ckpt_format": "fsdp_dtensor"}
    ref = json.loads((Path(__file__).resolve().parents[2] / "search" / "megatron" / "data" /
                      "bridge_fields_v0.3.1.json").read_text())["fields"]
    settable = json.loads((Path(__file__).resolve().parents[2] / "search" / "megatron" / "data" /
                           "bridge_fields_v0.3.1.json").read_text())["settable"]
    for section, fields in out.items():
        assert set(fields) <= set(ref[section]) | set(settable.get(section, [])), section


# ----- search and baseline ------------------------------------------------------------------------------------
def _baseline(cluster, **kw):
    from search.planner.api import plan_baseline
    from search.pricing import cost_model
    model = load_model("llama3-8b")
    training = TrainingSpec(global_batch_size=128, **kw)
    cm = cost_model(model, parse_cluster(cluster), training, target_settings("megatron-lm", precision="bf16"))
    return plan_baseline(cm, training)


def test_baseline_takes_fsdp_where_memory_binds_and_offload_over_nvlink_c2c():
    """Llama 3 8B, seq 8192 on 8 H100s: without recompute only FSDP's sharded gradients fit dp 8 (faster than the
    best DDP configuration, tp 2); on GB200 (NVLink-C2C to the host) at 4 samples per rank the fewest offloaded
    layers that fit beat the configurations without offload."""
    h = _baseline("1x8-h100")
    no = _baseline("1x8-h100", megatron_fsdp=False)
    assert h.state.features.fsdp and not no.state.features.fsdp and h.iteration_ms < no.iteration_ms
    g = _baseline("1x8-gb200", micro_batch_sizes=[4])
    g_no = _baseline("1x8-gb200", micro_batch_sizes=[4], activation_offload=False)
    n = g.state.features.offload_layers
    assert 0 < n < 32 and g.recompute == "none" and g.iteration_ms < g_no.iteration_ms
    assert not g_no.state.features.offload_layers


def test_runtime_search_refuses_what_the_runtime_does_not_run():
    from search.planner.api import runtime_training
    with pytest.raises(AcesoError, match="--megatron-fsdp on: the heterogeneous search prices DDP and the "
                                         "distributed optimizer only .the aceso runtime runs a Megatron FSDP plan"):
        runtime_training(TrainingSpec(global_batch_size=8, megatron_fsdp=True))
    with pytest.raises(AcesoError, match="--activation-offload on: the aceso runtime keeps activations on the GPU"):
        runtime_training(TrainingSpec(global_batch_size=8, activation_offload=True))
    t = runtime_training(TrainingSpec(global_batch_size=8))
    assert t.megatron_fsdp is False and t.activation_offload is False


def test_preflight_leaves_fsdp_to_the_runtime_and_refuses_offload_on_it():
    """Megatron FSDP: the runtime runs some plans (one stage, dense, dp x cp >= 2: its own check,
    tests/runtime/test_fsdp_refusals.py), so the torch-free part passes them on; activation offload it never runs."""
    from search.targets.preflight import planner_checks
    plan = _plan("optim_grads_params")
    planner_checks(plan, "cuda")                       # a Megatron-LM plan: its export runs it
    planner_checks(_on_runtime(plan), "cuda")
    off = _plan(offload=2, distributed_optimizer=True)
    planner_checks(off, "cuda")
    with pytest.raises(AcesoError, match="activation_offload: the aceso runtime keeps activations on the GPU"):
        planner_checks(_on_runtime(off), "cuda")


def test_moe_fsdp_gathers_experts_over_expert_dp():
    """Mixtral 8x7B layers 2-3 on 8 H100s, tp 2 (SP), dp 4, ep 4, etp 1, optim_grads_params, no overlap: per
    micro-batch the dense weights are all-gathered twice (forward, backward) and their gradients reduce-scattered
    over dp x cp = 4 (stride tp 2), the experts' over the expert-DP group of 8 / (1 x 4) = 2 (stride etp x ep 4);
    their optimizer states shard there too (megatron-core's expert-DP parameter groups). Hand-computed sizes."""
    import numpy as np
    from search.costmodel.types import Features
    m = load_model("mixtral-8x7b")
    cm = make_cost_model(m, parse_cluster("1x8-h100"), TrainingSpec(global_batch_size=64))
    st = cm.stage_cost(1, 4, 0, 4, 8, 2, 4, np.zeros(4, np.int8), 4, sp=True, ep=4, etp=1,
                       features=Features(fsdp="optim_grads_params"))
    h, f, E, q, kv = 4096, 14336, 8, 4096, 8 * 128
    dense = 2 * ((h * (q + 2 * kv) + q * h) / 2 + h + h + E * h)    # attention (tp 2) + norm + router, 2 layers
    experts = 2 * (E // 4) * 3 * h * f                              # E / ep SwiGLU experts, etp 1, 2 layers
    c, w, g, M = cm.comm, cm._w, cm._g, 64 // 4
    gather = 2 * (c.all_gather(dense * w, 4, False, 1) + c.all_gather(experts * w, 2, False, 1))
    reduce = c.reduce_scatter(dense * g, 4, False, 1) + c.reduce_scatter(experts * g, 2, False, 1)
    assert st.comm["fsdp_param_gather"][0] == pytest.approx(M * gather, rel=1e-9)
    assert st.comm["fsdp_grad_reduce"][0] == pytest.approx(M * reduce, rel=1e-9)
    assert st.memory_breakdown["params"] == pytest.approx((dense * w / 4 + experts * w / 2) / MB, rel=1e-12)
