"""bench/moe_published.py's rows on the Megatron-Bridge MoE rows (../shared/published), imported from each row's own
arguments by ``read_megatron``: layers per chunk from its layout / first-last / embedding-loss arguments (counted by
hand from the quoted strings), the expert shape, settings and model from its flags, the precision and GPU look-ups,
and the rows it cannot build."""

import importlib.util
from pathlib import Path

import pytest

from search.io.errors import AcesoError
from search.spec.training import TrainingSpec

ROOT = Path(__file__).resolve().parents[2]
BRIDGE = ROOT.parent / "shared" / "published" / "megatron-bridge-25.09-25.11.json"
pytestmark = pytest.mark.skipif(not BRIDGE.is_file(), reason="../shared/published (the shared reference data) absent")


def _bench():
    spec = importlib.util.spec_from_file_location("moe_published_bench", ROOT / "bench" / "moe_published.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def mp():
    return _bench()


def _row(mp, start: str):
    rows = [r for r in mp.load_rows(BRIDGE) if r["id"].startswith(start)]
    assert len(rows) == 1, start
    return rows[0]


def _chunk_layers(plan):
    starts = plan.model.layer_starts
    return [sum(1 for x in starts[:-1] if c.start_unit <= x < c.end_unit) for _, _, c in plan.chunks_in_order()]


def test_deepseek_layout_row(mp):
    """'Et*4|(t*4|)*14tL' on pp 4 x vp 4: 15 chunks of 4 layers, then 1 (61); ep 64, etp 1 (= tp), flex."""
    row = _row(mp, "25.11/pretrain/deepseek-v3-mtp0/gb200x256/bf16")
    plan = mp.row_plan(row)
    assert _chunk_layers(plan) == [4] * 15 + [1]
    assert plan.num_stages == 4 and plan.num_virtual_stages == 4 and plan.world_size == 256
    st = plan.stages[0]
    assert (st.tp, st.dp, st.ep, st.etp, st.sequence_parallel) == (1, 64, 64, 1, False)
    assert plan.micro_batch_size == 64 and plan.global_batch_size == 4096
    assert plan.moe.token_dispatcher == "flex" and plan.moe.grouped_gemm and plan.moe.permute_fusion
    assert plan.distributed_optimizer and plan.overlap_grad_reduce and plan.overlap_param_gather
    # --recompute-granularity selective --recompute-modules mla_up_proj: the plan's mla_up_proj on every MLA
    # attention unit (search/megatron/recompute.py), nothing on the dense MLP / moe units
    m = plan.model
    for _, _, ch in plan.chunks_in_order():
        want = ["mla_up_proj" if m.units[u].kind == "attention" else "none" for u in range(ch.start_unit, ch.end_unit)]
        assert ch.recompute == want
    assert plan.chunks_in_order()[-1][2].end_unit == plan.model.num_units


def test_mtp_layer_goes_to_the_last_chunk(mp):
    row = _row(mp, "25.11/pretrain/deepseek-v3-mtp1/b200x256/mxfp8")     # 'Et*4|(t*4|)*14tmL', pp 16
    plan = mp.row_plan(row)
    assert plan.model.mtp_num_layers == 1
    assert _chunk_layers(plan) == [4] * 15 + [1]
    assert plan.chunks_in_order()[-1][2].end_unit == plan.model.num_units


def test_qwen3_235b_accounts_for_embedding_and_loss(mp):
    """94 layers + embedding + loss = 96 over pp 8 x vp 2: 6 per chunk, the first and last one fewer."""
    row = _row(mp, "25.11/pretrain/qwen3-235b-a22b/b200x64/mxfp8")
    plan = mp.row_plan(row)
    assert _chunk_layers(plan) == [5] + [6] * 14 + [5]
    assert (plan.stages[0].ep, plan.stages[0].etp) == (8, 1)


def test_token_drop_rows_take_their_capacity(mp):
    row = _row(mp, "25.09/pretrain/qwen3-235b-a22b-token_drop1/gb200x64/fp8-cs")
    assert "--moe-expert-capacity-factor 1.0" in row["args"]
    assert mp.row_plan(row).model.moe.moe_expert_capacity_factor == 1.0
    assert mp.row_plan(_row(mp, "25.11/pretrain/qwen3-235b-a22b/b200x64")).model.moe.moe_expert_capacity_factor is None


def test_the_model_is_what_the_flags_say(mp):
    """The importer's model, not a preset: GPT-OSS's window is the row's --window-size 128,0 (Megatron-Bridge's
    recipe; the preset keeps HF's 127 + the query), DeepSeek's aux coefficient its --moe-aux-loss-coeff."""
    gpt = _row(mp, "25.11/pretrain/gpt-oss-120b/gb200x64/bf16")
    assert "--window-size 128,0" in gpt["args"] and mp.row_plan(gpt).model.window_size == [128, 0]
    ds = _row(mp, "25.11/pretrain/deepseek-v3-mtp0/gb200x256/bf16")
    coeff = float(ds["args"].split("--moe-aux-loss-coeff ")[1].split()[0])
    assert mp.row_plan(ds).model.moe.moe_aux_loss_coeff == coeff


def test_rows_that_cannot_be_built_say_why(mp):
    """ep 64 over pp 8 on 256 GPUs: megatron-core's initialize_model_parallel refuses it too (256 % (etp 1 x ep 64
    x pp 8)). Bridge's 'Et|(tt|)*30L' (a loss-only last chunk, as megatron-core 0.16.1's layout allows) builds: the
    last of its 32 chunks holds only the loss."""
    empty = _row(mp, "25.11/pretrain/deepseek-v3-mtp0/gb200x256/mxfp8")
    plan = mp.row_plan(empty)
    order = [ch for _, _, ch in plan.chunks_in_order()]
    assert len(order) == 32 and order[-1].holds_only == "loss" and order[-1].num_units == 0
    assert order[0].holds_only is None and all(ch.num_units for ch in order[:-1])
    folded = _row(mp, "25.09/pretrain/deepseek-v3-token_drop1/gb200x256/mxfp8")   # ep 64 > 256 / pp 8 GPUs
    with pytest.raises(AcesoError, match=r"etp \(1\) x ep \(64\) must divide the stage's num_gpus \(32\)"):
        mp.row_plan(folded)


def test_precision_and_gpu_look_ups_follow_the_code(mp):
    """A precision waits exactly when TrainingSpec refuses its recipe name; a GPU when the cluster parser does."""
    for label in ("bf16", "fp8-cs", "mxfp8", "fp8-blockwise"):
        try:
            TrainingSpec(global_batch_size=1, precision=mp.precision_name(label))
            accepted = True
        except ValueError:
            accepted = False
        assert (mp.precision_support(label) is None) == accepted
    assert mp.precision_support("bf16") is None
    gb300 = _row(mp, "25.11/pretrain/qwen3-235b-a22b/gb300x256/bf16")
    status = mp.prepare(gb300)["status"]
    from search.spec.cluster import parse_cluster
    try:
        parse_cluster("4x64-gb300")
        assert not status.startswith(mp.WAITS)
    except Exception:  # noqa: BLE001 - no gb300 preset yet
        assert status.startswith(mp.WAITS) and "gb300" in status and status.endswith("(plan builds)")


def test_every_row_is_accounted_for(mp):
    """Each MoE row is priced, waits for issue 24, has no preset, or says why not: never silently dropped."""
    rows = mp.load_rows(BRIDGE)
    assert len(rows) == sum(1 for r in rows if r["moe"]) and rows
    for r in rows:
        s = mp.prepare(r)["status"]
        assert s == "ok" or s.startswith((mp.WAITS, "no preset", "not buildable", "no arguments")), s


def test_low_precision_rows_search_what_megatron_lm_runs(mp):
    """bf16 rows search the aceso target; a low-precision recipe (where the precision module has it) the
    megatron-lm target, since the aceso runtime runs no FP8 recipe yet."""
    assert mp.search_target("bf16") == "aceso"
    try:
        from search.settings.precision import is_low
    except ImportError:
        assert mp.search_target("fp8-cs") == "aceso"
    else:
        assert mp.search_target("fp8-cs") == ("megatron-lm" if is_low(mp.precision_name("fp8-cs")) else "aceso")


def test_over_memory_rows_print_their_memory_terms(mp, capsys):
    """A priced row reports its fullest stage's terms, which add up to its peak; a run over the GPU prints them
    with what the importer approximated (the DeepSeek-V3 GB200 bf16 run: nothing since its seq_aux_loss balancing is
    a model field, moe_router_load_balancing_type)."""
    row = _row(mp, "25.11/pretrain/deepseek-v3-mtp0/gb200x256/bf16")
    out = mp.price_row(row)
    assert out["status"] == "priced"
    assert sum(out["memory_gib"].values()) == pytest.approx(out["max_memory_gib"], rel=1e-9)
    mp.print_memory([{**out, "fits": False}])
    text = capsys.readouterr().out
    assert row["id"] in text and "activations" in text and "priced as one aux_loss" not in text


def test_mla_up_proj_is_what_lets_the_deepseek_gb200_run_fit(mp):
    """The run sets --recompute-modules mla_up_proj (Megatron-Bridge DEEPSEEK_V3_PRETRAIN_CONFIG_GB200_BF16_V2):
    priced with it the fullest stage fits the 186 GiB GB200; its attention units without it do not. The
    difference is the core's Q, K and V of every MLA layer in flight (mla_mtp.mla_act_bytes)."""
    row = _row(mp, "25.11/pretrain/deepseek-v3-mtp0/gb200x256/bf16")
    out = mp.price_row(row)
    assert out["fits"] and out["max_memory_gib"] < 186
    without = {**row, "args": row["args"].replace("--recompute-granularity selective --recompute-modules mla_up_proj",
                                                  "")}
    assert without["args"] != row["args"]
    out0 = mp.price_row(without)
    assert not out0["fits"] and out0["max_memory_gib"] > 186


def test_rows_kept_out_of_the_fit_are_what_their_reason_says(mp):
    """The H100 Qwen3-30B-A3B pair: the same model, cluster and shape, one dropless (no capacity factor) and one
    padded to capacity, the dropless one measured about 2x slower; only the dropless one is kept out (with the
    GPT-OSS rows whose table shape is not the period's recipe's); the padded twin is fitted."""
    rows = {r["id"]: r for r in mp.load_rows(BRIDGE)}
    dropless = rows["25.11/pretrain/qwen3-30b-a3b/h100x16/fp8-cs/gbs512-mbs2-seq4096/tp1pp2cp1vp24ep8fsdp0"]
    padded = rows["25.09/pretrain/qwen3-30b-a3b-token_drop1/h100x16/fp8-cs/gbs512-mbs2-seq4096/tp1pp2cp1vp24ep8fsdp0"]
    keys = ("model", "cluster", "tp", "pp", "cp", "ep", "vp", "mbs", "gbs", "seq", "precision")
    assert all(dropless[k] == padded[k] for k in keys)
    assert "--moe-expert-capacity-factor" not in dropless["args"]
    assert "--moe-pad-expert-input-to-capacity" in padded["args"]
    assert 1.9 < padded["tokens_per_s_per_gpu"] / dropless["tokens_per_s_per_gpu"] < 2.1
    assert mp.fit_note(dropless) and mp.fit_note(padded) is None
    assert mp.fit_note(rows["25.11/pretrain/gpt-oss-120b/h100x64/bf16/gbs512-mbs4-seq4096/tp1pp4cp1vp1ep8fsdp0"])
    assert mp.fit_note(rows["25.09/pretrain/qwen3-30b-a3b-token_drop1/b200x8/fp8-cs/gbs512-mbs1-seq4096/"
                            "tp1pp1cp1vp1ep8fsdp0"]) is None


def test_the_rows_carry_their_recipes_stack_flags(mp):
    """The tables' args now carry the recipes' stack flags (the file's ``about``): the 25.11 Qwen3-235B H100 row
    (its own release's recipe, v0.2.0 QWEN3_235B_A22B_H100_FP8_CS_BASE_CONFIG: moe_a2a_overlap=True) imports with
    the EP overlap and delayed weight gradients from its own command line (the old RECIPE_FLAGS table, which added
    them, is gone); a row whose CUDA graphs megatron-core refuses with its other settings (the 25.09 Qwen3-30B B200
    FP8 row: a later recipe's moe_preprocess graphs on its own drop-and-pad alltoall) is priced without them and
    says so (``recipes.own_args``)."""
    rows = {r["id"]: r for r in mp.load_rows(BRIDGE)}
    r11 = rows["25.11/pretrain/qwen3-235b-a22b/h100x256/fp8-cs/gbs2048-mbs1-seq4096/tp2pp8cp1vp4ep32fsdp0"]
    assert r11["recipe"]["own_release"]
    assert "--overlap-moe-expert-parallel-comm" in r11["args"] and "--delay-wgrad-compute" in r11["args"]
    plan = mp.row_plan(r11)
    assert plan.moe.overlap_ep_comm and plan.moe.delay_wgrad and plan.settings.release == "25.11"
    assert not hasattr(mp, "RECIPE_FLAGS")
    r09 = rows["25.09/pretrain/qwen3-30b-a3b-token_drop1/b200x8/fp8-cs/gbs512-mbs1-seq4096/tp1pp1cp1vp1ep8fsdp0"]
    assert "--cuda-graph-scope moe_router moe_preprocess" in r09["args"]
    out = mp.price_row(r09)
    assert out["status"] == "priced" and out["dropped_flags"] == ["--cuda-graph-impl", "--cuda-graph-scope"]
    assert mp.row_plan(r09).stack is None


def test_host_scan_implies_the_constant_that_zeroes_the_error(mp):
    """``scan_host``: priced at the HOST_LAUNCH_MS it reports (for the row's release), the row's error is 0 (to the
    bisection's width); a padded row (no sync) is not scanned."""
    from search.costmodel import release_constants as rc
    row = _row(mp, "25.11/pretrain/qwen3-235b-a22b/b200x64/mxfp8")
    padded = _row(mp, "25.09/pretrain/qwen3-235b-a22b-token_drop1/b200x64/mxfp8")
    (out,) = mp.scan_host([row, padded])
    h = out["implied_host_launch_ms"]
    assert out["id"] == row["id"] and 0 < h < 1
    group = rc.FITS[rc.fit_of("25.11")][1]
    keep = group.get("HOST_LAUNCH_MS")
    try:
        group["HOST_LAUNCH_MS"] = h
        assert abs(mp.price_row(row)["error"]) < 2e-3
    finally:
        group["HOST_LAUNCH_MS"] = keep
    assert group["HOST_LAUNCH_MS"] == keep


def test_breakdown_adds_up_to_the_iteration(mp):
    """--breakdown's parts (busiest stage) sum to the priced iteration time."""
    row = _row(mp, "25.09/pretrain/qwen3-30b-a3b-token_drop1/b200x8/fp8-cs")
    bd = mp.breakdown(row)
    assert bd is not None
    assert sum(bd[n] for n in mp.BREAKDOWN) == pytest.approx(bd["iteration_ms"], rel=1e-6)
    assert min(bd[n] for n in ("attention", "experts", "a2a", "router")) > 0


def test_rack_presets_price_the_published_gb_rows_as_their_cluster_strings(mp):
    """Issue 32: ``gb200-nvl72`` / ``gb300-nvl72`` now make the rack one NVLink domain (``16x4-gb200-nvl72`` is
    ``16x4-gb200:nvl72``). The published rows write racks as nodes of 64 (``1x64-gb300``, ``4x64-gb200``) or one
    node of 8: spelled with the rack preset, every GB200 / GB300 MoE row prices exactly as its own string."""
    from search.spec.cluster import parse_cluster
    from search.pricing import make_cost_model

    priced = 0
    for path in (BRIDGE, BRIDGE.with_name("megatron-bridge-26.02-26.04.json")):
        for row in mp.load_rows(path):
            if not row["cluster"].endswith(("gb200", "gb300")):
                continue
            prep = mp.prepare(row)
            if prep["status"] != "ok":
                continue
            rack = parse_cluster(row["cluster"] + "-nvl72")
            assert rack.num_gpus == prep["cluster"].num_gpus
            ms = [make_cost_model(prep["plan"].model, c, prep["training"], settings=prep["settings"])
                  .evaluate(prep["plan"]).iteration_ms for c in (prep["cluster"], rack)]
            assert ms[0] == ms[1], row["id"]
            priced += 1
    assert priced >= 10, priced


def test_walk_goes_from_one_published_row_to_the_other_one_setting_at_a_time(mp):
    """--walk (issue 34's pair decomposition): 25.11's Qwen3-30B GB300 row (mbs 4, alltoall, no graphs) moved to
    26.04.01's (mbs 8, HybridEP, TE graphs of the router and preprocess). The first step prices as the 25.11 row and
    the last as the 26.04.01 row, each by ``price_row`` of the published row itself; the steps between are the
    release, then one setting each (a dispatcher with its backend, a graph implementation with its scope), in the
    order the flags appear; a pair of two clusters is refused."""
    newer = mp.NEWER
    if not newer.is_file():
        pytest.skip("../shared/published/megatron-bridge-26.02-26.04.json absent")
    b = _row(mp, "25.11/pretrain/qwen3-30b-a3b/gb300x8/mxfp8")
    a = [r for r in mp.load_rows(newer) if r["id"].startswith("26.04.01/pretrain/qwen3-30b-a3b/gb300x8/mxfp8")][0]
    steps = mp.walk(a, b)
    assert [s[0] for s in steps] == [
        "25.11 as published", "release 25.11 -> 26.04.01", "dispatcher alltoall -> flex hybridep",
        "micro-batch-size 4 -> 8", "cuda_graphs off -> transformer_engine moe_router moe_preprocess"]
    first, last = (mp.breakdown(s[1])["iteration_ms"] for s in (steps[0], steps[-1]))
    assert first == pytest.approx(mp.price_row(b)["iteration_ms"], rel=1e-9)
    assert last == pytest.approx(mp.price_row(a)["iteration_ms"], rel=1e-9)
    assert mp.flags(steps[-1][1]["args"]) == mp.flags(a["args"]) and steps[-1][1]["mbs"] == 8
    other = _row(mp, "25.11/pretrain/qwen3-30b-a3b/gb200x8/mxfp8")
    with pytest.raises(ValueError, match="cluster 1x8-gb200 vs 1x8-gb300"):
        mp.walk(a, other)


def test_walk_of_an_unknown_row_is_one_line_and_exit_2(mp, capsys, tmp_path):
    """--walk with a row id neither shared table has: one line naming it, exit 2, nothing written."""
    rc = mp.main(["--walk", "26.04.01/no-such-row", "25.11/no-such-row", "--json", str(tmp_path / "x.json")])
    out = capsys.readouterr().out.strip().splitlines()
    assert rc == 2 and len(out) == 1 and "no row '26.04.01/no-such-row'" in out[0]
    assert not (tmp_path / "x.json").exists()
