"""Iterative bottleneck alleviation (Aceso, EuroSys'24 §4; SPEC §4), deterministic and with exact refinements.

For every candidate number of stages S (independent searches, optionally in worker processes, each with its own
fixed evaluation budget, merged in S order so the result never depends on the worker count or the CPU):

1. initial plans: GPUs split as evenly as the valid stage sizes allow (``Space.gpu_splits``), each stage at its
   largest or smallest TP, units balanced *by cost* (``primitives.balanced_bounds``), every legal pipeline
   micro-batch, the preferred plan-level features; plus the seeds (the uniform baseline, the Megatron-LM plan).
2. trial: a depth-first multi-hop search from the current plan. At each hop the bottleneck of the current
   (intermediate) plan is found, the primitives are ordered by the relief they bring (``bottleneck``), every
   resulting unvisited state is evaluated, the first one better than the best so far ends the chain (accepted
   move), otherwise the search descends into the ``branch`` most promising children (worse plans allowed), up to
   ``max_hops`` primitives. The first hop is tried on each of the slowest stages in turn.
3. no improving chain: restart from the best unexplored plan seen (within 1.2x of the best, Aceso's
   ``continue_when_fail``), until none is left or the budget is spent.

Then the best plans are polished exactly (``polish``): optimal contiguous cuts for their shapes, chunk-boundary
hill climbing for interleaved plans, every combination of the plan-level switches, and (MoE) every token
dispatcher (``dispatchers``: the plan-wide setting, priced on the polished plans): the best few final candidates
and every plan that was among them at a smaller budget (``candidates_over_time``). Budget: plan evaluations
(``Budget``); a larger budget retraces a smaller one's steps first, so it polishes every plan a smaller one did and
more budget never returns a slower plan from one search (docs/search.md "More budget"). Ctrl-C returns the best
plan so far.
"""

from __future__ import annotations

import heapq
import multiprocessing as mp
import random
import time
from dataclasses import dataclass, field

from .bottleneck import EXPERT_PRIMITIVES, classify, find_bottleneck, order_primitives
from .dispatchers import Dispatchers
from .megatron_lm import expressible
from .polish import polish, polish_chunks, polish_features, refine_recompute
from .primitives import APPLY, Ctx, balanced_bounds
from .recompute import has_unit_tables
from .space import Space
from .state import INF, Budget, BudgetExhausted, Evaluation, Evaluator, State


MIN_PER_COUNT = 20      # evaluations every stage count gets, whatever the budget


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
    polish_top: int = 3                # plans that get the exact cuts (at least top_k)
    polish_max_spans: int = 3000
    callback: object = None            # called with the number of evaluations done (may raise KeyboardInterrupt)
    shared_overlap: bool = True        # the final step may choose the shared-expert overlap (settle.py: False)
    offload: bool = True               # the final step may choose the fine-grained offload (settle.py: its own round)


@dataclass
class Move:
    """One accepted chain of primitives (``--trace``)."""

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
    evals: int = 0                       # evaluations of this stage count's search at acceptance
    bottleneck_memory_before_mb: float = 0.0
    bottleneck_memory_after_mb: float = 0.0

    def as_dict(self) -> dict:
        def num(x):
            return round(x, 6) if x != INF else None
        return {"num_stages": self.num_stages, "primitives": self.primitive, "bottleneck_stage": self.bottleneck,
                "bottleneck_resource": self.resource, "time_before_ms": num(self.before_ms),
                "time_after_ms": num(self.after_ms), "max_memory_before_mib": num(self.memory_before_mb),
                "max_memory_after_mib": num(self.memory_after_mb), "fits_before": self.fits_before,
                "fits_after": self.fits_after, "evaluations": self.evals,
                "bottleneck_memory_before_mib": num(self.bottleneck_memory_before_mb),
                "bottleneck_memory_after_mib": num(self.bottleneck_memory_after_mb)}


@dataclass
class StageCountResult:
    num_stages: int
    best: list[Evaluation] = field(default_factory=list)   # a few best distinct plans
    top_events: list = field(default_factory=list)  # (charged evaluations, its three best then) at each change
    moves: list[Move] = field(default_factory=list)
    evals: int = 0
    interrupted: bool = False


def stage_counts(space: Space, opts: SearchOptions) -> list[int]:
    if opts.stage_counts:
        return sorted(set(opts.stage_counts))
    top = min(space.num_gpus, len(space.layer_starts) - 1 if space.layer_starts else space.num_units, 64) \
        if space.target == "megatron-lm" else min(space.num_gpus, space.num_units, 64)
    counts = {s for s in range(1, top + 1) if s <= 16 or space.num_gpus % s == 0}
    counts.update(s.num_stages for s in opts.seeds)
    if space.target == "megatron-lm":
        counts = {s for s in counts if space.num_gpus % s == 0}
    if space.max_stages:
        counts = {s for s in counts if s <= space.max_stages}
    if space.pps is not None:
        counts &= space.pps
    return sorted(counts)


def initial_states(ctx: Ctx, S: int) -> list[State]:
    """Balanced starting plans for S stages: per GPU split, context-parallel degree and TP preference (largest,
    smallest), every legal pipeline micro-batch, the fewest model chunks allowed."""
    sp = ctx.space
    v = sp.vs[0]              # the fewest chunks allowed (1 unless the user excludes it)
    if v > 1 and S < 2:
        return []
    splits = sp.gpu_splits(S)
    if sp.target == "megatron-lm":
        splits = [c for c in splits if len(set(c)) == 1]
    out = []
    for counts in splits:
        for cp in sp.cps:
            for prefer_tp in (True, False):
                shapes = []
                for g in counts:
                    opts = sp.stage_shapes(g, cp, every_sp=False)
                    if not opts:
                        break
                    shapes.append(max(opts) if prefer_tp else min(opts))
                if len(shapes) != S:
                    continue
                for mbs in sp.legal_mbs(shapes):
                    _add_start(ctx, out, shapes, mbs, v)
            for mbs in _pipeline_batches(sp, counts, cp):   # per micro-batch: the largest / smallest TP legal at it
                for prefer_tp in (True, False):
                    shapes = []
                    for g in counts:
                        opts = sp.shapes(g, mbs, cp)
                        if not opts:
                            break
                        shapes.append(max(opts) if prefer_tp else min(opts))
                    if len(shapes) == S and sp.mbs_ok(shapes, mbs):
                        _add_start(ctx, out, shapes, mbs, v)
    return out


def _pipeline_batches(sp: Space, counts, cp: int) -> list[int]:
    """The pipeline micro-batches some stage shape of these GPU counts runs at a candidate per-rank batch."""
    ms = {b * s.dp for g in set(counts) for s in sp.stage_shapes(g, cp, every_sp=False) for b in sp.batches}
    return sorted(m for m in ms if not sp.gbs or sp.gbs % m == 0)


def _add_start(ctx: Ctx, out: list, shapes, mbs: int, v: int) -> None:
    sp = ctx.space
    bounds = balanced_bounds(ctx, shapes, mbs, sp.num_units, v)
    if bounds is None:
        return
    s = sp.normalize(State(mbs, tuple(shapes), bounds, sp.features[0]))
    if sp.legal(s) and s not in out:
        out.append(s)


class StageCountSearch:
    """The Aceso loop for one number of stages."""

    def __init__(self, cm, gbs: int, space: Space, S: int, budget: Budget, opts: SearchOptions):
        self.ev = Evaluator(cm, gbs, budget, space.evaluator_target, space.moe)
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
        self._top3 = TopThree(self.result.top_events, lambda: self.ev.budget.used if self.ev.budget else 0)
        self.ev.on_plan = self._top3.see

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

    def _set_best(self, e: Evaluation) -> None:
        self.best = e
        self.ev.cutoff = e.iteration_ms if e.fits else INF   # interleaved states above it are only estimated

    def run(self) -> StageCountResult:
        try:
            init = initial_states(self.ctx, self.S)
            sp = self.ctx.space
            init += [s for s in map(sp.start_of, self.opts.seeds) if s.num_stages == self.S and s not in init
                     and sp.legal(s)]
            starts = []
            for s in init:   # the best start so far is the cutoff: the others need an exact pipeline only if better
                e = self._evaluate(s)
                starts.append(e)
                if e.fits and e.exact and e.iteration_ms < self.ev.cutoff:
                    self.ev.cutoff = e.iteration_ms
            if not starts:
                return self.result
            starts.sort(key=lambda e: e.score)
            self._set_best(starts[0])
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
                current = self.ev.evaluate(nxt, exact=True)
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
        for group in order_primitives(costs, b, self.limit, self._bubble(e)):
            if self.ctx.space.experts is None:   # a dense model: no expert moves (and seeded shuffles unchanged)
                group = [p for p in group if p not in EXPERT_PRIMITIVES]
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

    def _bubble(self, e: Evaluation) -> float:
        """The share of e's iteration that is pipeline bubble (0 where the space has no virtual stages)."""
        if len(self.ctx.space.vs) < 2 or not e.fits or not e.raw_iteration_ms > 0:
            return 0.0
        return e.bubble_ms / e.raw_iteration_ms

    def _accept(self, new: Evaluation, chain: list[str]) -> None:
        start, b = self._root  # the plan the chain started from and the bottleneck its first primitive targeted
        res = classify([s.cost for s in start.stages], b, self.limit, self._bubble(start))
        old = self.best if self.best is not None else start
        nb = find_bottleneck([s.cost for s in new.stages], new.stage_total_ms, self.limit)
        used = self.ev.budget.used if self.ev.budget else self.ev.num_evaluated
        self.result.moves.append(Move(chain, b, res, old.raw_iteration_ms, new.raw_iteration_ms, self.S,
                                      old.max_memory_mb, new.max_memory_mb, old.fits, new.fits, used,
                                      start.stages[b].cost.memory_mb, new.stages[nb].cost.memory_mb))
        self._set_best(new)


class TopThree:
    """A stage count's three best plans as its search goes (``Evaluator.evaluations()[:3]`` at every moment), written
    to ``events`` as ``(charged evaluations, (best, second, third))`` each time they change."""

    def __init__(self, events: list, used):
        self.events, self.used = events, used
        self.latest: dict[State, Evaluation] = {}
        self.top: tuple = ()

    def see(self, e: Evaluation) -> None:
        known = e.state in self.latest
        self.latest[e.state] = e
        if len(self.top) == 3 and e.rank >= self.top[-1].rank and \
                not (known and any(x.state == e.state for x in self.top)):
            return                     # behind the third, and not one of the three re-priced: nothing changes
        top = tuple(heapq.nsmallest(3, self.latest.values(), key=lambda x: x.rank))
        if [id(x) for x in top] != [id(x) for x in self.top]:
            self.top = top
            self.events.append((self.used(), top))


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
    probe = Ctx(space, Evaluator(cm, gbs, None, space.evaluator_target, space.moe))  # stage counts without a start get no budget
    seeded = {s.num_stages for s in opts.seeds if space.legal(space.start_of(s))}
    counts = [S for S in stage_counts(space, opts) if S in seeded or initial_states(probe, S)] or [1]
    per = max(opts.budget_evals // len(counts), MIN_PER_COUNT)
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


def _to_polish(results: list[StageCountResult], cands: list[Evaluation], opts: SearchOptions,
               top_k: int) -> list[Evaluation]:
    """The plans the final step polishes: the first ``max(polish_top, top_k)`` final candidates (each stage count's
    three best, best first), and every plan that was among them at any smaller budget (``candidates_over_time``).
    A larger budget retraces a smaller one's steps first (the search is deterministic, the budget only stops it),
    so each smaller budget's candidates can be read off this search's own history; polishing them too means more
    budget never returns a slower plan. Polishing only the final few lost a plan whose polish was the best when
    better unpolished plans pushed it out (DeepSeek-V3 FP8 on 32x8-h100, heterogeneous: 31025.6 ms at a
    300-evaluation budget, 32166.8 ms at 600: the switch and dispatcher polish cut that plan 25%, the others less)."""
    n = max(opts.polish_top, top_k)
    out, seen = [], set()
    for e in cands[:n] + candidates_over_time(results, n):
        if e.state not in seen:
            seen.add(e.state)
            out.append(e)
    return out


def candidates_over_time(results: list[StageCountResult], n: int) -> list[Evaluation]:
    """Every plan that was among the ``n`` best final candidates of a search stopped at a smaller budget: for each
    per-count budget ``t`` (``MIN_PER_COUNT`` up to this one) each stage count's three best after ``t`` charged
    evaluations (``top_events``), merged, the first ``n``."""
    events = sorted({MIN_PER_COUNT} | {t for r in results for t, _ in r.top_events})
    current: dict[int, tuple] = {}
    pending = {r.num_stages: list(r.top_events) for r in results}
    out, seen = [], set()
    for t in events:
        for S, evs in pending.items():
            while evs and evs[0][0] <= t:
                current[S] = evs.pop(0)[1]
        if t < MIN_PER_COUNT:
            continue
        for e in sorted((e for top in current.values() for e in top), key=lambda e: e.rank)[:n]:
            if e.state not in seen:
                seen.add(e.state)
                out.append(e)
    return out


def _finish(cm, gbs, space, opts, results, top_k, t0, interrupted) -> SearchResult:
    ev = Evaluator(cm, gbs, None, space.evaluator_target, space.moe)
    cands = [e for r in results for e in r.best]
    # the seeds as given (the uniform baseline, a published plan) are always final candidates: the best seen is
    # kept even where a stage count's three best are plans the target's final check refuses, or stage counts never
    # ran (Ctrl-C, a --budget-s cap), so the search is never worse than a seed in its space
    seeded = [ev.evaluate(s, charge=False, exact=True) for s in opts.seeds if space.legal(space.start_of(s))]
    cands += seeded
    cands.sort(key=lambda e: e.rank)
    polished = 0
    if not interrupted:
        ctx = Ctx(space, ev)
        accept = (lambda _ev, c: expressible(ev, c)) if space.target == "megatron-lm" else None   # ev: runs_on
        disp = Dispatchers(cm, gbs, space.target, space.moe, accept,
                           stacks=[s.features.stack for s in opts.seeds if s.features.stack is not None],
                           shared_overlap=opts.shared_overlap, offload=opts.offload)
        out = []
        op_level = not has_unit_tables(cm) and space.target != "megatron-lm"   # one setting per plan there
        todo = _to_polish(results, cands, opts, top_k)
        todo += [e for e in seeded if e.state not in {x.state for x in todo}]
        for e in todo:
            fresh = ev.evaluate(e.state, charge=False, exact=True)
            p = fresh
            if p.fits:
                p = polish_features(ev, ctx, polish_chunks(ev, ctx, polish(ev, ctx, p, opts.polish_max_spans)))
                if op_level:
                    p = refine_recompute(ev, p)
            polished += p is not fresh
            out.append(disp.best(p))
        cands = out + cands
        cands.sort(key=lambda e: e.rank)
    seen, plans = set(), []
    for e in cands:
        if e.state not in seen:
            seen.add(e.state)
            e = e if e.exact else ev.evaluate(e.state, charge=False, exact=True)
            if space.target == "megatron-lm" and e.fits and not expressible(ev, e):
                continue   # the export's own check is the last word on what Megatron-LM runs
            plans.append(e)
        if len(plans) >= max(top_k, 1):
            break
    plans.sort(key=lambda e: e.rank)
    per_count = {r.num_stages: (r.best[0].iteration_ms if r.best else INF) for r in results}
    return SearchResult(plans, [m for r in results for m in r.moves],
                        sum(r.evals for r in results), time.monotonic() - t0, interrupted, per_count, polished)
