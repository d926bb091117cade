"""Iterative bottleneck alleviation (Aceso, EuroSys'24 §4; SPEC §4), deterministic and with exact refinements.

For every candidate number of stages S (independent searches, optionally in worker processes, each with its own
fixed evaluation budget, merged in S order so the result never depends on the worker count or the CPU):

1. initial plans: GPUs split as evenly as the valid stage sizes allow, each stage at its best TP/DP shape, units
   balanced *by cost* (``primitives.balanced_bounds``), for every micro-batch size; the best one is the start.
2. trial: a depth-first multi-hop search from the current plan. At each hop the bottleneck of the current
   (intermediate) plan is found, the primitives are ordered by the relief they bring (``bottleneck``), every
   resulting unvisited state is evaluated, the first one better than the best so far ends the chain (accepted
   move), otherwise the search descends into the ``branch`` most promising children (worse plans allowed), up to
   ``max_hops`` primitives. The first hop is tried on each of the slowest stages in turn.
3. no improving chain: restart from the best unexplored plan seen (within 1.2x of the best, Aceso's
   ``continue_when_fail``), until none is left or the budget is spent.

Then the best plans are polished exactly: for their stage shapes and micro-batch, ``partition.best_partition``
finds the optimal contiguous cut with per-stage optimal recompute; it is kept when it is better. Stages' recompute
is always exact (``recompute``). Budget: plan evaluations (``Budget``); Ctrl-C returns the best plan so far.
"""

from __future__ import annotations

import heapq
import multiprocessing as mp
import random
import time
from dataclasses import dataclass, field

import numpy as np

from .bottleneck import classify, find_bottleneck, order_primitives
from .partition import Spans, best_partition
from .primitives import APPLY, Ctx, balanced_bounds
from .recompute import allowed_codes, has_unit_tables, refine_by_counts, refine_by_local_search
from .state import INF, Budget, BudgetExhausted, Evaluation, Evaluator, Space, StageEval, State


@dataclass
class SearchOptions:
    budget_evals: int = 3000           # plan evaluations, over all stage counts
    budget_s: float | None = None      # optional wall-clock cap (makes results machine-dependent when it binds)
    max_hops: int = 5
    branch: int = 2
    seed: int = 0                      # 0: primitives in the reference's order; else shuffled within groups
    workers: int = 1
    stage_counts: list[int] | None = None
    seeds: list = field(default_factory=list)   # extra starting states (e.g. the uniform baseline)
    polish_top: int = 3
    polish_max_spans: int = 3000
    callback: object = None            # called with the number of evaluations done (may raise KeyboardInterrupt)


@dataclass
class Move:
    primitive: list[str]
    bottleneck: int
    resource: str
    before_ms: float
    after_ms: float
    num_stages: int
    memory_before_mb: float = 0.0
    memory_after_mb: float = 0.0
    fits_before: bool = True
    fits_after: bool = True

    def as_dict(self) -> dict:
        def num(x):
            return round(x, 6) if x != INF else None
        return {"num_stages": self.num_stages, "primitives": self.primitive, "bottleneck_stage": self.bottleneck,
                "bottleneck_resource": self.resource, "time_before_ms": num(self.before_ms),
                "time_after_ms": num(self.after_ms), "max_memory_before_mb": num(self.memory_before_mb),
                "max_memory_after_mb": num(self.memory_after_mb), "fits_before": self.fits_before,
                "fits_after": self.fits_after}


@dataclass
class StageCountResult:
    num_stages: int
    best: list[Evaluation] = field(default_factory=list)   # a few best distinct plans
    moves: list[Move] = field(default_factory=list)
    evals: int = 0
    interrupted: bool = False


def stage_counts(space: Space, opts: SearchOptions) -> list[int]:
    if opts.stage_counts:
        return sorted(set(opts.stage_counts))
    top = min(space.num_gpus, space.num_units, 64)
    counts = {s for s in range(1, top + 1) if s <= 16 or space.num_gpus % s == 0}
    counts.update(s.num_stages for s in opts.seeds)
    return sorted(counts)


def initial_states(ctx: Ctx, S: int) -> list[State]:
    """Balanced starting plans for S stages (one per micro-batch size and TP/DP preference)."""
    sp = ctx.space
    valid = sp.valid_counts()
    g0 = max((g for g in valid if g * S <= sp.num_gpus), default=None)
    if g0 is None:
        return []
    counts, rest = [g0] * S, sp.num_gpus - g0 * S
    progress = True
    while rest and progress:  # grow stages to the next valid size, last stages first, round robin
        progress = False
        for i in reversed(range(S)):
            nxt = [g for g in valid if g > counts[i] and g - counts[i] <= rest]
            if nxt:
                rest -= nxt[0] - counts[i]
                counts[i] = nxt[0]
                progress = True
            if not rest:
                break
    if rest:
        return []
    out = []
    for mbs in sp.mbs_list:
        for prefer_tp in (True, False):
            shapes = []
            for g in counts:
                opts = sp.shapes(g, mbs)
                if not opts:
                    break
                shapes.append(max(opts) if prefer_tp else min(opts))
            if len(shapes) != S:
                continue
            bounds = balanced_bounds(ctx, shapes, mbs, sp.num_units)
            if bounds is None:
                continue
            s = State(mbs, tuple(shapes), bounds)
            if sp.legal(s) and s not in out:
                out.append(s)
    return out


class StageCountSearch:
    """The Aceso loop for one number of stages."""

    def __init__(self, cm, gbs: int, space: Space, S: int, budget: Budget, opts: SearchOptions):
        self.ev = Evaluator(cm, gbs, budget)
        self.ctx = Ctx(space, self.ev)
        self.S, self.opts, self.limit = S, opts, self.ev.limit
        self.result = StageCountResult(S)
        self.best: Evaluation | None = None
        self.visited: set[State] = set()
        self.unexplored: list = []   # promising plans (within 1.2x of the best), best first
        self.seen: list = []         # every evaluated plan, best first (adaptive restarts)
        self.counter = 0
        self._root: tuple[Evaluation, int] | None = None
        self.rng = random.Random(opts.seed * 1_000_003 + S) if opts.seed else None

    def _push(self, e: Evaluation) -> None:
        if e.fits and self.best is not None and self.best.fits and e.iteration_ms < 1.2 * self.best.iteration_ms:
            self.counter += 1
            heapq.heappush(self.unexplored, (e.score, self.counter, e.state))

    def _evaluate(self, st: State) -> Evaluation:
        e = self.ev.evaluate(st)
        heapq.heappush(self.seen, (e.score, st))
        return e

    def _better(self, e: Evaluation) -> bool:
        return self.best is None or e.score < self.best.score

    def run(self) -> StageCountResult:
        try:
            init = initial_states(self.ctx, self.S)
            init += [s for s in self.opts.seeds if s.num_stages == self.S and s not in init
                     and self.ctx.space.legal(s)]
            starts = [self._evaluate(s) for s in init]
            if not starts:
                return self.result
            starts.sort(key=lambda e: e.score)
            self.best = starts[0]
            for e in starts:
                self.visited.add(e.state)
                self._push(e)
            current, used = self.best, set()
            while True:
                used.add(current.state)
                found = self._trial(current)
                if found is not None:
                    current = found
                    continue
                nxt = None
                while self.unexplored:
                    _, _, st = heapq.heappop(self.unexplored)
                    if st not in used:
                        nxt = st
                        break
                while nxt is None and self.seen:  # adaptive mode: the best evaluated plan not yet a start
                    _, st = heapq.heappop(self.seen)
                    if st not in used:
                        nxt = st
                if nxt is None:
                    break
                current = self.ev.evaluate(nxt)
        except BudgetExhausted:
            pass
        except KeyboardInterrupt:
            self.result.interrupted = True
        self.result.evals = self.ev.budget.used if self.ev.budget else self.ev.num_evaluated
        self.result.best = self._top()
        return self.result

    def _top(self, k: int = 3) -> list[Evaluation]:
        return self.ev.evaluations()[:k]

    def _trial(self, current: Evaluation) -> Evaluation | None:
        order = sorted(range(self.S), key=lambda i: (-current.stage_total_ms[i], i))
        b0 = find_bottleneck([s.cost for s in current.stages], current.stage_total_ms, self.limit)
        targets = [b0] + [i for i in order if i != b0]
        for b in targets[: max(1, min(self.S, 3))]:
            self._root = (current, b)
            found = self._hop(current, 0, b, [])
            if found is not None:
                return found
        return None

    def _hop(self, e: Evaluation, hop: int, b: int | None, chain: list[str]) -> Evaluation | None:
        if hop >= self.opts.max_hops:
            return None
        costs = [s.cost for s in e.stages]
        if b is None:
            b = find_bottleneck(costs, e.stage_total_ms, self.limit)
        for group in order_primitives(costs, b, self.limit):
            if self.rng is not None:  # seed 0: the reference's table order; other seeds: shuffled within groups
                self.rng.shuffle(group)
            children = []
            for name in group:
                for st in APPLY[name](self.ctx, e, b):
                    if st in self.visited:
                        continue
                    self.visited.add(st)
                    c = self._evaluate(st)
                    if self._better(c):
                        self._accept(c, chain + [name])
                        return c
                    self._push(c)
                    children.append((c.score, len(children), c, name))
            children.sort(key=lambda x: (x[0], x[1]))
            for _, _, c, name in children[: self.opts.branch]:
                found = self._hop(c, hop + 1, None, chain + [name])
                if found is not None:
                    return found
        return None

    def _accept(self, new: Evaluation, chain: list[str]) -> None:
        start, b = self._root  # the plan the chain started from and the bottleneck its first primitive targeted
        res = classify([s.cost for s in start.stages], b, self.limit)
        old = self.best if self.best is not None else start
        self.result.moves.append(Move(chain, b, res, old.raw_iteration_ms, new.raw_iteration_ms, self.S,
                                      old.max_memory_mb, new.max_memory_mb, old.fits, new.fits))
        self.best = new


def refine_recompute(ev: Evaluator, e: Evaluation) -> Evaluation:
    """Refine every stage's recompute with the cost model itself (op-level models): exact over per-kind choice
    counts where they are few, then hill-climbing over single-unit changes; a new evaluation."""
    st, S = e.state, e.state.num_stages
    stages = []
    for i, r in enumerate(st.first_ranks()):
        tp, dp = st.shapes[i]
        kw = {"prev": st.shapes[i - 1] if i else None, "next": st.shapes[i + 1] if i < S - 1 else None} \
            if ev.neighbours else {}

        a, b = st.bounds[i], st.bounds[i + 1]

        def cost(rc, i=i, r=r, a=a, b=b, tp=tp, dp=dp, kw=kw):
            return ev.cm.stage_cost(i, S, r, a, b, tp, dp, rc, st.mbs, **kw)
        allowed = allowed_codes(ev.cm.model, a, b)
        kinds = [(u.stack, u.kind) for u in ev.cm.model.units[a:b]]
        rc, c = refine_by_counts(cost, e.stages[i].rc, e.stages[i].cost, kinds, allowed)
        rc, c = refine_by_local_search(cost, rc, c, allowed)
        stages.append(StageEval(c, rc))
    pipe = ev.cm.pipeline([s.cost for s in stages], ev.gbs // st.mbs)
    new = Evaluation(st, pipe.iteration_ms, True, stages, list(pipe.stage_total_ms),
                     max(s.cost.memory_mb for s in stages), pipe.iteration_ms)
    return new if new.iteration_ms < e.iteration_ms else e


def polish(ev: Evaluator, space: Space, e: Evaluation, max_spans: int) -> Evaluation:
    """Exact partition DP over the units for e's stage shapes and micro-batch (boundaries within a window)."""
    st = e.state
    S, U = st.num_stages, space.num_units
    if S == 1:
        return e
    M = ev.gbs // st.mbs
    firsts = st.first_ranks()
    w = U
    while w > 1 and S * (2 * w + 1) ** 2 > max_spans:
        w //= 2
    lo = [max(0, x - w) for x in st.bounds]
    hi = [min(U, x + w) for x in st.bounds]
    stages = []
    for i, (tp, dp) in enumerate(st.shapes):
        A, B, T, AA = [], [], [], []
        for a in range(lo[i], hi[i] + 1):
            if i == 0 and a != 0:
                continue
            for b in range(max(a + 1, lo[i + 1]), hi[i + 1] + 1):
                if i == S - 1 and b != U:
                    continue
                c = ev.stage(i, S, firsts[i], a, b, tp, dp, st.mbs, st.shapes[i - 1] if i else None,
                             st.shapes[i + 1] if i < S - 1 else None).cost
                t = c.time_per_microbatch_ms if c.fits else INF
                A.append(a), B.append(b), T.append(t)
                AA.append((M - 1) * t + c.dp_sync_ms + c.optimizer_ms if np.isfinite(t) else INF)
        stages.append(Spans(np.array(A, int), np.array(B, int), np.array(T), np.array(AA)))
    _val, bounds = best_partition(U, stages)
    if bounds is None:
        return e
    cand = ev.evaluate(State(st.mbs, st.shapes, tuple(bounds)), charge=False)
    return cand if cand.score < e.score else e


# ----- orchestration ------------------------------------------------------------------------------------------
_JOB: dict = {}


def _ignore_sigint() -> None:  # workers: Ctrl-C is the parent's to handle; they die with it
    import signal
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)   # pool.terminate(): no handler inherited from the parent
    die_with_parent()


def die_with_parent() -> None:
    """SIGKILL this process when its parent dies (Linux ``PR_SET_PDEATHSIG``; elsewhere a thread polls
    ``getppid``): a search killed by SIGTERM or SIGKILL leaves no workers behind."""
    import os
    import signal
    parent = os.getppid()
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(1, signal.SIGKILL, 0, 0, 0) == 0:    # PR_SET_PDEATHSIG = 1
            if os.getppid() != parent:                     # the parent died before the call
                os._exit(1)
            return
    except (OSError, AttributeError):
        pass
    import threading

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)
    threading.Thread(target=watch, daemon=True).start()


def _run_one(S: int) -> StageCountResult:
    j = _JOB
    per = j["per_count"]
    budget = Budget(per, j["opts"].budget_s, None)
    return StageCountSearch(j["cm"], j["gbs"], j["space"], S, budget, j["opts"]).run()


@dataclass
class SearchResult:
    plans: list[Evaluation]            # best first, distinct
    moves: list[Move]
    evals: int
    seconds: float
    interrupted: bool
    per_count: dict[int, float]        # best time per number of stages
    polished: int = 0


def search(cm, gbs: int, space: Space, opts: SearchOptions, top_k: int = 1) -> SearchResult:
    """Run the whole search; returns the best plans found (possibly none fits: check ``plans[0].fits``)."""
    t0 = time.monotonic()
    probe = Ctx(space, Evaluator(cm, gbs, None))  # stage counts without any starting plan get no budget
    seeded = {s.num_stages for s in opts.seeds}
    counts = [S for S in stage_counts(space, opts) if S in seeded or initial_states(probe, S)] or [1]
    per = max(opts.budget_evals // len(counts), 20)
    results: list[StageCountResult] = []
    interrupted = False
    done = 0
    if opts.workers > 1 and len(counts) > 1:
        _JOB.update(cm=cm, gbs=gbs, space=space, opts=opts, per_count=per)
        pool = mp.get_context("fork").Pool(min(opts.workers, len(counts)), initializer=_ignore_sigint)
        try:
            for r in pool.imap(_run_one, counts):
                results.append(r)
                done += r.evals
                if opts.callback:
                    opts.callback(done)
            pool.close()
        except KeyboardInterrupt:
            interrupted = True
            pool.terminate()
        finally:
            pool.join()
            _JOB.clear()
    else:
        for S in counts:
            base = done

            def cb(n, base=base):
                if opts.callback:
                    opts.callback(base + n)
            budget = Budget(per, None if opts.budget_s is None else max(opts.budget_s - (time.monotonic() - t0), 0),
                            cb)
            r = StageCountSearch(cm, gbs, space, S, budget, opts).run()
            results.append(r)
            done += r.evals
            if r.interrupted:
                interrupted = True
                break
    return _finish(cm, gbs, space, opts, results, top_k, t0, interrupted)


def _finish(cm, gbs, space, opts, results, top_k, t0, interrupted) -> SearchResult:
    cands = [e for r in results for e in r.best]
    if interrupted and opts.seeds:  # stage counts that never ran: at least the seeds (the uniform baseline)
        ev0 = Evaluator(cm, gbs, None)
        cands += [ev0.evaluate(s, charge=False) for s in opts.seeds if space.legal(s)]
    cands.sort(key=lambda e: (e.score, e.state))
    polished = 0
    if not interrupted:
        ev = Evaluator(cm, gbs, None)
        out = []
        op_level = not has_unit_tables(cm)
        for e in cands[: max(opts.polish_top, top_k)]:
            fresh = ev.evaluate(e.state, charge=False)
            p = polish(ev, space, fresh, opts.polish_max_spans) if fresh.fits else fresh
            if op_level and p.fits:
                p = refine_recompute(ev, p)
            polished += p is not fresh
            out.append(p)
        cands = out + cands[max(opts.polish_top, top_k):]
        cands.sort(key=lambda e: (e.score, e.state))
    seen, plans = set(), []
    for e in cands:
        if e.state not in seen:
            seen.add(e.state)
            plans.append(e)
    per_count = {r.num_stages: (r.best[0].iteration_ms if r.best else INF) for r in results}
    return SearchResult(plans[:max(top_k, 1)], [m for r in results for m in r.moves],
                        sum(r.evals for r in results), time.monotonic() - t0, interrupted, per_count, polished)
