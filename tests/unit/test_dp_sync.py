"""The data-parallel synchronization at scale (issue 34): the collectives' algorithm model (search/costmodel/comm.py),
where megatron-core runs the DP collectives (search/costmodel/dp_timeline.py), the settings that move them
(search/settings/data_parallel.py: bucket size, alignment, rank order, SHARP / NVLS) and the Grace-Blackwell racks' NVLink
domain (search/spec/cluster.py).

Every expected number is computed here from the formula in the module docstrings (NCCL's tuning model,
megatron-core's schedules), with the datasheet constants (H100: NVLink 450 GB/s and a 50 GB/s NIC per GPU, GB200:
NVLink 900 GB/s, 80% link efficiency), never by calling the code under test for the reference.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from search.spec.cluster import parse_cluster
from search.costmodel import RunSettings
from search.pricing import make_cost_model
from search.costmodel.comm import CommModel
from search.costmodel.dp_timeline import fifo, gather_jobs, grad_jobs
from search.costmodel.types import Features
from search.settings.data_parallel import DataParallelSettings, from_flags, run_fields, to_flags
from search.io.errors import AcesoError
from search.megatron.importer import read_megatron
from search.megatron.names import bridge_ddp_fields
from search.megatron.script import argv
from search.megatron.expressible import megatron_config
from search.spec.plan import uniform_plan
from search.costmodel.plan_view import run_settings
from search.spec.presets import load_model
from search.spec.training import TrainingSpec

NVLINK_H100 = 450e6 * 0.8       # bytes per ms
NIC = 50e6 * 0.8
NVLINK_GB200 = 900e6 * 0.8
ROOT = Path(__file__).resolve().parents[2]


# ----- the collectives' algorithm model ------------------------------------------------------------------------------
def test_ring_latency_counts_only_the_domain_crossings():
    """NCCL tuning.cc: a ring of n ranks on N domains has (n-1) steps per pass, N-1 of them on the network."""
    comm = CommModel(parse_cluster("8x64-gb200"))
    B = 1e9
    # 256 ranks, 32 per rack: 255 steps, 7 across racks (10 us), 248 on NVLink (3 us); NICs: 16 channels x 40 GB/s
    t = comm.reduce_scatter(B, 256, True, 32, domains=8)
    bw = min(16 * NIC, NVLINK_GB200)
    assert t == pytest.approx(248 * 0.003 + 7 * 0.010 + 255 / 256 * B / bw, rel=1e-12)
    # all-reduce: 2 x 255 steps, 2 x 7 across
    assert comm.all_reduce(B, 256, True, 32, domains=8) == pytest.approx(
        496 * 0.003 + 14 * 0.010 + 2 * 255 / 256 * B / bw, rel=1e-12)
    # without the domain count every step of an inter-node ring crosses (one rank per node: the v1 model)
    assert comm.reduce_scatter(B, 256, True, 32) == pytest.approx(255 * 0.010 + 255 / 256 * B / bw, rel=1e-12)
    assert comm.all_gather(B, 8) == pytest.approx(7 * 0.003 + 7 / 8 * B / NVLINK_GB200, rel=1e-12)


def test_ring_channels_cap_the_nics_a_group_crosses_on():
    """One NIC per ring channel crossing a domain boundary: 32 members of a rack use 16 NICs (NCCL_CTAS)."""
    comm = CommModel(parse_cluster("8x64-gb200"))                      # GB/s: 40 per NIC, 720 NVLink
    assert comm._link(True, 32)[0] == pytest.approx(16 * 40.0)
    assert comm._link(True, 4)[0] == pytest.approx(4 * 40.0)
    assert CommModel(parse_cluster("8x64-h100"))._link(True, 32)[0] == pytest.approx(360.0)   # NVLink-bound


def test_in_network_reductions_by_hand():
    """NVLS inside a domain and SHARP across, each taken where faster than the ring (NCCL's tuner)."""
    B = 4e9
    ring = CommModel(parse_cluster("1x8-h100"))
    nvls = CommModel(parse_cluster("1x8-h100"), nvls=True)
    # all-reduce: each rank sends and receives B once at 85% (Hopper) of the link, 25 us latency
    assert nvls.all_reduce(B, 8, in_network=True) == pytest.approx(0.025 + B / (NVLINK_H100 * 0.85), rel=1e-12)
    assert nvls.all_reduce(B, 8, in_network=True) < ring.all_reduce(B, 8)
    # reduce-scatter moves as many bytes as the ring at 85%: the ring stays faster, NCCL keeps it
    assert nvls.reduce_scatter(B, 8, in_network=True) == pytest.approx(ring.reduce_scatter(B, 8), rel=1e-12)
    assert nvls.all_reduce(B, 8) == pytest.approx(ring.all_reduce(B, 8), rel=1e-12)     # not a DP call: the ring
    assert CommModel(parse_cluster("1x8-gb200"), nvls=True).nvls == 0.74                  # Blackwell efficiency
    sharp = CommModel(parse_cluster("16x8-h100"), sharp=True)
    t = sharp.all_reduce(B, 16, True, 1, domains=16, in_network=True)
    assert t == pytest.approx(0.0384 + B / (NIC * 0.85 * 0.9), rel=1e-12)
    assert t < CommModel(parse_cluster("16x8-h100")).all_reduce(B, 16, True, 1, domains=16)
    assert sharp.all_reduce(B, 8, in_network=True) == pytest.approx(ring.all_reduce(B, 8))  # inside a node: no SHARP


# ----- the timeline ---------------------------------------------------------------------------------------------------
def test_fifo_by_hand():
    # three 2 ms collectives released at -6, -4, -2 before a deadline at 0: the stream keeps up, the last ends at 0
    assert fifo([(-6.0, 2.0, 0.0), (-4.0, 2.0, 0.0), (-2.0, 2.0, 0.0)]) == (0.0, 6.0)
    # 3 ms each: they queue, the last ends at -6 + 9 = 3
    assert fifo([(-6.0, 3.0, 0.0), (-4.0, 3.0, 0.0), (-2.0, 3.0, 0.0)]) == (3.0, 6.0)
    # deadlines per job (parameters): the first waits 1 ms, the stall moves the second's release and deadline
    assert fifo([(0.0, 1.0, 0.0), (0.0, 2.0, 2.0)]) == (1.0, 2.0)
    assert fifo([(0.0, 1.0, 0.0), (0.0, 3.0, 2.0)]) == (2.0, 2.0)


def test_buckets_during_the_last_backward_expose_the_last_one():
    """The bucketed chunk (first stage, first chunk): nb buckets released as the last backward produces them."""
    c = lambda b: b / 100.0          # noqa: E731 - 1 ms per 100 bytes
    jobs = grad_jobs([4e6], [400.0], [8.0], c, stage=0, depth=1, bucket_params=1e6, aligned=False)
    assert [j[0] for j in jobs] == [-6.0, -4.0, -2.0, 0.0] and all(j[1] == 1.0 for j in jobs)
    assert fifo(jobs) == (1.0, 3.0)                                  # the last bucket
    # pipeline ranks > 0 have no buckets: one reduction after the stage's last backward
    assert grad_jobs([4e6], [400.0], [8.0], c, stage=1, depth=1, bucket_params=1e6, aligned=False) == \
        [(0.0, 4.0, 0.0)]


def test_interleaved_chunks_reduce_behind_the_later_chunks():
    """Aligned (Megatron-LM's grad_sync_func): chunk j launches after its last backward, pp_rank steps later."""
    c = lambda b: b / 100.0          # noqa: E731
    bwd = [5.0, 5.0, 5.0]
    jobs = grad_jobs([1e6, 1e6, 1e6], [300.0, 300.0, 300.0], bwd, c, stage=0, depth=1, bucket_params=1e9,
                     aligned=True)
    assert sorted(jobs) == [(-10.0, 3.0, 0.0), (-5.0, 3.0, 0.0), (0.0, 3.0, 0.0)]
    assert fifo(jobs) == (3.0, 6.0)                                  # chunk 0's reduction stays exposed
    late = grad_jobs([1e6, 1e6, 1e6], [300.0, 300.0, 300.0], bwd, c, stage=2, depth=1, bucket_params=1e9,
                     aligned=True)
    assert sorted(late) == [(0.0, 3.0, 0.0), (0.0, 3.0, 0.0), (0.0, 3.0, 0.0)]   # -10 + 2 x 5, -5 + 10 capped


def test_parameter_gathers_by_hand():
    c = lambda b: b / 100.0          # noqa: E731
    fwd = [4.0, 4.0]
    # hooks: each chunk's gather starts when its first layer needs it; chunk 1 (one bucket) is wholly exposed
    hooks = gather_jobs([1e6, 1e6], [200.0, 200.0], fwd, c, stage=0, depth=1, bucket_params=5e5, aligned=False)
    assert sorted(hooks) == [(0.0, 1.0, 0.0), (0.0, 1.0, 2.0), (4.0, 2.0, 4.0)]
    assert fifo(hooks) == (3.0, 1.0)
    # aligned: both chunks at the start, chunk 1 due at its first forward (4 ms later): only chunk 0 waits
    aligned = gather_jobs([1e6, 1e6], [200.0, 200.0], fwd, c, stage=0, depth=1, bucket_params=5e5, aligned=True)
    assert fifo(aligned) == (2.0, 2.0)


# ----- a stage priced with them ---------------------------------------------------------------------------------------
def _plan(cluster: str, tp: int, pp: int, dp: int, vpp: int = 1, layers: int = 8):
    m = load_model("llama3-8b", num_layers=layers)
    cl = parse_cluster(cluster)
    return m, cl, uniform_plan(m, pp, tp, dp, dp, 16 * dp, cluster=cl, num_virtual_stages=vpp,
                               distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True)


def test_bucket_size_sets_the_exposed_last_bucket():
    """pp 1 over 2 nodes: 4 buckets of ~1/4 of the gradients; the last one's reduction stays exposed."""
    m, cl, plan = _plan("2x8-h100", 1, 1, 16)
    tr = TrainingSpec(global_batch_size=plan.global_batch_size, micro_batch_sizes=[plan.micro_batch_size])
    one = make_cost_model(m, cl, tr, settings=RunSettings(ddp_bucket_size=10 ** 12)).evaluate(plan).stages[0]
    params = one.memory_breakdown["params"] * 2 ** 20 / 2                # bf16 weights of the stage
    cm = make_cost_model(m, cl, tr, settings=RunSettings(ddp_bucket_size=int(params / 4) + 1))
    four = cm.evaluate(plan).stages[0]
    assert one.comm["dp"][1] == 0.0 and four.comm["dp"][1] > 0.0       # one bucket: nothing hides
    assert four.comm["dp"][0] < one.comm["dp"][0]


def test_tp_pp_dp_rank_order_places_the_dp_group_across_the_racks():
    """Two racks of 64, tp 4, pp 2, cp 1, dp 16: the default order keeps each stage's DP group in its rack, the
    tp-cp-ep-pp-dp order spreads it over both (stage k, replica d at 4 k + 8 d) and keeps the PP hops in a rack."""
    m, cl, plan = _plan("2x64-gb200", 4, 2, 16, layers=8)
    tr = TrainingSpec(global_batch_size=plan.global_batch_size, micro_batch_sizes=[plan.micro_batch_size])
    default = make_cost_model(m, cl, tr)
    mapped = make_cost_model(m, cl, tr, settings=RunSettings(rank_order="tp-cp-ep-pp-dp"))
    me = plan.stages[0]
    from search.costmodel.types import Shape
    shape = Shape(me.tp, me.dp, me.cp, me.sequence_parallel, 1, 0)
    assert default._dp_ranks(0, 2, 0, shape) == [4 * i for i in range(16)]
    assert mapped._dp_ranks(1, 2, 64, shape) == [4 + 8 * d for d in range(16)]
    assert default._group_link(default._dp_ranks(0, 2, 0, shape)) == (False, 1, 1)
    assert mapped._group_link(mapped._dp_ranks(1, 2, 64, shape)) == (True, 8, 2)
    a, b = default.evaluate(plan), mapped.evaluate(plan)
    assert b.stages[0].comm["dp"][0] + b.stages[0].comm["dp"][1] > a.stages[0].comm["dp"][0] + \
        a.stages[0].comm["dp"][1]                                      # the network instead of NVLink
    assert b.stages[0].p2p_ms < a.stages[0].p2p_ms                     # the PP hop stays on NVLink


def test_tp_pp_dp_refuses_what_it_cannot_place():
    m, cl, plan = _plan("2x64-gb200", 4, 2, 16)
    tr = TrainingSpec(global_batch_size=plan.global_batch_size, micro_batch_sizes=[plan.micro_batch_size])
    uneven = plan.model_copy(update={"stages": [plan.stages[0].model_copy(update={"dp": 8, "num_gpus": 32}),
                                                 plan.stages[1]]})
    with pytest.raises(AcesoError, match="tp-cp-ep-pp-dp"):
        make_cost_model(m, cl, tr, settings=RunSettings(rank_order="tp-cp-ep-pp-dp")).evaluate(uneven)


# ----- the settings, from and to Megatron-LM flags ---------------------------------------------------------------------
ARGS = ("--num-layers 8 --hidden-size 1024 --num-attention-heads 16 --seq-length 2048 --max-position-embeddings 2048 "
        "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2 "
        "--micro-batch-size 1 --global-batch-size 64 --vocab-size 32000 --bf16 --use-distributed-optimizer "
        "--overlap-grad-reduce --overlap-param-gather ")


def test_flags_import_price_and_export():
    flags = "--ddp-bucket-size 50000000 --no-align-param-gather --use-tp-pp-dp-mapping --use-sharp"
    plan = read_megatron(ARGS + flags, cluster=parse_cluster("4x8-h100")).plan
    d = plan.settings.data_parallel
    assert d == DataParallelSettings(bucket_size=50_000_000, align_param_gather=False, rank_order="tp-cp-ep-pp-dp",
                                     sharp=True)
    rs = run_settings(plan.settings, "bf16")
    assert (rs.ddp_bucket_size, rs.align_grad_reduce, rs.align_param_gather, rs.rank_order, rs.sharp) == \
        (50_000_000, True, False, "tp-cp-ep-pp-dp", True)
    out = " ".join(argv(megatron_config(plan)))
    for f in flags.split(" --"):
        assert "--" + f.lstrip("-") in out
    assert read_megatron(out, cluster=parse_cluster("4x8-h100")).plan.settings.data_parallel == d   # round trip
    with pytest.raises(AcesoError, match="Megatron-LM"):
        bridge_ddp_fields(d)                         # no Bridge v0.3.1 field for the rank order / SHARP
    assert bridge_ddp_fields(DataParallelSettings(bucket_size=7, align_param_gather=True)) == \
        {"bucket_size": 7, "align_param_gather": True}
    assert read_megatron(ARGS, cluster=parse_cluster("4x8-h100")).plan.settings.data_parallel is None


def test_framework_defaults_of_the_alignment():
    """Megatron-LM core_v0.16.1 aligns both (its flags are --no-align-*), Bridge v0.3.1 the gradients only, our
    runtime neither (bucket hooks)."""
    assert (run_fields(None, "megatron-lm")["align_grad_reduce"], run_fields(None, "megatron-lm")["align_param_gather"]) \
        == (True, True)
    assert (run_fields(None, "megatron-bridge")["align_grad_reduce"],
            run_fields(None, "megatron-bridge")["align_param_gather"]) == (True, False)
    assert (run_fields(None, "runtime")["align_grad_reduce"], run_fields(None, "runtime")["align_param_gather"]) == \
        (False, False)
    assert from_flags(None, False, False, False, False) is None and to_flags(None) == []


def test_bad_bucket_size_is_one_line(capsys, tmp_path):
    from search.cli import main
    rc = main(["explain", "--megatron-args", ARGS + "--ddp-bucket-size 0", "--cluster", "4x8-h100",
               "--search-budget-evals", "0"])
    err = capsys.readouterr().err
    assert rc == 2 and "--ddp-bucket-size 0" in err and err.count("\n") == 1 and "Traceback" not in err


def test_runtime_refuses_the_rank_order_it_does_not_build():
    from search.targets.preflight import planner_checks
    from search.settings.plan_settings import PlanSettings
    m, cl, plan = _plan("2x8-h100", 2, 2, 4)
    bad = plan.model_copy(update={"settings": PlanSettings(data_parallel=DataParallelSettings(
        rank_order="tp-cp-ep-pp-dp"))})
    with pytest.raises(AcesoError, match="settings.data_parallel"):
        planner_checks(bad, "cuda")
    planner_checks(bad.model_copy(update={"settings": PlanSettings(framework="megatron-lm", data_parallel=DataParallelSettings(
        rank_order="tp-cp-ep-pp-dp"))}), "cuda")


# ----- Grace-Blackwell racks ------------------------------------------------------------------------------------------
def test_grace_blackwell_trays_share_their_rack_nvlink_domain():
    """128 trays of 4 GB200 (an MLPerf system file's count): the DP group of a tp 2 stage rides the racks' NVLink
    and crosses racks on pooled NICs, where isolated trays would put it on two NICs per tray."""
    racks, trays = parse_cluster("128x4-gb200"), parse_cluster("128x4-gb200:nvl4")
    assert racks.nvlink_size == 72 and trays.nvlink_size == 4
    ranks = [2 * i for i in range(256)]
    assert CommModel(racks).placement(ranks) == (8, 4)          # 8 racks of 72; the last holds 512 - 504 = 8 GPUs
    assert CommModel(trays).placement(ranks) == (128, 2)
    B = 8e9   # racks: 7 of 255 steps across, the last (partial) rack's 4 NICs; trays: 127 across, 2 NICs per tray
    assert CommModel(racks).reduce_scatter(B, 256, True, 4, domains=8) == pytest.approx(
        248 * 0.003 + 7 * 0.010 + 255 / 256 * B / (4 * NIC), rel=1e-12)
    assert CommModel(trays).reduce_scatter(B, 256, True, 2, domains=128) == pytest.approx(
        128 * 0.003 + 127 * 0.010 + 255 / 256 * B / (2 * NIC), rel=1e-12)


# ----- the published runs ----------------------------------------------------------------------------------------------
DATA = ROOT / "bench" / "data" / "mlperf_training.json"


def test_mlperf_rows_state_their_sources_and_numbers():
    rows = json.loads(DATA.read_text())["rows"]
    assert len({r["id"] for r in rows}) == len(rows) >= 20
    for r in rows:
        src = r["source"]
        assert src["repo"].startswith("mlcommons/training_results_v") and len(src["commit"]) == 40
        assert src["config"].startswith("NVIDIA/benchmarks/") and src["results"] and src["system"]
        m = r["measured"]
        assert m["step_s"] > 0 and m["samples"] > 10
        if r["round"] in ("v5.0", "v5.1"):     # the forward-only (validation) step the same logs time
            assert 0 < m["validation_step_s"] < m["step_s"] / 2 and m["validation_samples"] > 10, r["id"]
        env, log = r["env"], r["log"]
        n = int(r["system"]["number_of_nodes"]) * int(r["system"]["accelerators_per_node"])
        mp = int(env["TENSOR_MODEL_PARALLEL"]) * int(env["PIPELINE_MODEL_PARALLEL"]) * int(env.get("CONTEXT_PARALLEL", 1))
        # the log's own numbers agree with the config: GBS = GA x MBS x DP, and = MINIBS x DP unless the row says
        assert log["global_batch_size"] == log["gradient_accumulation_steps"] * int(env["MICRO_BATCH_SIZE"]) * (n // mp)
        assert (log["global_batch_size"] == int(env["MINIBS"]) * (n // mp)) == (not r["checks"]), r["id"]
    scale = [r for r in rows if int(r["system"]["number_of_nodes"]) * int(r["system"]["accelerators_per_node"]) >= 512]
    assert max(int(r["system"]["number_of_nodes"]) * int(r["system"]["accelerators_per_node"]) for r in scale) >= 8192


def _bench():
    from tests.unit.bench_modules import load
    return load("scale_published")


def test_gb300_405b_nvfp4_run_fits_with_its_bf16_gradient_buffer():
    """MLPerf v5.1 Llama 3.1 405B NVFP4 on 512 GB300 completed (284,208 MiB per GPU). NeMo's MLPerf code reduces
    gradients in bf16 (pretrain.py: MegatronMixedPrecision and DistributedDataParallelConfig grad_reduce_in_fp32=False):
    priced so it fits; the 290 of 285 (thousand MiB) the issue quotes is the same run with Megatron-LM's default fp32
    gradient buffer, 4 instead of 2 bytes per parameter of the stage (25.5e9 of them)."""
    sp = _bench()
    row = next(r for r in sp.load_rows() if r["id"] == "v5.1/theia_ngpu512_ngc25.09_nemo/llama31_405b")
    bf16 = sp.price(row, sp.cluster_of(row))
    assert bf16["fits"] and bf16["memory_gib"] < 284208 / 1024
    args = sp.args_of(row).replace(" --grad-reduce-in-bf16", "")
    su = sp.lp.row_setup({"cluster": sp.cluster_of(row), "args": args, "ga": None, "dp": 16, "gbs": 1152})
    fp32 = make_cost_model(su["plan"].model, su["cluster"], su["training"], settings=su["settings"]).evaluate(su["plan"])
    stage = max(fp32.stages, key=lambda s: s.memory_mb)
    assert not fp32.fits and round(fp32.max_memory_mb / 1000) == 290
    params = stage.memory_breakdown["grads"] * 2 ** 20 / 4                # the fp32 buffer's parameters
    assert params == pytest.approx(25.5e9, rel=0.01)
    assert fp32.max_memory_mb - bf16["memory_gib"] * 1024 == pytest.approx(2 * params / 2 ** 20, rel=0.03)


def test_validation_step_times_leave_out_each_evaluations_first():
    """bench/data/mlperf_extract.py: the forward-only step (logged validation_step_time) leaves out each evaluation's
    first value (timed from the last training step) and ignores the training steps' entries."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("mlperf_extract", ROOT / "bench" / "data" / "mlperf_extract.py")
    ex = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ex)

    def stat(**value):
        return {"key": "tracked_stats", "value": value, "metadata": {"step": 1}}
    events = [stat(train_step_time=0.085), {"key": "eval_start", "value": None, "metadata": {}},
              stat(validation_step_time=0.185), stat(validation_step_time=0.021), stat(validation_step_time=0.020),
              {"key": "eval_stop", "value": None, "metadata": {}}, stat(train_step_time=0.086),
              {"key": "eval_start", "value": None, "metadata": {}}, stat(validation_step_time=0.190),
              stat(validation_step_time=0.022)]
    assert ex.validation_times(events) == [0.021, 0.020, 0.022]


def test_forward_only_rows_split_the_step_at_three_forwards():
    """The bench's forward-only table: one-stage rows only; the measured part beyond three forwards is the logged step
    less three validation steps, the priced one the priced step less three forwards priced without TP overlap (the
    validation graph runs without it, NVTE_TP_OVERLAP_TRAINING_ONLY=1)."""
    sp = _bench()
    rows = {r["id"]: r for r in sp.load_rows()}
    assert sp.forward_row(rows["v5.1/theia_ngpu512_ngc25.09_nemo/llama31_405b"]) is None      # pp 8
    row = rows["v5.1/theia_ngpu512_ngc25.09_nemo/llama31_8b"]
    f = sp.forward_row(row)
    m = row["measured"]
    assert 0 < m["validation_step_s"] < m["step_s"] / 3 and m["validation_samples"] > 100
    assert f["measured_beyond_3f_s"] == pytest.approx(m["step_s"] - 3 * m["validation_step_s"], rel=1e-12)
    no_overlap = sp.price(row, sp.cluster_of(row), drop=("tp-comm-overlap",))
    assert f["predicted_forward_s"] == pytest.approx(no_overlap["fwd_ms"] / 1e3, rel=1e-12)    # gbs 64 = dp 64 x mbs 1
    assert f["predicted_beyond_3f_s"] == pytest.approx(sp.price(row, sp.cluster_of(row))["predicted_s"]
                                                       - 3 * f["predicted_forward_s"], rel=1e-12)


@pytest.mark.parametrize("framework,written", [("runtime", ["--no-align-grad-reduce", "--no-align-param-gather"]),
                                               ("megatron-bridge", ["--no-align-param-gather"]),
                                               ("megatron-lm", [])])
def test_the_megatron_lm_export_runs_the_alignment_the_plan_was_priced_with(framework, written):
    """A plan priced under another framework's alignment (the runtime: neither, Bridge v0.3.1: the gradients only)
    exported for Megatron-LM (whose parser aligns both unless --no-align-*): the script says what the plan was
    priced with, so the script read back by Megatron-LM's rules prices as the plan (its header) does. Before, a
    Bridge plan of llama3-70b on 1x64-gb200 (vpp 20) said 8456.6 ms in its script's header and 8441.1 ms in
    explain of that script."""
    from search.pricing import price
    cluster = parse_cluster("4x8-h100")
    mlm = read_megatron(ARGS, cluster=cluster).plan
    plan = mlm.model_copy(update={"settings": mlm.settings.model_copy(update={"framework": framework})})
    line = " ".join(argv(megatron_config(plan)))
    assert [f for f in line.split() if f.startswith("--no-align")] == written
    back = read_megatron(line, cluster=cluster).plan
    assert back.settings.framework == "megatron-lm"
    # the runtime runs the interleaved p2p synchronously (runtime_rules.overlap_p2p): the script keeps the runtime
    # plan's alignment and runs Megatron-LM's overlapped p2p, which the export's header prices (cli.export.as_written)
    ref = plan if framework != "runtime" else plan.model_copy(update={"settings": plan.settings.model_copy(
        update={"overlap_p2p_comm": True})})
    assert price(back).iteration_ms == pytest.approx(price(ref).iteration_ms, rel=1e-9)


def test_the_bridge_export_runs_megatron_lms_parameter_gather_alignment():
    """A Megatron-LM plan (vpp 2, the parameter all-gather overlapped: Megatron-LM aligns it) exported for
    Megatron-Bridge v0.3.1, whose DDP config leaves align_param_gather off: the YAML turns it on; a pp-1 plan,
    where the alignment does nothing, writes nothing."""
    from search.megatron.names import bridge_fields
    mlm = read_megatron(ARGS, cluster=parse_cluster("4x8-h100")).plan
    assert bridge_fields(megatron_config(mlm))["ddp"]["align_param_gather"] is True
    flat = read_megatron(ARGS.replace("--pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2",
                                      "--pipeline-model-parallel-size 1"), cluster=parse_cluster("4x8-h100")).plan
    assert "align_param_gather" not in bridge_fields(megatron_config(flat))["ddp"]
