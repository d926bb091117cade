"""1F1B pipeline time with warm-up and cool-down, for stages of unequal forward and backward times.

Stage k (of p) runs M micro-batches; ``F_k`` = forward (+ the forward p2p), ``B_k`` = backward (+ recompute + the
backward p2p), per micro-batch. Under 1F1B (Narayanan et al., SC'21, section 2.2; PipeDream-Flush) stage k does
``p-k-1`` warm-up forwards, then alternates one forward and one backward, then drains the remaining backwards.

Critical path through stage k (each term is a dependency the schedule cannot overlap):

    start_k   = sum_{j<k} F_j                             first micro-batch reaches stage k
    busy_k    = M (F_k + B_k)                             stage k's own work
    warm_k    = max(0, R_k - (p-k-1) F_k)                 waiting for micro-batch 0 to come back from downstream,
                                                          R_k = sum_{j>k} (F_j + B_j); meanwhile k did its
                                                          p-k-1 warm-up forwards
    cool_k    = max(0, R_k - (p-k-1) B_k)                 waiting for the last micro-batch to come back, while k
                                                          drains its p-k-1 pending backwards
    end_k     = start_k + busy_k + warm_k + cool_k
    done_k    = max(end_k, done_{k+1} + B_k)              stage k's last backward follows stage k+1's

Each stage then runs its DP gradient synchronisation and optimizer step, so stage k's total is
``done_k + sync_k`` and the iteration is the largest total. ``stage_total_ms[k]`` reports the critical path
through stage k, ``end_k + sum_{j<k} B_j + sync_k`` (the reference model's per-stage number), and the bottleneck
is the stage with the largest one. For identical stages this is (M + p - 1)(F + B) + sync,
the textbook bubble of (p-1)(F+B) (Narayanan et al. 2021, eq. 1). It is checked against an event-driven 1F1B
simulation in the tests: exact for identical stages, a lower bound within about 5% for strongly unequal ones.
With fewer micro-batches than stages (M < p) the warm-up never reaches steady state and the closed form does not
hold; then the schedule is simulated event by event (cheap: at most p*M events). ``bubble_ms`` = iteration - (busy + sync) of the slowest stage.
"""

from __future__ import annotations

from .types import Event, PipelineCost


def one_f_one_b(fwd: list[float], bwd: list[float], sync: list[float], num_micro_batches: int) -> PipelineCost:
    """Iteration time of 1F1B; ``fwd[k]``, ``bwd[k]`` per micro-batch, ``sync[k]`` once per iteration."""
    p, m = len(fwd), num_micro_batches
    if m < p:
        return _simulated(fwd, bwd, sync, m)
    own = [0.0] * p                            # busy_k + warm_k + cool_k
    r = 0.0                                    # R_k = sum_{j>k} (F_j + B_j)
    for k in range(p - 1, -1, -1):
        f, b = fwd[k], bwd[k]
        w = p - k - 1                          # warm-up forwards (m >= p here)
        warm, cool = r - w * f, r - w * b
        own[k] = m * (f + b) + (warm if warm > 0.0 else 0.0) + (cool if cool > 0.0 else 0.0)
        r += f + b
    ends, through = [0.0] * p, [0.0] * p
    best, bott = -1.0, 0
    start = up = 0.0                           # sum_{j<k} F_j and sum_{j<k} B_j
    for k in range(p):
        ends[k] = start + own[k]
        through[k] = ends[k] + up + sync[k]    # the critical path through stage k
        if through[k] > best:
            best, bott = through[k], k
        start += fwd[k]
        up += bwd[k]
    it = best
    done = ends[p - 1]                         # stage k's last backward follows stage k+1's
    for k in range(p - 1, -1, -1):
        if k < p - 1 and done + bwd[k] > ends[k]:
            done += bwd[k]
        elif k < p - 1:
            done = ends[k]
        if done + sync[k] > it:
            it = done + sync[k]
    work = m * (fwd[bott] + bwd[bott]) + sync[bott]
    return PipelineCost(iteration_ms=it, stage_total_ms=through, bottleneck=bott, bubble_ms=max(0.0, it - work))


def _order(k: int, p: int, m: int) -> list[tuple[bool, int]]:
    """Stage k's 1F1B op order: (is_forward, micro-batch)."""
    w = min(p - k - 1, m)
    ops = [(True, i) for i in range(w)]
    f = w
    for b in range(m):
        if f < m:
            ops.append((True, f))
            f += 1
        ops.append((False, b))
    return ops


def simulate(orders: list[list[tuple[bool, int, int]]], fwd: list[list[float]], bwd: list[list[float]],
             sync: list[float]) -> tuple[list[float], list[Event]]:
    """Event simulation of a pipeline schedule: per-stage totals and the event list (``types.Event``).

    ``orders[s]``: stage s's ops ``(is_forward, chunk, micro-batch)``; ``fwd[s][c]``/``bwd[s][c]``: the op times
    of chunk c (model chunk ``c p + s``). A forward waits for the previous model chunk's forward of the same
    micro-batch, a backward for the next model chunk's backward (the last chunk: its own forward), every op for
    the stage's previous op. The stage's DP sync + optimizer step follows its last op.
    """
    p = len(orders)
    last = p * len(fwd[0]) - 1
    f_end: dict[tuple[int, int], float] = {}   # (model chunk, micro-batch) -> end time
    b_end: dict[tuple[int, int], float] = {}
    clock, pos = [0.0] * p, [0] * p
    events: list[Event] = []
    moved = True
    while moved:
        moved = False
        for s in range(p):
            order = orders[s]
            while pos[s] < len(order):
                is_f, c, i = order[pos[s]]
                k = c * p + s
                if is_f:
                    dep = 0.0 if k == 0 else f_end.get((k - 1, i))
                else:
                    dep = f_end.get((k, i)) if k == last else b_end.get((k + 1, i))
                if dep is None:
                    break
                start = max(clock[s], dep)
                end = start + (fwd[s][c] if is_f else bwd[s][c])
                (f_end if is_f else b_end)[(k, i)] = end
                events.append(Event(s, c, i, "forward" if is_f else "backward", start, end))
                clock[s] = end
                pos[s] += 1
                moved = True
    if any(pos[s] < len(orders[s]) for s in range(p)):
        raise ValueError("pipeline schedule deadlocked; check num_micro_batches against the stages")
    for s in range(p):
        if sync[s] > 0:
            events.append(Event(s, -1, -1, "sync", clock[s], clock[s] + sync[s]))
    return [clock[s] + sync[s] for s in range(p)], events


def one_f_one_b_events(fwd: list[float], bwd: list[float], sync: list[float], m: int) -> list[Event]:
    """The 1F1B schedule's events (``simulate`` over each stage's 1F1B op order)."""
    p = len(fwd)
    orders = [[(f, 0, i) for f, i in _order(k, p, m)] for k in range(p)]
    return simulate(orders, [[x] for x in fwd], [[x] for x in bwd], sync)[1]


def _simulated(fwd: list[float], bwd: list[float], sync: list[float], m: int) -> PipelineCost:
    p = len(fwd)
    orders = [[(f, 0, i) for f, i in _order(k, p, m)] for k in range(p)]
    totals, _ = simulate(orders, [[x] for x in fwd], [[x] for x in bwd], sync)
    it = max(totals)
    bott = _busiest(fwd, bwd, sync, m)
    work = m * (fwd[bott] + bwd[bott]) + sync[bott]
    return PipelineCost(iteration_ms=it, stage_total_ms=totals, bottleneck=bott, bubble_ms=max(0.0, it - work))


def _busiest(fwd: list[float], bwd: list[float], sync: list[float], m: int) -> int:
    """The stage with the most own work."""
    works = [m * (fwd[k] + bwd[k]) + sync[k] for k in range(len(fwd))]
    return works.index(max(works))


def _interleaved_order(s: int, p: int, v: int, m: int) -> list[tuple[bool, int, int]]:
    """Rank s's op order under megatron-core's interleaved 1F1B: (is_forward, chunk, micro-batch).

    Forward ``k`` runs chunk ``(k // p) % v`` on micro-batch ``(k // (p v)) p + k % p``; backward ``k`` the same
    micro-batch on chunk ``v - 1 - (k // p) % v``. Warm-up forwards, then one forward and one backward, then the
    remaining backwards (``memory.interleaved_warmup``).
    """
    from .memory import interleaved_warmup
    total = m * v
    w = interleaved_warmup(s, p, v, m)

    def op(k: int, fwd: bool) -> tuple[bool, int, int]:
        c = (k // p) % v
        return fwd, (c if fwd else v - 1 - c), (k // (p * v)) * p + k % p
    ops = [op(k, True) for k in range(w)]
    for k in range(total - w):
        ops.append(op(w + k, True))
        ops.append(op(k, False))
    ops += [op(k, False) for k in range(total - w, total)]
    return ops


def interleaved_one_f_one_b(fwd: list[list[float]], bwd: list[list[float]], sync: list[float],
                            num_micro_batches: int, events: list | None = None) -> PipelineCost:
    """Interleaved 1F1B (Narayanan et al., SC'21, section 2.2.2) by event simulation of megatron-core's op order.

    ``fwd[s][j]``/``bwd[s][j]``: chunk j of stage s per micro-batch (model chunk ``j p + s``); dependencies as in
    ``simulate``. For identical chunks it gives ``(M v + p - 1)(f + b)``: the 1F1B bubble divided by v.
    ``events``: a list to extend with the schedule's events.
    """
    p, v, m = len(fwd), len(fwd[0]), num_micro_batches
    orders = [_interleaved_order(s, p, v, m) for s in range(p)]
    totals, evs = simulate(orders, fwd, bwd, sync)
    if events is not None:
        events.extend(evs)
    it = max(totals)
    works = [m * (sum(fwd[s]) + sum(bwd[s])) + sync[s] for s in range(p)]
    bott = works.index(max(works))
    return PipelineCost(iteration_ms=it, stage_total_ms=totals, bottleneck=bott,
                        bubble_ms=max(0.0, it - works[bott]), num_chunks=v)
