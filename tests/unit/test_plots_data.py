"""The data behind the pictures (no matplotlib): timeline boxes, memory bars, search progress, training logs.

References: the cost model's own numbers (``PlanCost``: iteration time, ``StageCost`` terms and memory) and, for
the activation split, the cost model's price of the same units as a stage of their own.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from search.spec.cluster import parse_cluster
from search.pricing import make_cost_model
from search.costmodel.types import Event, StageCost
from search.io.errors import AcesoError
from search.spec.plan import ParallelPlan, StageSpec, uniform_plan
from search.plots import memory, search_progress, timeline, training
from search.spec.presets import load_model
from search.spec.training import TrainingSpec

GPT = load_model("gpt-1.3b")
A100 = parse_cluster("1x8-a100")
TWO = ParallelPlan(model=GPT, cluster=A100, micro_batch_size=4, global_batch_size=64, stages=[
    StageSpec(num_gpus=4, tp=2, dp=2, start_unit=0, end_unit=20, recompute=["selective"] * 20),
    StageSpec(num_gpus=4, tp=4, dp=1, start_unit=20, end_unit=48, recompute=["none"] * 14 + ["full"] * 14)])
FOUR = ParallelPlan(model=GPT, cluster=A100, micro_batch_size=2, global_batch_size=32, stages=[
    StageSpec(num_gpus=1, tp=1, dp=1, start_unit=0, end_unit=6, recompute=["full"] * 6),
    StageSpec(num_gpus=2, tp=2, dp=1, start_unit=6, end_unit=20, recompute=["none"] * 14),
    StageSpec(num_gpus=4, tp=2, dp=2, start_unit=20, end_unit=40, recompute=["selective"] * 10 + ["none"] * 10),
    StageSpec(num_gpus=1, tp=1, dp=1, start_unit=40, end_unit=48, recompute=["full"] * 8)])
VPP = uniform_plan(GPT, 4, 2, 1, 2, 32, recompute="selective", cluster=A100, num_virtual_stages=3)


def priced(plan):
    cm = make_cost_model(plan.model, plan.cluster, TrainingSpec(global_batch_size=plan.global_batch_size,
                                                                precision="fp16"))
    return cm, cm.evaluate(plan)


def own_work_ms(s: StageCost, m: int) -> float:
    """A stage's busy time from its cost terms: M micro-batches of every per-micro-batch term, one sync + step."""
    if s.chunk_fwd_ms:
        per = sum(s.chunk_fwd_ms) + sum(s.chunk_bwd_ms)
    else:
        per = s.fwd_ms + s.bwd_ms + s.recompute_ms + s.p2p_ms
    return m * per + s.dp_sync_ms + s.optimizer_ms


# ----- timeline ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("plan", [TWO, FOUR, VPP], ids=["2-stage", "4-stage", "interleaved"])
def test_timeline_busy_time_per_stage_is_the_cost_models(plan):
    cm, cost = priced(plan)
    boxes = timeline.boxes(cm, cost.stages, plan.num_micro_batches)
    busy = timeline.busy_ms(boxes, plan.num_stages)
    assert busy == pytest.approx([own_work_ms(s, plan.num_micro_batches) for s in cost.stages], rel=1e-12)


@pytest.mark.parametrize("plan", [TWO, FOUR, VPP], ids=["2-stage", "4-stage", "interleaved"])
def test_timeline_ends_at_the_cost_models_iteration_time(plan):
    cm, cost = priced(plan)
    boxes = timeline.boxes(cm, cost.stages, plan.num_micro_batches)
    assert max(b.end_ms for b in boxes) == pytest.approx(cost.iteration_ms, rel=1e-12)


def test_coarse_events_are_cut_into_their_cost_terms_without_moving_their_ends():
    """A cost model that emits only coarse events (here: none at all, so the 1F1B simulation of its stage times):
    each box is cut into the StageCost terms it is the sum of, back to back, its ends unmoved."""
    _, cost = priced(FOUR)
    M = FOUR.num_micro_batches
    coarse = timeline.schedule_events(object(), cost.stages, M)
    assert {e.kind for e in coarse} == {"forward", "backward", "sync"}
    boxes = timeline.boxes(object(), cost.stages, M)
    for e in coarse:
        pieces = [b for b in boxes if (b.stage, b.micro_batch) == (e.stage, e.micro_batch)
                  and e.start_ms - 1e-9 <= b.start_ms and b.end_ms <= e.end_ms + 1e-9]
        assert pieces[0].start_ms == e.start_ms and pieces[-1].end_ms == e.end_ms
        assert all(a.end_ms == b.start_ms for a, b in zip(pieces, pieces[1:]))   # back to back
        s = cost.stages[e.stage]
        got = {b.kind: b.end_ms - b.start_ms for b in pieces}
        if e.kind == "forward":
            want = {"forward": s.fwd_ms, "p2p": s.p2p_ms / 2}
        elif e.kind == "backward":
            want = {"recompute": s.recompute_ms, "backward": s.bwd_ms, "p2p": s.p2p_ms / 2}
        else:
            want = {"dp_comm": s.dp_sync_ms, "optimizer": s.optimizer_ms}
        assert got == pytest.approx({k: v for k, v in want.items() if v > 0}, rel=1e-9, abs=1e-9)
    # stage 1 recomputes nothing: no recompute box; stage 0 recomputes everything: one per micro-batch
    assert sum(b.kind == "recompute" for b in boxes if b.stage == 1) == 0
    assert sum(b.kind == "recompute" for b in boxes if b.stage == 0) == M


def test_interleaved_boxes_one_per_chunk_and_micro_batch():
    cm, cost = priced(VPP)
    boxes = timeline.boxes(cm, cost.stages, VPP.num_micro_batches)
    for s in range(VPP.num_stages):
        for c in range(3):
            for kind in ("forward", "backward"):
                mbs = sorted(b.micro_batch for b in boxes if (b.stage, b.chunk, b.kind) == (s, c, kind))
                assert mbs == list(range(VPP.num_micro_batches))


class _FineModel:
    """A cost model that emits finer kinds itself, hidden communication included."""

    def pipeline_events(self, stage_costs, m):
        return [Event(0, 0, 0, "forward", 0.0, 1.0), Event(0, 0, 0, "recompute", 1.0, 1.5),
                Event(0, 0, 0, "backward", 1.5, 3.0), Event(0, -1, -1, "dp_comm_hidden", 2.0, 3.0),
                Event(0, -1, -1, "dp_comm", 3.0, 3.25)]


def test_finer_kinds_from_the_cost_model_pass_through_and_hidden_time_is_not_busy():
    stages = [StageCost(1.0, 1.5, 0.5, 0.0)]
    boxes = timeline.boxes(_FineModel(), stages, 1)
    assert boxes == _FineModel().pipeline_events(stages, 1)
    assert timeline.busy_ms(boxes, 1) == [3.25]


def test_a_cost_model_without_events_gets_the_1f1b_simulation_of_its_stage_times():
    stages = [StageCost(1.0, 3.0, 0.0, 0.0), StageCost(2.0, 4.0, 0.0, 0.0)]
    boxes = timeline.boxes(object(), stages, 4)
    assert max(b.end_ms for b in boxes) == 28.0    # the schedule drawn by hand (test_costmodel_pipeline)
    assert timeline.busy_ms(boxes, 2) == [16.0, 24.0]


def test_big_pipelines_show_a_sample_of_stages_with_the_first_last_and_bottleneck():
    assert timeline.shown_stages(12, 5) == list(range(12))
    for S, b in ((64, 31), (64, 0), (100, 99), (33, 17)):
        rows = timeline.shown_stages(S, b)
        assert len(rows) == timeline.MAX_ROWS and rows == sorted(set(rows))
        assert {0, S - 1, b} <= set(rows)
        gaps = np.diff(rows)
        assert gaps.max() - gaps.min() <= 2           # evenly spaced (the bottleneck may shift one pick)


def test_dense_rows_integrate_each_kinds_boxes_exactly():
    """The share strips of dense timelines: covered time left of each column edge, against a brute-force sum."""
    rng = np.random.default_rng(0)
    starts = np.sort(rng.uniform(0, 100, 50))
    ends = starts + rng.uniform(0, 1.5, 50)
    at = np.linspace(-1, 102, 333)
    brute = [sum(min(max(x - a, 0.0), b - a) for a, b in zip(starts, ends)) for x in at]
    assert timeline._covered(starts, ends, at) == pytest.approx(brute, abs=1e-9)


# ----- memory ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("plan", [TWO, FOUR, VPP], ids=["2-stage", "4-stage", "interleaved"])
def test_memory_bars_sum_to_the_cost_models_stage_memory(plan):
    cm, cost = priced(plan)
    segs = memory.segments(cm, plan, cost.stages)
    assert [sum(v for _, v in s) for s in segs] == pytest.approx([s.memory_mb for s in cost.stages], rel=1e-12)
    for s, sc in zip(segs, cost.stages):
        keys = [k for k, _ in s]
        assert keys[:3] == ["params", "grads", "optimizer"] and "unattributed" not in keys
        assert dict(s)["reserve"] == sc.memory_breakdown["reserve"]
        assert all(v >= 0 for _, v in s)


def test_activations_split_by_recompute_choice_match_the_units_priced_alone():
    """FOUR's stage 2 (units 20-40, 10 selective then 10 none) is a middle stage: its activations are exactly its
    units', and each choice's share equals the cost model's activations for those units as a stage of their own."""
    cm, cost = priced(FOUR)
    segs = dict(memory.segments(cm, FOUR, cost.stages)[2])
    assert set(segs) >= {"act_selective", "act_none"} and "act_other" not in segs and "activations" not in segs
    M = FOUR.num_micro_batches

    def alone(a, b, choice):
        rc = np.full(b - a, {"none": 0, "selective": 1}[choice], dtype=np.int8)
        return cm.stage_cost(2, 4, 3, a, b, 2, 2, rc, 2, num_micro_batches=M).memory_breakdown["activations"]
    assert segs["act_selective"] == pytest.approx(alone(20, 30, "selective"), rel=1e-12)
    assert segs["act_none"] == pytest.approx(alone(30, 40, "none"), rel=1e-12)


def test_first_and_last_stage_activations_keep_an_embedding_and_head_remainder():
    cm, cost = priced(TWO)
    first, last = (dict(s) for s in memory.segments(cm, TWO, cost.stages))
    assert first["act_other"] > 0 and last["act_other"] > 0
    assert set(last) >= {"act_none", "act_full"}


class _NoTables:
    """A cost model without per-unit tables (like aceso-compat): activations stay one segment."""

    def unit_table(self, batch, tp, *rest):
        raise NotImplementedError


def test_without_unit_tables_activations_are_one_segment_and_the_sum_still_holds():
    stage = StageCost(1, 1, 0, 0, memory_mb=110.0, memory_breakdown={
        "params": 10.0, "grads": 10.0, "optimizer": 40.0, "activations": 30.0, "recompute_peak": 5.0,
        "p2p_buffers": 0.0, "reserve": 15.0})
    segs = memory.segments(_NoTables(), TWO, [stage, stage])[0]
    assert dict(segs)["activations"] == 30.0 and sum(v for _, v in segs) == 110.0
    odd = StageCost(1, 1, 0, 0, memory_mb=120.0, memory_breakdown=dict(stage.memory_breakdown))
    assert dict(memory.segments(_NoTables(), None, [odd])[0])["unattributed"] == pytest.approx(10.0)


# ----- search progress ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    from search.cli import main
    path = tmp_path_factory.mktemp("search") / "trace.json"
    assert main(["search", "--model", "gpt-1.3b", "--num-layers", "4", "--cluster", "1x4-h100",
                 "--global-batch-size", "64", "--budget-evals", "300", "--json", "--trace", str(path)]) == 0
    return json.loads(path.read_text())


def test_progress_points_reproduce_the_trace(trace, capsys):
    capsys.readouterr()
    segs, xname, mem = search_progress.progress(trace)
    key = f"{mem}_memory_after_mib"
    assert xname == ("accepted move" if "evaluations" not in trace[0] else "evaluations in the stage count's search")
    assert sum(len(p) - 1 for p in segs.values()) == len(trace)
    for S, pts in segs.items():
        moves = [m for m in trace if m["num_stages"] == S]
        assert pts[0].time_ms == moves[0]["time_before_ms"] and pts[0].primitive == "start"
        assert [p.time_ms for p in pts[1:]] == [m["time_after_ms"] for m in moves]
        assert [p.memory_mb for p in pts[1:]] == [m[key] for m in moves]
        assert [p.primitive for p in pts[1:]] == [m["primitives"][0] for m in moves]
        if "evaluations" not in trace[0]:
            assert [p.x for p in pts] == list(range(len(pts)))
        else:
            assert [p.x for p in pts[1:]] == [m["evaluations"] for m in moves]


def test_progress_uses_the_evaluation_count_and_bottleneck_memory_when_the_trace_has_them():
    moves = [{"num_stages": 2, "primitives": ["inc_tp", "move_units"], "time_before_ms": 10.0,
              "time_after_ms": 8.0, "max_memory_before_mb": None, "max_memory_after_mb": 5.0, "fits_before": False,
              "fits_after": True, "evaluations": 17, "bottleneck_memory_before_mb": 7.0,
              "bottleneck_memory_after_mb": 4.0}]
    segs, xname, mem = search_progress.progress(moves)
    assert xname.startswith("evaluations") and [p.x for p in segs[2]] == [0.0, 17.0]
    assert mem == "bottleneck" and [p.memory_mb for p in segs[2]] == [7.0, 4.0]
    assert segs[2][1].hops == 2 and segs[2][0].fits is False


def test_comparison_bars():
    import numpy as np

    from search.costmodel.types import Shape, StageCost
    from search.planner.baseline import BaselineResult
    from search.planner.state import Evaluation, StageEval, State
    st = State(4, (Shape(1, 4),) * 2, (0, 24, 48))       # pp 2, tp 1, dp 4, pipeline micro-batch 4
    stage = StageEval(StageCost(fwd_ms=1.0, bwd_ms=2.0, recompute_ms=0.0, p2p_ms=0.0), np.zeros(24, np.int8))
    base = BaselineResult(Evaluation(st, 100.0, True, [stage, stage], [100.0, 100.0], 0.0, 100.0), (12, 12), 1)
    bars = search_progress.comparison(base, 80.0, 90.0)
    assert [v for _, v in bars] == [100.0, 90.0, 80.0] and "pp2 tp1 dp4 mbs/rank 1," in bars[0][0]
    cp = State(4, (Shape(1, 2, 2),) * 2, (0, 24, 48))     # the same GPUs as tp 1 x cp 2 x dp 2
    base_cp = BaselineResult(Evaluation(cp, 100.0, True, [stage, stage], [100.0, 100.0], 0.0, 100.0), (12, 12), 1)
    assert "pp2 tp1 cp2 dp2 mbs/rank 2," in search_progress.comparison(base_cp, 80.0)[0][0]
    assert search_progress.comparison(None, 80.0)[0][1] is None
    mlm = search_progress.comparison(base, 90.0, target="megatron-lm")    # the search's plan is Megatron-LM's
    assert [v for _, v in mlm] == [100.0, 90.0] and mlm[1][0].startswith("Megatron-LM")


# ----- training log ------------------------------------------------------------------------------------------------
def _log(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_read_log_keeps_the_last_record_per_iteration_and_the_last_summary(tmp_path):
    recs = [{"kind": "train", "iteration": i, "loss": 5.0 - i / 10, "iteration_time_ms": 10.0} for i in (5, 10, 15)]
    recs += [{"kind": "eval", "iteration": 10, "loss": 4.5, "ppl": 90.0},
             {"kind": "summary", "measured_iteration_time_ms": 9.0, "measured_stage_memory_mb": [1.0]},
             {"kind": "message", "text": "resumed from ckpt at iteration 10"}]
    recs += [{"kind": "train", "iteration": i, "loss": 1.0, "iteration_time_ms": 11.0} for i in (15, 20)]
    recs += [{"kind": "summary", "measured_iteration_time_ms": 11.0, "measured_stage_memory_mb": [2.0]}]
    log = training.read_log(_log(tmp_path / "t.jsonl", recs))
    assert [r["iteration"] for r in log.train] == [5, 10, 15, 20]
    assert [r["loss"] for r in log.train] == [4.5, 4.0, 1.0, 1.0]
    assert [r["loss"] for r in log.evals] == [4.5] and log.summary["measured_stage_memory_mib"] == [2.0]   # an old *_mb log reads under the MiB name


def test_a_run_shorter_than_its_log_interval_still_has_a_picture(tmp_path):
    log = training.read_log(_log(tmp_path / "t.jsonl", [{"kind": "summary", "measured_iteration_time_ms": 9.0}]))
    assert log.train == [] and log.summary["measured_iteration_time_ms"] == 9.0


@pytest.mark.parametrize("text,words", [
    ('{"kind": "train", "iteration": 1, "loss": 2.0}\nnot json\n', "t.jsonl:2: not a JSON line"),
    ('{"kind": "message", "text": "hi"}\n', "no train, eval or summary records"),
    ('{"kind": "train", "iteration": "one", "loss": 2.0}\n', "t.jsonl:1: a train record needs"),
])
def test_bad_logs_are_one_line(tmp_path, text, words):
    (tmp_path / "t.jsonl").write_text(text)
    with pytest.raises(AcesoError, match=words):
        training.read_log(tmp_path / "t.jsonl")
    with pytest.raises(AcesoError, match="no such log file"):
        training.read_log(tmp_path / "missing.jsonl")


def test_moe_flex_plan_memory_bar_names_the_dispatch_buffers():
    """A flex-dispatcher MoE stage's memory bar has the DeepEP buffer as its own labelled segment (moe_cost's
    ``dispatch_buffers``), between the p2p buffers and the reserve, and the segments add up to the stage's peak."""
    from search.settings.moe_plan import MoEPlanSettings
    from search.spec.plan import ChunkSpec

    m = load_model("qwen3-30b-a3b", num_layers=2)
    st = StageSpec(num_gpus=16, tp=1, dp=16, ep=16, chunks=[ChunkSpec(start_unit=0, end_unit=m.num_units,
                                                                     recompute=["none"] * m.num_units)])
    p = ParallelPlan(model=m, micro_batch_size=16, global_batch_size=64, stages=[st],
                     moe=MoEPlanSettings(token_dispatcher="flex"))
    cm = make_cost_model(m, parse_cluster("2x8-h100"), TrainingSpec(global_batch_size=64))
    c = cm.evaluate(p)
    (segs,) = memory.segments(cm, p, c.stages)
    keys = [k for k, _ in segs]
    assert keys.index("p2p_buffers") < keys.index("dispatch_buffers") < keys.index("reserve")
    assert dict(segs)["dispatch_buffers"] > 0 and all(k in memory.LABELS for k in keys)
    assert sum(v for _, v in segs) == pytest.approx(c.stages[0].memory_mb, rel=1e-9)
