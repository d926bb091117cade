"""Exact per-stage recompute (search/planner/recompute.py) against brute force over every assignment."""

import itertools

import numpy as np
import pytest

from search.spec.cluster import parse_cluster
from search.costmodel.types import N_RC, UNAVAILABLE_MS
from search.planner.recompute import allowed_codes, optimize_stage, solve
from search.planner.synthetic import SyntheticCostModel
from search.spec.presets import load_model
from search.spec.training import TrainingSpec


def _brute(rt, act, peak, k, budget):
    n = len(rt)
    best = np.inf
    for ch in itertools.product(range(N_RC), repeat=n):
        ch = np.array(ch)
        idx = np.arange(n)
        if (rt[idx, ch] >= UNAVAILABLE_MS).any():
            continue
        if k * act[idx, ch].sum() + peak[idx, ch].max() <= budget:
            best = min(best, rt[idx, ch].sum())
    return best


@pytest.mark.parametrize("seed", range(60))
def test_solve_matches_brute_force(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 7))
    ntypes = int(rng.integers(1, 4))  # repeated rows, as layers of one kind are
    rt = rng.uniform(0, 3, (ntypes, N_RC))
    rt[:, 0] = 0
    act = rng.uniform(1, 10, (ntypes, N_RC))
    peak = rng.uniform(0, 5, (ntypes, N_RC))
    peak[:, 0] = 0
    rt[rng.uniform(size=ntypes) < 0.4, N_RC - 1] = UNAVAILABLE_MS   # attn_dropout on an MLP type
    ty = rng.integers(0, ntypes, n)
    rt, act, peak = rt[ty], act[ty], peak[ty]
    k = int(rng.integers(1, 4))
    budget = float(rng.uniform(0, k * act.sum() + 6))
    want = _brute(rt, act, peak, k, budget)
    got = solve(rt, act, peak, k, budget)
    if not np.isfinite(want):
        assert got is None
        return
    idx = np.arange(n)
    assert k * act[idx, got].sum() + peak[idx, got].max() <= budget + 1e-9
    assert rt[idx, got].sum() == pytest.approx(want, abs=1e-9)


@pytest.mark.parametrize("seed", range(8))
def test_optimize_stage_matches_brute_force_on_cost_model(seed):
    model = load_model("gpt-1.3b", num_layers=3)
    cm = SyntheticCostModel(model, parse_cluster("1x2-h100"), TrainingSpec(global_batch_size=16), seed=seed,
                            memory_limit_mb=400.0 + 60 * seed)
    i, S, a, b, mbs = seed % 2, 2, 0 if seed % 2 == 0 else 1, 5 if seed % 2 == 0 else 6, 2
    _rc, cost = optimize_stage(cm, i, S, i, a, b, 1, 1, mbs)
    best = np.inf
    for ch in itertools.product(*allowed_codes(model, a, b)):
        c = cm.stage_cost(i, S, i, a, b, 1, 1, np.array(ch, np.int8), mbs)
        if c.fits:
            best = min(best, c.time_per_microbatch_ms)
    if np.isfinite(best):
        assert cost.fits
        assert cost.time_per_microbatch_ms == pytest.approx(best, rel=1e-12)
    else:
        assert not cost.fits


def test_optimize_stage_with_analytic_model_fits_and_beats_uniform_choices():
    from search.pricing import make_cost_model
    model = load_model("gpt-1.3b", num_layers=4)
    cluster = parse_cluster("1x1-h100", memory_limit_mb=26000)
    cm = make_cost_model(model, cluster, TrainingSpec(global_batch_size=64))
    n = model.num_units
    _rc, cost = optimize_stage(cm, 0, 1, 0, 0, n, 1, 1, 8)
    assert cost.fits
    for code in range(3):  # never slower than recomputing every unit the same way, when that fits
        c = cm.stage_cost(0, 1, 0, 0, n, 1, 1, np.full(n, code, np.int8), 8)
        if c.fits:
            assert cost.time_per_microbatch_ms <= c.time_per_microbatch_ms + 1e-9
    best = np.inf  # and exactly optimal against brute force over all 4^4 * 3^4 assignments
    for ch in itertools.product(*allowed_codes(model, 0, n)):
        c = cm.stage_cost(0, 1, 0, 0, n, 1, 1, np.array(ch, np.int8), 8)
        if c.fits:
            best = min(best, c.time_per_microbatch_ms)
    assert cost.time_per_microbatch_ms == pytest.approx(best, rel=1e-12)


@pytest.mark.parametrize("frac", [0.25, 0.5, 0.75])
def test_optimize_stage_on_an_moe_stage_at_tp_2_fits(frac):
    """The knapsack's table is the stage's own (``table_kwargs``: SP, ep, etp as ``stage_cost`` takes them; SP was
    dropped, ``True in (1,)``, so the table of an MoE stage at tp > 1 was refused and every such state of the
    heterogeneous search priced unfit): at a memory limit between all-none and all-full the choice fits, is
    priced at its own expert shape and is never slower than recomputing every unit fully. (Brute force over every
    assignment can be faster at these shapes, dense SP stages too: the knapsack's additive memory is an
    approximation, docs/search.md.)"""
    from search.pricing import make_cost_model
    model = load_model("qwen3-30b-a3b", num_layers=2)
    n, tr, kw = model.num_units, TrainingSpec(global_batch_size=64), {"sp": True, "ep": 4, "etp": 1}
    full = make_cost_model(model, parse_cluster("1x8-h100"), tr)
    args = (0, 1, 0, 0, n, 2, 4)
    lo, hi = (full.stage_cost(*args, np.full(n, c, np.int8), 16, cp=1, **kw).memory_mb for c in (2, 0))
    cm = make_cost_model(model, parse_cluster("1x8-h100", memory_limit_mb=lo + (hi - lo) * frac), tr)
    rc, cost = optimize_stage(cm, *args, 16, cp=1, **kw)
    assert cost.fits and cost.memory_mb == cm.stage_cost(*args, rc, 16, cp=1, **kw).memory_mb
    assert cost.time_per_microbatch_ms <= cm.stage_cost(*args, np.full(n, 2, np.int8), 16, cp=1,
                                                        **kw).time_per_microbatch_ms + 1e-9


class _OpLevel:
    """The synthetic model without unit tables, as an op-level model (aceso-compat) presents itself."""

    def __init__(self, cm):
        self._cm = cm
        self.model, self.cluster, self.training = cm.model, cm.cluster, cm.training
        self.memory_limit_mb = cm.memory_limit_mb

    def unit_table(self, batch, tp):
        raise NotImplementedError

    def stage_cost(self, *a, **k):
        return self._cm.stage_cost(*a, **k)

    def pipeline(self, *a, **k):
        return self._cm.pipeline(*a, **k)


@pytest.mark.parametrize("seed", range(6))
def test_probing_path_fits_and_local_search_never_hurts(seed):
    from search.planner.recompute import has_unit_tables, refine_by_local_search
    model = load_model("gpt-1.3b", num_layers=3)
    syn = SyntheticCostModel(model, parse_cluster("1x2-h100"), TrainingSpec(global_batch_size=16), seed=seed,
                             memory_limit_mb=500.0 + 50 * seed)
    cm = _OpLevel(syn)
    assert has_unit_tables(syn) and not has_unit_tables(cm)
    n = model.num_units
    rc, cost = optimize_stage(cm, 0, 2, 0, 0, n, 1, 1, 2)
    fitting = [c for code in range(3)
               if (c := syn.stage_cost(0, 2, 0, 0, n, 1, 1, np.full(n, code, np.int8), 2)).fits]
    if not fitting:
        return
    assert cost.fits
    assert cost.time_per_microbatch_ms <= min(c.time_per_microbatch_ms for c in fitting) + 1e-9

    def f(r):
        return syn.stage_cost(0, 2, 0, 0, n, 1, 1, r, 2)
    _, cost2 = refine_by_local_search(f, rc, cost, allowed_codes(model, 0, n))
    assert cost2.fits and cost2.time_per_microbatch_ms <= cost.time_per_microbatch_ms
    exact, _ = optimize_stage(syn, 0, 2, 0, 0, n, 1, 1, 2)  # and the exact optimum bounds both from below
    assert f(exact).time_per_microbatch_ms <= cost2.time_per_microbatch_ms + 1e-9


@pytest.mark.parametrize("frac", [0.15, 0.4, 0.7, 0.9])
def test_optimize_interleaved_stage_matches_brute_force(frac):
    # an interleaved stage weighs each chunk's activations by its own in-flight count (3 and 2 micro-batches here):
    # the exact solver against every assignment of its 4 units, priced by the analytic model itself
    from search.pricing import make_cost_model
    from search.costmodel.memory import in_flight_per_chunk
    from search.costmodel.types import Shape
    model = load_model("gpt-1.3b", num_layers=4)
    tr = TrainingSpec(global_batch_size=64)
    spans = ((0, 2), (4, 6))                      # stage 0 of 2 with 2 chunks: model chunks 0 and 2
    kw = {"prev": Shape(1, 1), "next": Shape(1, 1), "spans": spans}
    assert in_flight_per_chunk(0, 2, 2, 64 // 4) == (3, 2)

    def mem(cm, code):
        return cm.stage_cost(0, 2, 0, 0, 6, 1, 1, np.full(4, code, np.int8), 4, **kw).memory_mb
    big = make_cost_model(model, parse_cluster("1x2-h100"), tr)
    lo, hi = mem(big, 2), mem(big, 0)
    cm = make_cost_model(model, parse_cluster("1x2-h100", memory_limit_mb=lo + frac * (hi - lo)), tr)
    _rc, cost = optimize_stage(cm, 0, 2, 0, 0, 6, 1, 1, 4, **kw)
    best = np.inf
    units = [u for a, b in spans for u in range(a, b)]
    for ch in itertools.product(*[allowed_codes(model, u, u + 1)[0] for u in units]):
        c = cm.stage_cost(0, 2, 0, 0, 6, 1, 1, np.array(ch, np.int8), 4, **kw)
        if c.fits:
            best = min(best, c.time_per_microbatch_ms)
    assert np.isfinite(best) and cost.fits
    assert cost.time_per_microbatch_ms == pytest.approx(best, rel=1e-12)


# ----- speed-ups that must not change a result -------------------------------------------------------------------
def _frontier_step_by_concatenation(front, rt, act, choices, cap):
    """The frontier step as first written: concatenate one copy per choice, then ``_pareto``."""
    from search.planner.recompute import _EYE, _pareto
    a0, t0, c0 = front
    return _pareto(np.concatenate([a0 + act[c] for c in choices]), np.concatenate([t0 + rt[c] for c in choices]),
                   np.concatenate([c0 + _EYE[c] for c in choices]), cap)


@pytest.mark.parametrize("seed", range(12))
def test_type_frontier_is_bit_identical_to_concatenation_and_pareto(seed):
    from search.planner import recompute
    rng = np.random.default_rng(seed)
    rt = np.concatenate([[0.0], rng.uniform(0, 5, N_RC - 1) if seed % 2 else np.round(rng.uniform(0, 4, N_RC - 1))])
    act = np.concatenate([[0.0], -rng.uniform(0, 90, N_RC - 1) if seed % 3 else -np.round(rng.uniform(0, 3, N_RC - 1))])
    if seed % 4 == 0:
        rt[N_RC - 1], act[N_RC - 1] = UNAVAILABLE_MS, 0.0
    allowed = (True,) + tuple(bool(x) for x in rng.uniform(size=N_RC - 1) < 0.8)
    choices = [c for c in range(N_RC) if allowed[c]]
    cap = int(rng.choice([4, 16, 64]))
    front = (np.zeros(1), np.zeros(1), np.zeros((1, N_RC), np.int64))
    recompute._FRONTIERS.clear()
    for n in range(1, 90):
        front = _frontier_step_by_concatenation(front, rt, act, choices, cap)
        got = recompute._type_frontier(rt, act, allowed, n, cap)
        for want, have in zip(front, got):
            assert want.dtype == have.dtype and np.array_equal(want, have)


@pytest.mark.parametrize("lo,hi", [(0.0, 1.0), (-5.3, -5.3), (-123.456, 7.89), (5e-324, 1e-323), (-1e-300, 0.0)])
def test_thin_edges_is_linspace_bit_for_bit(lo, hi):
    from search.planner.recompute import _thin_edges
    for cap in (2, 3, 64, 256):
        assert np.array_equal(_thin_edges(lo, hi, cap), np.linspace(lo, hi, cap))


def test_count_assignments_counts_without_enumerating():
    from search.planner.recompute import count_assignments
    model = load_model("gpt-1.3b", num_layers=3)
    kinds = [(u.stack, u.kind) for u in model.units]
    allowed = allowed_codes(model, 0, model.num_units)
    number, each = count_assignments(kinds, allowed)
    assert number == len(list(each)) == 20 * 10   # 3 attention units x 4 codes, 3 MLP units x 3 codes
    big = load_model("gpt-scale-layer", num_layers=1024)
    kinds = [(u.stack, u.kind) for u in big.units[:512]]
    number, _ = count_assignments(kinds, allowed_codes(big, 0, 512))   # C(259, 3) C(258, 2)
    assert number == 2_862_209 * 33_153
