"""Low precision (search/settings/precision.py): the recipes' cast and memory bytes, the quantized GEMM time, FP8/FP4 peaks
and presets, NVLink domains, the refusals, and the Megatron-LM flags (import, export, core_v0.16.1's flag list)
against hand-computed cases."""

import json
from math import ceil

import pytest

from search.settings import precision as lowp
from search.cli import main
from search.spec.cluster import GPU_PRESETS, parse_cluster
from search.pricing import make_cost_model
from search.costmodel.comm import CommModel
from search.costmodel.kernels import ARCH, LAUNCH_MS
from search.costmodel.release_constants import value as release_value

LOWPREC_GEMM_SCALE = release_value("LOWPREC_GEMM_SCALE", "")     # the newest release's (release_constants.py)
from search.io.errors import AcesoError
from search.megatron.cmdline import megatron_flags
from search.megatron.expressible import megatron_config
from search.megatron.importer import read_megatron
from search.megatron.names import megatron_lm_args
from search.spec.plan import uniform_plan
from search.spec.presets import load_model
from search.spec.training import TrainingSpec
from tests.conftest import ROOT

BRIDGE = ROOT.parent / "shared" / "published" / "megatron-bridge-25.09-25.11.json"


# ----- bytes ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,expect", [
    ("fp8-delayed", 2 * 1000 + 2 * 1.0 * 1000),                 # read bf16, write fp8 row- and column-wise
    ("fp8-tensorwise", 2 * 2 * 1000 + 2 * 1.0 * 1000),          # + the amax read
    ("fp8-blockwise", 2 * 1000 + 2 * (1 + 4 / 128) * 1000),     # fp32 scale per 128
    ("mxfp8", 2 * 1000 + 2 * (1 + 1 / 32) * 1000),              # E8M0 scale per 32
    ("nvfp4", 2 * 2 * 1000 + 2 * (0.5 + 1 / 16) * 1000),        # amax + 4-bit data + E4M3 scale per 16
    ("bf16", 0.0)])
def test_cast_bytes(name, expect):
    assert lowp.cast_bytes(name, 1000, 2.0) == pytest.approx(expect)


@pytest.mark.parametrize("name,gather,expect", [("fp8-tensorwise", False, 2.0), ("fp8-tensorwise", True, 0.0),
                                                ("mxfp8", True, 2 * (1 + 1 / 32) - 2), ("nvfp4", False, 1.125),
                                                ("bf16", False, 0.0)])
def test_weight_bytes(name, gather, expect):
    assert lowp.weight_bytes_per_param(name, gather) == pytest.approx(expect)


@pytest.mark.parametrize("name,expect", [
    ("fp8-delayed", 2 * 1000 + 1.0 * 1000),                     # Blackwell: one row-wise copy (no transpose)
    ("fp8-tensorwise", 2 * 2 * 1000 + 1.0 * 1000),
    ("mxfp8", 2 * 1000 + 2 * (1 + 1 / 32) * 1000),              # block scales per direction: both copies
    ("nvfp4", 2 * 2 * 1000 + 2 * (0.5 + 1 / 16) * 1000)])
def test_cast_bytes_on_blackwell(name, expect):
    assert lowp.cast_bytes(name, 1000, 2.0, non_tn=True) == pytest.approx(expect)


@pytest.mark.parametrize("name,gather,non_tn,expect", [
    ("fp8-tensorwise", False, True, 1.0), ("fp8-tensorwise", True, True, 1.0 - 2.0),
    ("mxfp8", True, True, 2 * (1 + 1 / 32) - 2)])
def test_weight_bytes_on_blackwell(name, gather, non_tn, expect):
    assert lowp.weight_bytes_per_param(name, gather, non_tn) == pytest.approx(expect)


def test_gather_and_fsdp_weight_bytes():
    """FP8 param gather moves 1 B (+ block scales); MXFP8 parameters are all-gathered in the gradient buffer's dtype
    (2 B with bf16 gradients); Megatron FSDP stores / gathers what the all-gather moves, no transpose."""
    assert lowp.gather_bytes_per_param("fp8-tensorwise", True) == 1.0
    assert lowp.gather_bytes_per_param("fp8-blockwise", True) == pytest.approx(1 + 4 / 128)
    assert lowp.gather_bytes_per_param("mxfp8", True) == 2.0
    assert lowp.gather_bytes_per_param("fp8-tensorwise", False) == 2.0
    assert lowp.fsdp_weight_bytes_per_param("fp8-tensorwise", True) == -1.0
    assert lowp.fsdp_weight_bytes_per_param("mxfp8", True) == 0.0
    assert lowp.fsdp_weight_bytes_per_param("fp8-tensorwise", False, non_tn=True) == 1.0


def test_mxfp8_gemm_rate_is_the_generation_scale_times_the_recipe_scale():
    from search.costmodel.kernels import RECIPE_GEMM_SCALE, lowprec_kernels
    k = lowprec_kernels("shape", "b200", 4.5e15, 8e12, 1.0, "mxfp8")
    assert k.gemm_scale == pytest.approx(LOWPREC_GEMM_SCALE["blackwell"] * RECIPE_GEMM_SCALE["mxfp8"])
    assert lowprec_kernels("shape", "b200", 4.5e15, 8e12, 1.0, "fp8-tensorwise").gemm_scale == \
        LOWPREC_GEMM_SCALE["blackwell"]


def test_blackwell_memory_is_binary_as_nvidia_names_it():
    """MIG full-GPU profiles 7g.80gb / 7g.180gb / 7g.186gb / 7g.278gb: 80 / 180 / 186 / 278 GiB."""
    assert [GPU_PRESETS[g].memory_gib for g in ("h100", "b200", "gb200", "gb300")] == [80.0, 180.0, 186.0, 278.0]


def test_bf16_layers():
    assert [lowp.bf16_layer("mxfp8", i, 6, 1, 2) for i in range(6)] == [True, False, False, False, True, True]
    assert all(lowp.bf16_layer("bf16", i, 6, 0, 0) for i in range(6))


# ----- pricing -------------------------------------------------------------------------------------------------------
def _cm(precision="fp8-tensorwise", gpu="h100", **kw):
    m = load_model("llama3-8b", num_layers=4)
    c = parse_cluster(f"1x8-{gpu}")
    tr = TrainingSpec(global_batch_size=16, micro_batch_sizes=[2], precision=precision, attention="flash", **kw)
    return m, c, make_cost_model(m, c, tr)


def test_quantized_gemm_time_is_the_shape_model_at_the_fp8_peak():
    """H100: 132 SMs, 128x256 tiles; (16384, 8192, 8192): 4096 tiles in 32 waves."""
    _, _, cm = _cm()
    a = ARCH["h100"]
    eff = a.gemm_max * a.sustained * LOWPREC_GEMM_SCALE["hopper"] * 4096 / (ceil(4096 / 132) * 132)
    want = 2 * 16384 * 8192 * 8192 / (1979e9 * eff) + LAUNCH_MS
    assert cm.source.kern_lp._one(16384, 8192, 8192) == pytest.approx(want)
    assert cm.source.kern._one(16384, 8192, 8192) > 1.5 * want     # bf16: half the peak


def test_first_last_bf16_layers_price_as_bf16():
    m, _, lp = _cm()
    _, _, keep = _cm(bf16_layers_start=1, bf16_layers_end=1)
    _, _, bf = _cm("bf16")
    t_lp, t_keep, t_bf = (x.unit_table(2, 1) for x in (lp, keep, bf))
    assert t_keep.fwd_ms[0] == pytest.approx(t_bf.fwd_ms[0]) and t_keep.fwd_ms[-1] == pytest.approx(t_bf.fwd_ms[-1])
    assert t_keep.fwd_ms[2] == pytest.approx(t_lp.fwd_ms[2]) and t_lp.fwd_ms[2] < t_bf.fwd_ms[2]


def test_fp8_weight_and_activation_memory():
    """Weights: + 2 B (fp8 copy and transpose) per linear parameter, 0 with param gather; activations: the
    linear inputs kept in fp8 (1 B instead of 2): attention s b (h + q), MLP s b (h + f) per unit."""
    m, c, lp = _cm()
    _, _, bf = _cm("bf16")
    _, _, pg = _cm(fp8_param_gather=True)
    plan = uniform_plan(m, 1, 1, 8, 16, 16, cluster=c, distributed_optimizer=True)
    mem = {k: x.evaluate(plan).stages[0].memory_breakdown for k, x in (("lp", lp), ("bf", bf), ("pg", pg))}
    units = sum(m.unit_params(u.kind) for u in m.units)
    assert (mem["lp"]["params"] - mem["bf"]["params"]) * 2**20 == pytest.approx(2 * units)
    assert mem["pg"]["params"] == pytest.approx(mem["bf"]["params"])
    t_lp, t_bf = lp.unit_table(2, 1), bf.unit_table(2, 1)
    s, b, h, q, f = m.seq_length, 2, m.hidden_size, m.num_attention_heads * m.head_dim, m.ffn_hidden_size
    assert (t_bf.act_mb[0, 0] - t_lp.act_mb[0, 0]) * 2**20 == pytest.approx(s * b * (h + q))
    assert (t_bf.act_mb[1, 0] - t_lp.act_mb[1, 0]) * 2**20 == pytest.approx(s * b * (h + f))
    assert t_bf.act_mb[1, 2] == t_lp.act_mb[1, 2]       # full recompute keeps the unit input only


@pytest.mark.parametrize("gpu,precision,needle", [("v100", "fp8-tensorwise", "no FP8"), ("a100", "mxfp8", "no FP8"),
                                                  ("h100", "nvfp4", "no FP4"), ("h100", "mxfp8", "Blackwell only")])
def test_low_precision_refused_where_the_gpu_has_none(gpu, precision, needle):
    with pytest.raises(AcesoError, match=needle):
        _cm(precision, gpu)


def test_search_refuses_fp8_on_v100_with_one_line(tmp_path, capsys):
    rc = main(["search", "--model", "gpt-1.3b", "--cluster", "1x4-v100", "--global-batch-size", "8",
               "--precision", "fp8-tensorwise", "--target", "megatron-lm", "-o", str(tmp_path / "p.json")])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "no FP8" in err and "Traceback" not in err
    assert not (tmp_path / "p.json").exists()


# ----- clusters ------------------------------------------------------------------------------------------------------
def test_blackwell_ultra_presets_and_peaks():
    b300, gb300 = GPU_PRESETS["b300"], GPU_PRESETS["gb300"]
    assert (b300.peak_tflops("fp8"), b300.peak_tflops("fp4"), gb300.peak_tflops("fp8")) == (4500, 13125, 5000)
    assert GPU_PRESETS["h100"].peak_tflops("fp8") == 1979 and GPU_PRESETS["h100"].peak_tflops("fp4") is None
    assert GPU_PRESETS["v100"].peak_tflops("fp8") is None
    assert parse_cluster("2x8-b300").inter_node_gbps == 100.0          # ConnectX-8, 800 Gb/s


def test_nvlink_domain_larger_than_a_node():
    tray = parse_cluster("32x4-gb200:nvl4")             # trays without a shared NVLink domain: say so
    racks = parse_cluster("32x4-gb200:nvl64")
    assert racks.label == "32x4-gb200:nvl64" and racks.nvlink_size == 64
    assert CommModel(tray).spans_nodes(0, 7) and not CommModel(racks).spans_nodes(0, 63)
    assert CommModel(racks).spans_nodes(0, 64)          # the second rack: the network
    # Grace-Blackwell trays default to their NVL72 rack (GB200 / GB300 NVL72: 18 trays of 4 in one NVLink domain)
    assert parse_cluster("32x4-gb200").nvlink_size == 72 and parse_cluster("32x4-gb200").label == "32x4-gb200:nvl72"
    assert parse_cluster("8x4-gb300").nvlink_size == 72 and parse_cluster("2x8-b200").nvlink_size == 8
    with pytest.raises(AcesoError, match="an NVLink domain of 6 GPUs cannot hold whole nodes of 4"):
        parse_cluster("4x4-gb200:nvl6")


@pytest.mark.parametrize("gpu", ["gb200", "gb300"])
def test_a_rack_preset_is_a_rack(gpu):
    """Issue 32: ``16x4-gb200-nvl72`` priced 4-GPU NVLink domains (the name was only a GPU alias). The rack preset
    is the explicit ``:nvl72`` spelling, and so are trays of several nodes (issue 34); ``:nvl4`` is isolated trays:
    72 GPUs share NVLink, the 73rd is on the network; nodes of 64 (the published rows' racks) stay one domain of 64,
    and what a rack cannot hold is one line."""
    rack = parse_cluster(f"16x4-{gpu}-nvl72")
    assert rack == parse_cluster(f"16x4-{gpu}:nvl72") == parse_cluster(f"16x4-{gpu}") != parse_cluster(f"16x4-{gpu}:nvl4")
    assert not CommModel(rack).spans_nodes(0, 63)
    assert CommModel(parse_cluster(f"20x4-{gpu}-nvl72")).spans_nodes(0, 72)
    assert parse_cluster(f"4x64-{gpu}-nvl72") == parse_cluster(f"4x64-{gpu}")
    assert parse_cluster(f"8x9-{gpu}-nvl72").nvlink_size == 72
    for text, needle in ((f"1x96-{gpu}-nvl72", "a rack holds 72 GPUs, not a node of 96"),
                         (f"16x4-{gpu}-nvl72:nvl144", ":nvl144 is more than the 72 GPUs"),
                         (f"1x64-{gpu}:nvl72", "cannot hold whole nodes of 64")):
        with pytest.raises(AcesoError, match=needle):
            parse_cluster(text)


@pytest.mark.parametrize("text, meant", [("64-h100", "8x8-h100"), ("4-h100", "1x4-h100"), ("h100", "1x8-h100"),
                                         ("2x8h100", "2x8-h100"), ("12-a100", "1x12-a100")])
def test_a_malformed_cluster_string_suggests_a_real_one(text, meant):
    """``64-h100`` suggested ``Nonex64-h100``: a bare number is the GPUs in all, in nodes of 8."""
    with pytest.raises(AcesoError, match=f"did you mean {meant}\\?") as e:
        parse_cluster(text)
    parse_cluster(meant)
    assert "None" not in str(e.value)


@pytest.mark.skipif(not BRIDGE.exists(), reason="needs ../shared/published")
def test_published_cluster_strings_parse():
    for r in json.loads(BRIDGE.read_text())["rows"]:
        assert parse_cluster(r["cluster"]).num_gpus == r["gpus"]


# ----- flags ---------------------------------------------------------------------------------------------------------
ARGS = ("--num-layers 4 --hidden-size 1024 --num-attention-heads 16 --seq-length 2048 --max-position-embeddings 2048 "
        "--tensor-model-parallel-size 2 --micro-batch-size 1 --global-batch-size 8 --vocab-size 32000 --bf16 "
        "--use-distributed-optimizer --swiglu --normalization RMSNorm --position-embedding-type rope ")


@pytest.mark.parametrize("name", lowp.LOW_PRECISIONS)
def test_flags_round_trip_through_import_and_export(name):
    extra = lowp.megatron_flags(name, param_gather=True, start=0 if name == "fp8-delayed" else 1,
                                end=0 if name == "fp8-delayed" else 1, reuse_grad_buf=name == "mxfp8")
    plan = read_megatron(ARGS + " ".join(extra), world_size=8).plan
    low = plan.settings.low_precision
    assert low.recipe == name and low.param_gather and low.reuse_grad_buf == (name == "mxfp8")
    out = megatron_lm_args(megatron_config(plan))["precision"]
    assert out[0] == "--bf16" and all(w in out for w in extra)
    flags = megatron_flags()
    assert all(w in flags for w in out if w.startswith("--"))      # core_v0.16.1's own parser knows each


@pytest.mark.parametrize("extra,needle", [("--fp8-format e5m2", "hybrid or e4m3"),
                                          ("--fp8-format hybrid --fp4-format e2m1", "together"),
                                          ("--fp8-param-gather", "give the recipe")])
def test_bad_precision_flags(extra, needle):
    with pytest.raises(AcesoError, match=needle):
        read_megatron(ARGS + extra, world_size=8)


def test_param_gather_needs_the_distributed_optimizer():
    with pytest.raises(AcesoError, match="use-distributed-optimizer"):
        read_megatron(ARGS.replace("--use-distributed-optimizer", "") + "--fp8-format hybrid --fp8-param-gather",
                      world_size=8)


# ----- the CLI: search prices the recipe given, export writes it, explain reads it ---------------------------------
def test_search_export_and_explain_carry_the_recipe(tmp_path, capsys):
    import yaml
    plan = tmp_path / "p.json"
    assert main(["search", "--model", "llama3-8b", "--cluster", "1x8-h100", "--global-batch-size", "64",
                 "--precision", "fp8-tensorwise", "--fp8-param-gather", "--target", "megatron-lm",
                 "--budget-evals", "50", "-o", str(plan)]) == 0
    saved = json.loads(plan.read_text())
    # the FP8 parameter all-gather shards over the distributed optimizer or Megatron FSDP (validate_args)
    assert saved["settings"]["low_precision"]["recipe"] == "fp8-tensorwise"
    assert saved["settings"]["distributed_optimizer"] or saved["settings"].get("megatron_fsdp")
    capsys.readouterr()
    assert main(["export", str(plan), "--to", "megatron-lm"]) == 0
    script = capsys.readouterr().out
    line = next(ln for ln in script.splitlines() if ln.startswith("PRECISION_ARGS="))
    words = line.split("(")[1].rstrip(")").split()
    assert words[:6] == ["--bf16", "--fp8-format", "hybrid", "--fp8-recipe", "tensorwise", "--fp8-param-gather"]
    assert all(w in megatron_flags() for w in words if w.startswith("--"))
    assert main(["export", str(plan), "--to", "megatron-bridge"]) == 0
    mp = yaml.safe_load(capsys.readouterr().out.split("\n", 1)[1])["mixed_precision"]
    fields = json.loads((ROOT / "search" / "megatron" / "data" / "bridge_fields_v0.3.1.json").read_text())
    assert (mp["fp8"], mp["fp8_recipe"], mp["fp8_param_gather"]) == ("hybrid", "tensorwise", True)
    assert set(mp) - {"_target_"} <= set(fields["fields"]["mixed_precision"])
    # import prices the exported flags under the plan's own recipe: the searched plan's iteration time
    from search.cli.import_cmd import predict
    args = " ".join(ln.split("(")[1].rstrip(")").strip() for ln in script.splitlines()
                    if ln.split("=")[0] in ("MODEL_ARGS", "PARALLEL_ARGS", "BATCH_ARGS", "PRECISION_ARGS"))
    imp = read_megatron(args + " --tokenizer-type NullTokenizer --vocab-size 128255",
                        cluster=parse_cluster("1x8-h100"))
    assert imp.plan.settings.low_precision == megatron_config(_plan_of(saved)).settings.low_precision
    got = predict(imp.plan, "flash").iteration_time_ms
    assert got == pytest.approx(saved["predicted"]["iteration_time_ms"], rel=1e-6)


def _plan_of(data):
    from search.spec.plan import ParallelPlan
    return ParallelPlan.model_validate(data)


def test_explain_megatron_args_prices_the_recipe_and_refuses_it_on_a100(capsys):
    args = ARGS + "--fp8-format hybrid --fp8-recipe tensorwise --fp8-param-gather"
    assert main(["explain", "--megatron-args", args, "--cluster", "1x8-h100"]) == 0
    out = capsys.readouterr().out
    assert "fp8-tensorwise linear GEMMs" in out and "--precision fp8-tensorwise --fp8-param-gather" in out
    assert main(["explain", "--megatron-args", args, "--cluster", "1x8-a100"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "a100 has no FP8" in err


def test_other_cost_models_refuse_low_precision():
    m = load_model("llama3-8b", num_layers=4)
    tr = TrainingSpec(global_batch_size=16, precision="mxfp8")
    with pytest.raises(AcesoError, match="analytic cost model only"):
        make_cost_model(m, parse_cluster("1x8-b200"), tr, "profile", db="x")


def test_the_runtime_target_refuses_low_precision(tmp_path, capsys):
    """Until the runtime runs transformer-engine recipes a plan for it is never priced in FP8 (one pricing)."""
    rc = main(["search", "--model", "llama3-8b", "--cluster", "1x8-h100", "--global-batch-size", "64",
               "--precision", "fp8-tensorwise", "-o", str(tmp_path / "p.json")])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "does not run low-precision recipes" in err
    from search.settings.plan_settings import PlanSettings
    from search.targets.preflight import planner_checks
    m = load_model("llama3-8b", num_layers=4)
    plan = uniform_plan(m, 1, 1, 8, 8, 16, cluster=parse_cluster("1x8-h100")).model_copy(
        update={"settings": PlanSettings(low_precision=lowp.LowPrecision(recipe="fp8-tensorwise"))})
    with pytest.raises(AcesoError, match="settings.low_precision"):
        planner_checks(plan, "cuda")
    planner_checks(plan.model_copy(update={"settings": PlanSettings(
        framework="megatron-lm", low_precision=lowp.LowPrecision(recipe="fp8-tensorwise"))}), "cuda")


@pytest.mark.skipif(not BRIDGE.exists(), reason="needs ../shared/published")
def test_every_dense_low_precision_bridge_row_imports_its_recipe():
    """bench/lowprec_published.py's rows: the dense FP8-CS / MXFP8 runs (the five Megatron FSDP ones with their FSDP
    strategy), read from their own arguments."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("lowprec_published", ROOT / "bench" / "lowprec_published.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows, left_out = bench.load_rows(BRIDGE)
    assert len(rows) == 19 and sum(r["fsdp"] > 0 for r in rows) == 5 and any("MoE" in x for x in left_out)
    for r in rows:
        plan = read_megatron(r["args"], cluster=parse_cluster(r["cluster"])).plan
        assert bool(plan.megatron_fsdp) == (r["fsdp"] > 0)
        low = plan.settings.low_precision
        assert low.recipe == lowp.LABELS.get(r["precision"], r["precision"])


def _lowprec_bench():
    from tests.unit.bench_modules import load
    return load("lowprec_published")


def test_a_row_whose_ga_disagrees_runs_at_the_mbs_its_ga_says():
    """GBS 128, DP 8, published GA 16: MBS 1 (the MBS column's 2 gives GA 8); a consistent row is left alone."""
    bench = _lowprec_bench()
    row = {"ga": 16, "dp": 8, "ga_implied": 8, "gbs": 128, "mbs": 2,
           "args": "--micro-batch-size 2 --global-batch-size 128"}
    args, fixed = bench.run_args(row)
    assert args == "--micro-batch-size 1 --global-batch-size 128" and "MBS 1" in fixed
    assert bench.run_args(dict(row, ga=8)) == (row["args"], None)


def test_targets_print_pass_and_fail():
    bench = _lowprec_bench()
    ok = bench.targets({"mae": 0.07, "max_abs": 0.14, "worst": "w", "all_fit": True})
    bad = bench.targets({"mae": 0.09, "max_abs": 0.20, "worst": "w", "all_fit": False})
    assert [t.split()[0] for t in ok] == ["PASS"] * 3 and [t.split()[0] for t in bad] == ["FAIL"] * 3


@pytest.mark.skipif(not BRIDGE.exists(), reason="needs ../shared/published")
def test_each_kept_out_row_has_a_faster_b200_twin_in_its_own_release():
    """The evidence a row is kept out of the fit and targets with, read off the published table itself: the same
    configuration (model, precision, GPUs, tp, pp, cp, vp, gbs, mbs) on B200 measured at least 5% faster in the same
    release (the row's table or its ``also_published``), though GB200 has at least B200's compute and NVLink."""
    import json

    bench = _lowprec_bench()
    rows = json.loads(BRIDGE.read_text())["rows"]
    kept = [r for r in rows if bench.kept_out(r["id"])]
    assert len(kept) == len(bench.KEPT_OUT) == 1
    key = ("model", "precision", "gpus", "tp", "pp", "cp", "vp", "gbs", "mbs")
    for r in kept:
        assert r["system"] == "DGX-GB200"
        twins = [t for t in rows if t["system"] == "DGX-B200" and all(t[k] == r[k] for k in key)]
        same_release = [t["tokens_per_s_per_gpu"] for t in twins if t["version"] == r["version"]] + [
            a["tokens_per_s_per_gpu"] for t in twins for a in t.get("also_published") or []
            if a["version"] == r["version"]]
        assert same_release and min(same_release) >= 1.05 * r["tokens_per_s_per_gpu"]


@pytest.mark.skipif(not BRIDGE.exists(), reason="needs ../shared/published")
def test_every_dense_low_precision_bridge_run_fits_its_gpu():
    """Runs that ran fit: each of the 19 rows priced as bench/lowprec_published.py prices it (the one row path)."""
    bench = _lowprec_bench()
    rows, _ = bench.load_rows(BRIDGE)
    out = [bench.price_row(r) for r in rows]
    assert [x["id"] for x in out if not x["fits"]] == []


# ----- megatron-core's bound on the bf16 first / last layers (TransformerConfig, core_v0.16.1) ---------------------
def _mcore_accepts(recipe: str, start: int, end: int, num_layers: int, pp: int) -> bool:
    """Whether megatron-core's own TransformerConfig accepts the bf16 layer counts (the oracle)."""
    import warnings

    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig
    r = lowp.recipe(recipe)
    kw = ({"fp8": r.flags[1], "fp8_recipe": r.flags[3]} if r.gemm == "fp8" else {"fp4": "e2m1", "fp4_recipe": "nvfp4"})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            TransformerConfig(num_layers=num_layers, hidden_size=64, num_attention_heads=4,
                              pipeline_model_parallel_size=pp, pipeline_dtype=torch.bfloat16, bf16=True,
                              first_last_layers_bf16=True, num_layers_at_start_in_bf16=start,
                              num_layers_at_end_in_bf16=end, **kw)
        except ValueError:
            return False
    return True


@pytest.mark.parametrize("recipe,start,end,pp", [
    ("fp8-tensorwise", 2, 1, 4),      # 8 // 4 = 2 at each end: accepted
    ("fp8-tensorwise", 3, 1, 4),      # start 3 > 2: refused
    ("mxfp8", 1, 3, 4),               # end 3 > 2: refused
    ("mxfp8", 3, 3, 2),               # 8 // 2 = 4: accepted
    ("nvfp4", 3, 1, 4)])              # megatron-core bounds only FP8 recipes: accepted
def test_bf16_layer_counts_follow_megatron_core(recipe, start, end, pp):
    from search.settings.plan_settings import PlanSettings
    from search.targets.preflight import planner_checks
    m = load_model("llama3-8b", num_layers=8)
    low = lowp.LowPrecision(recipe=recipe, bf16_layers_start=start, bf16_layers_end=end)
    plan = uniform_plan(m, pp, 1, 8 // pp, 8 // pp, 16, cluster=parse_cluster("1x8-b200")).model_copy(
        update={"settings": PlanSettings(framework="megatron-lm", low_precision=low)})
    ok = _mcore_accepts(recipe, start, end, 8, pp)
    assert (lowp.check_bf16_layers(recipe, start, end, 8, pp) is None) == ok
    if ok:
        planner_checks(plan, "cuda")
        return
    with pytest.raises(AcesoError) as e:
        planner_checks(plan, "cuda")
    line = str(e.value)
    assert "\n" not in line and "settings.low_precision.bf16_layers_" in line and f"8 // {pp} = {8 // pp}" in line


# ----- FP8 sequence-parallel all-gathers and the amax all-reduces (transformer-engine 2.9) ---------------------------
@pytest.mark.parametrize("name,expect", [
    ("bf16", (2.0, 2.0, 2.0)),
    ("fp8-delayed", (1.0, 1.0, 1.0)),                   # row-wise data only, transposed locally
    ("fp8-tensorwise", (1.0, 1.0, 1.0)),
    ("fp8-blockwise", (1 + 4 / 128, 2 * (1 + 4 / 128), 1 + 4 / 128)),   # dy row- and column-wise
    ("mxfp8", (1 + 1 / 32, 2 * (1 + 1 / 32), 1 + 1 / 32)),
    ("nvfp4", (0.5 + 1 / 16, 2 * (0.5 + 1 / 16), 0.5 + 1 / 16))])
def test_sp_gather_bytes(name, expect):
    assert lowp.sp_gather_bytes(name) == pytest.approx(expect)


def test_amax_reductions_only_under_current_scaling():
    assert {n: lowp.amax_reductions(n) for n in lowp.LOW_PRECISIONS} == {
        "fp8-delayed": 0, "fp8-tensorwise": 1, "fp8-blockwise": 0, "mxfp8": 0, "nvfp4": 1}


@pytest.mark.parametrize("name", ["fp8-tensorwise", "mxfp8"])
def test_quantized_sp_collectives_by_hand(name):
    """Llama 3 8B layer at tp 4 with SP, no overlap (megatron-core's async dgrad off): forward exposes the
    all-gather of the quantized attention input (s b h x e_fwd bytes) and the bf16 reduce-scatter; backward the
    gather of the quantized output gradient, the re-gather of the input and the bf16 reduce-scatter; current scaling
    adds one 4-byte amax all-reduce each way. Compared with the bf16 recipe's own collectives (same shapes)."""
    from search.costmodel import RunSettings
    m = load_model("llama3-8b", num_layers=4)
    c = parse_cluster("1x8-b200")
    comm = CommModel(c)
    b, s, t, h = 1, m.seq_length, 4, m.hidden_size
    src = {}
    for p in (name, "bf16"):
        tr = TrainingSpec(global_batch_size=16, micro_batch_sizes=[1], precision=p, attention="flash")
        cm = make_cost_model(m, c, tr, settings=RunSettings(overlap_tp_dgrad=False))
        src[p] = cm.source
    e_x, e_dy, e_re = lowp.sp_gather_bytes(name)
    ag = lambda e: comm.all_gather(e * s * b * h, t)  # noqa: E731
    rs = comm.reduce_scatter(2.0 * s * b * h, t)
    amax = comm.all_reduce(4.0, t) if name == "fp8-tensorwise" else 0.0
    cost = src[name].attention(b, s, t, sp=True, lp=True)
    want_f, want_b = ag(e_x) + rs + amax, ag(e_dy) + ag(e_re) + rs + amax
    assert cost.comm_fwd[0] == pytest.approx(want_f)
    assert cost.tp_comm == pytest.approx(want_f + want_b)
    plain = src["bf16"].attention(b, s, t, sp=True)
    assert plain.tp_comm == pytest.approx(3 * ag(2.0) + 2 * rs)


# ----- --reuse-grad-buf-for-mxfp8-param-ag --------------------------------------------------------------------------
MX = ARGS + "--fp8-format e4m3 --fp8-recipe mxfp8 --fp8-param-gather "


def test_reuse_grad_buf_round_trips_and_megatron_lm_knows_it():
    plan = read_megatron(MX + lowp.REUSE_FLAG, world_size=8).plan
    assert plan.settings.low_precision.reuse_grad_buf
    out = megatron_lm_args(megatron_config(plan))["precision"]
    assert out.count(lowp.REUSE_FLAG) == 1 and lowp.REUSE_FLAG in megatron_flags()   # core_v0.16.1's parser
    again = read_megatron(ARGS + " ".join(out[1:]), world_size=8).plan
    assert again.settings.low_precision == plan.settings.low_precision
    assert not read_megatron(MX, world_size=8).plan.settings.low_precision.reuse_grad_buf
    assert lowp.REUSE_FLAG not in megatron_lm_args(megatron_config(read_megatron(MX, world_size=8).plan))["precision"]


@pytest.mark.parametrize("args", [ARGS + "--fp8-format hybrid --fp8-recipe tensorwise --fp8-param-gather ",
                                  ARGS + "--fp8-format e4m3 --fp8-recipe mxfp8 "])
def test_reuse_grad_buf_refused_without_mxfp8_parameters(args):
    with pytest.raises(AcesoError) as e:
        read_megatron(args + lowp.REUSE_FLAG, world_size=8)
    assert "\n" not in str(e.value) and lowp.REUSE_FLAG in str(e.value) and "mxfp8" in str(e.value)


def test_reuse_grad_buf_is_reset_under_megatron_fsdp_and_set_for_searched_mxfp8_plans():
    """Megatron-LM's validate_args resets it under Megatron FSDP; a searched MXFP8 plan with parameter gather carries
    it (Megatron-Bridge asserts it there: mixed_precision.py ``finalize``)."""
    fsdp = ARGS.replace("--use-distributed-optimizer", "--use-megatron-fsdp --data-parallel-sharding-strategy "
                        "optim_grads_params --ckpt-format fsdp_dtensor")
    plan = read_megatron(fsdp + "--fp8-format e4m3 --fp8-recipe mxfp8 --fp8-param-gather " + lowp.REUSE_FLAG,
                         world_size=8).plan
    assert not plan.settings.low_precision.reuse_grad_buf
    tr = TrainingSpec(global_batch_size=16, micro_batch_sizes=[2], precision="mxfp8", fp8_param_gather=True,
                      distributed_optimizer=True)
    assert lowp.of_training(tr).reuse_grad_buf
    assert not lowp.of_training(tr.model_copy(update={"fp8_param_gather": False})).reuse_grad_buf


def test_reuse_grad_buf_has_no_price_of_its_own():
    """core_v0.16.1 builds the shared param / grad buffer for any MXFP8 parameters under the distributed optimizer
    (param_and_grad_buffer.py, "For MXFP8 param: Create a shared buffer for param AG and grad RS"): the flag changes
    which copy the parameters are read back from, not the bytes held or moved."""
    from search.costmodel.plan_view import run_settings
    from search.costmodel.plan_view import precision_of
    costs = []
    for extra in ("", lowp.REUSE_FLAG):
        plan = read_megatron(MX + extra, world_size=8, cluster=parse_cluster("1x8-b200")).plan
        tr = TrainingSpec(global_batch_size=8, micro_batch_sizes=[1], **precision_of(plan),
                          distributed_optimizer=True, attention="flash")
        c = make_cost_model(plan.model, parse_cluster("1x8-b200"), tr,
                            settings=run_settings(plan.settings, tr.precision)).evaluate(plan)
        costs.append((c.iteration_ms, c.max_memory_mb))
    assert costs[0] == costs[1]
