"""Mamba-2 context parallelism priced (search.layers.mamba.price_layer) and searched: megatron-core 0.19's
``MambaContextParallel`` swaps the sequence split for a head split with all-to-alls over the CP group: before the
conv z, x (d_inner / tp each), B, C (N x the groups a rank holds, repeated when cp > g / tp) and dt (H / tp), after
the scan y (d_inner / tp); backward runs them reversed. Each moves (cp - 1) / cp of a ``b s / cp x width`` tensor."""

from __future__ import annotations

import json

import pytest

from search.spec.cluster import parse_cluster
from search.costmodel.analytic import AnalyticSource
from search.costmodel.comm import ALPHA_INTER_MS, ALPHA_INTRA_MS, CommModel
from search.spec.presets import load_model
from search.spec.training import TrainingSpec


def _mamba_row(model, cluster, tp, cp, b=1):
    from search.costmodel.analytic import _unit_rows
    src = AnalyticSource(model, cluster, TrainingSpec(global_batch_size=8), CommModel(cluster))
    rows = _unit_rows(src, b, tp, cp, tp > 1)
    return src, next(r for k, r in rows.items() if k[1] == "mamba")


def test_the_all_to_all_volumes_of_nemotron_h_8b_by_hand():
    """Nemotron-H 8B (h 4096, 128 heads of 64: d_inner 8192; 8 groups, state 128), seq 8192, tp 2, cp 4 on one
    8-GPU H100 node: 2048 tokens per rank; widths z, x 4096, B, C 4 groups x 128 = 512, dt 64, y 4096; bf16.
    Each all-to-all: the latency of one step inside a node + 3/4 of its bytes over NVLink."""
    m = load_model("nemotron-h-8b")
    cl = parse_cluster("1x8-h100")
    src, cp4 = _mamba_row(m, cl, 2, 4)
    _, cp1 = _mamba_row(m, cl, 2, 1)
    gbps = CommModel(cl).intra_gbps
    tokens = 8192 // 4
    one_way = sum(ALPHA_INTRA_MS + 2 * tokens * w * 3 / 4 / (gbps * 1e6) for w in (4096, 4096, 512, 512, 64, 4096))
    assert cp4.cost.cp_comm == pytest.approx(2 * one_way, rel=1e-12)
    assert cp4.cost.comm_fwd[2] == pytest.approx(one_way, rel=1e-12)
    assert cp1.cost.cp_comm == 0.0
    # the rest of the layer's time is the cp 1 layer's at a quarter of the sequence (whole heads per rank)
    _, quarter = _mamba_row(m.model_copy(update={"seq_length": 2048}), cl, 2, 1)
    assert cp4.cost.fwd - one_way == pytest.approx(quarter.cost.fwd, rel=1e-9)


def test_a_cp_group_across_nodes_pays_the_network():
    """tp 4 x cp 4 = 16 ranks on two 8-GPU nodes: each CP group has 2 ranks per node, so half of each all-to-all
    crosses the network (the slower share) at the inter-node latency. 2 groups per TP rank over 4 CP ranks: each
    group's B and C go to 2 ranks (widths 4 x 128)."""
    m = load_model("nemotron-h-8b")
    cl = parse_cluster("2x8-h100")
    _, row = _mamba_row(m, cl, 4, 4)
    comm = CommModel(cl)
    tokens = 8192 // 4
    widths = (2048, 2048, 4 * 128, 4 * 128, 32, 2048)
    one_way = sum(ALPHA_INTER_MS + max(2 * tokens * w * 1 / 4 / (comm.intra_gbps * 1e6),
                                       2 * tokens * w * 2 / 4 / (comm.inter_gbps * 1e6)) for w in widths)
    assert row.cost.cp_comm == pytest.approx(2 * one_way, rel=1e-12)


def test_the_search_uses_cp_on_a_hybrid_model_only_where_megatron_core_allows_it():
    """Nemotron-H 8B: 128 heads, 8 groups; tp 2 leaves 64 heads a rank, so cp 128 is refused (cp_refusal: whole
    heads per CP rank) while tp 1 takes it (128 heads; each of the 8 groups repeated on 16 CP ranks), and cp 2 is
    searched with either (--target megatron-lm: Megatron-LM runs Mamba CP; the aceso runtime does not yet, so its
    search keeps cp 1 and its pre-flight refuses such a plan in one line)."""
    from search.costmodel.types import Shape
    from search.planner.space import Space
    m = load_model("nemotron-h-8b")
    tr = TrainingSpec(global_batch_size=32, context_parallel_sizes=[1, 2, 128])
    sp = Space.of(m, parse_cluster("16x8-h100"), tr, priced=frozenset({"context_parallel"}), target="megatron-lm")
    assert sp.cps == (1, 2, 128) and 2 in sp.tps
    assert sp.shape_ok(Shape(2, 1, 2, False)) and sp.shape_ok(Shape(1, 1, 128, False))
    assert not sp.shape_ok(Shape(2, 1, 128, False))
    assert sp.bad_tp_cp == {(t, 128) for t in sp.tps if t > 1}
    assert Space.of(m, parse_cluster("16x8-h100"), tr, priced=frozenset({"context_parallel"})).cps == (1,)


def test_the_runtime_preflight_refuses_mamba_cp_in_one_line():
    from search.io.errors import AcesoError
    from search.targets.preflight import planner_checks
    from tests.hybrid_plans import cut_plan
    m = load_model("nemotron-h-8b")
    plan = cut_plan(m, [0, 26, 52], 2, tp=2, gbs=8)
    stages = [st.model_copy(update={"cp": 2, "num_gpus": 4}) for st in plan.stages]
    plan = plan.model_copy(update={"stages": stages})
    with pytest.raises(AcesoError) as e:
        planner_checks(plan, "cuda", "runtime")
    assert str(e.value).startswith("stages[0].cp (2): the aceso runtime does not run Mamba-2") and "\n" not in str(e.value)
    planner_checks(plan, "cuda", "megatron-lm")        # Megatron-LM runs it


def test_search_says_when_the_heterogeneous_plans_leave_out_the_cp_asked_for(tmp_path, capsys):
    """``aceso search --cp 2`` of a Mamba-2 model: the heterogeneous line is a cp 1 plan (the aceso runtime refuses
    Mamba-2 under cp: ``validate --target aceso`` of the cp 2 Megatron-LM plan, the reference), and the report says
    so in one note on stderr; a model without such layers, or no --cp, gets none. Before, --cp 2 was dropped from
    the heterogeneous search without a word."""
    from search.cli import main

    out = tmp_path / "plan.json"
    args = ["search", "--cluster", "1x8-h100", "--global-batch-size", "64", "--budget-evals", "100", "--json"]
    assert main([*args, "--model", "nemotron-h-8b", "--cp", "2", "--target", "megatron-lm", "-o", str(out)]) == 0
    cap = capsys.readouterr()
    got = json.loads(cap.out)
    assert "cp2" in got["lines"]["megatron_lm"]["plan"] and " cp" not in got["lines"]["aceso"]["plan"]
    assert main(["validate", str(out), "--target", "aceso"]) == 2
    assert "Mamba-2 layers under context parallelism" in capsys.readouterr().err
    notes = [n for n in cap.err.splitlines() if "--cp 2" in n]
    assert len(notes) == 1 and "the aceso runtime does not run Mamba-2 layers under context parallelism" in notes[0]
    for extra in (["--model", "nemotron-h-8b"], ["--model", "llama3-8b", "--cp", "2"]):
        assert main([*args, *extra, "-o", str(out)]) == 0
        assert "--cp" not in capsys.readouterr().err
