"""The search settled under the MoE setting its final step chose (search/planner/settle.py): the first search
explores expert shapes under the published dispatcher only, its final step turns the EP overlap on, and a shape
that wins only under the overlap was never priced. The reference is independent of the search: every expert shape
and per-rank micro-batch of the one-stage tp-1 dp-8 plan (the shape both searches end on) priced under the setting
the search chose, by brute force.

The shared-expert overlap, which excludes the EP overlap, wins the single search's final step by 0.1% at ep 8; the
settled search runs its rounds again without it (``SearchOptions.shared_overlap``).

The row: Nemotron-3 Nano on 8 GB300 (Megatron-Bridge 26.04.01, MXFP8, tp1 ep8 mbs4, flex / HybridEP), without its
cross-entropy fusion."""

from __future__ import annotations

import pytest

from bench_modules import load
from search.costmodel.types import Shape
from search.planner.aceso import SearchOptions, search
from search.planner import fine_offload
from search.planner.api import make_space
from search.planner.settle import settle
from search.planner.state import Evaluator, State, from_plan
from search.pricing import price

hp = load("hybrid_published")
BUDGET = 300


@pytest.fixture(scope="module")
def row():
    r = next(r for r in hp.load() if r["id"].startswith("26.04.01/pretrain/nemotron-3-nano/gb300x8/mxfp8"))
    # without the run's TE cross-entropy fusion: the loss then weighs enough that one search stops short of the
    # overlap's shape (with it, the single search happens to land within 0.2% of it)
    r = {**r, "settings": {k: v for k, v in r["settings"].items() if k != "cross_entropy_fusion_impl"}}
    x = hp.price_row(r)
    assert x["status"] == "priced"
    return x["_plan"], x["_cm"], x["_training"]


def _brute(cm, tr, space, moe, features) -> float:
    """The fastest fitting tp-1 dp-8 one-stage plan over every ep and per-rank micro-batch, under ``moe``."""
    ev = Evaluator(cm, tr.global_batch_size, None, "megatron-lm", moe)
    best = float("inf")
    for ep in (1, 2, 4, 8):
        for b in space.batches:
            st = State(8 * b, (Shape(1, 8, 1, False, ep, 0),), (0, space.num_units), features)
            if space.legal(st):
                e = ev.evaluate(st, charge=False, exact=True)
                best = min(best, e.iteration_ms if e.fits else best)
    return best


def test_settled_search_reaches_the_shape_the_chosen_setting_favours(row, monkeypatch):
    plan, cm, tr = row
    # the MoE settings' rounds alone: without the fine-grained offload candidates (fine_offload.py), which make the
    # single search's final step 1.2% faster here
    monkeypatch.setattr(fine_offload, "candidates", lambda *a, **k: [])
    seeds = [from_plan(plan)[0]]
    space = make_space(cm, tr, "megatron-lm", moe=plan.moe)
    once = search(cm, tr.global_batch_size, space, SearchOptions(budget_evals=BUDGET, seeds=seeds)).plans[0]
    res, log = settle(cm, tr, "megatron-lm", SearchOptions(budget_evals=BUDGET, seeds=seeds), moe=plan.moe)
    best = res.plans[0]
    # the single search's final step chooses the shared-expert overlap (alltoall, ep 8), which excludes the EP
    # overlap; settling also under the best setting without it reaches the EP overlap's shape
    assert once.moe.shared_expert_overlap and best.moe.overlap_ep_comm and not best.moe.shared_expert_overlap
    assert len(log) == 6 and "shared-expert overlap" in log[1]
    assert log[2].startswith("without the shared-expert overlap, search") and "EP overlap" in log[3]
    assert all(line.startswith("again under graphs") for line in log[4:])     # the best plan's two best scopes
    ref = _brute(cm, tr, make_space(cm, tr, "megatron-lm", moe=best.moe), best.moe,
                 best.state.features._replace(stack=None))
    assert best.iteration_ms <= ref * (1 + 1e-9)                      # at least the brute-force best of that shape
    assert once.iteration_ms > ref * 1.02                             # the single search missed it by > 2%
    assert best.state.shapes[0].ep < once.state.shapes[0].ep
    assert price(hp.row_plan(next(r for r in hp.load() if r["id"].startswith(
        "26.04.01/pretrain/nemotron-3-nano/gb300x8/mxfp8")))[0]).iteration_ms > best.iteration_ms


def test_settled_search_is_never_slower_than_one_search_and_keeps_the_wider_space_seeded(row):
    """The wider space (CP degrees) searched last from the best plan: never slower than the narrower result."""
    plan, cm, tr = row
    seeds = [from_plan(plan)[0]]
    narrow, _ = settle(cm, tr, "megatron-lm", SearchOptions(budget_evals=BUDGET, seeds=seeds), moe=plan.moe)
    wide, log = settle(cm, tr, "megatron-lm", SearchOptions(budget_evals=BUDGET, seeds=seeds), moe=plan.moe,
                       wider=tr.model_copy(update={"context_parallel_sizes": [1, 2, 4, 8]}))
    assert log[-1].startswith("the wider space")
    assert wide.plans[0].iteration_ms <= narrow.plans[0].iteration_ms * (1 + 1e-9)
