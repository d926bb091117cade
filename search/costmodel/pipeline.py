"""Pipeline schedules: exact iteration time and timeline of 1F1B and interleaved 1F1B for unequal stages.

Stage k (of p) runs M micro-batches; ``F_k``/``B_k`` = its forward / backward (+ recompute) per micro-batch, the
boundary p2p included. A forward waits for the previous model chunk's forward of the same micro-batch, a backward
for the next model chunk's backward (the last chunk: its own forward), and every op for the stage's previous op.
Each schedule is a fixed op order per stage, so every op's end time is ``max(previous op on the stage, its
dependency) + its duration``: a max-plus recurrence, computed exactly (no closed-form approximation). The timeline
(``types.Event``) comes from the same recurrence, so events and times always agree.

1F1B (Narayanan et al., SC'21, section 2.2; PipeDream-Flush): stage k does ``w_k = min(p-k-1, M)`` warm-up
forwards, then rounds ``j = 0..M-1`` of (forward ``w_k + j`` if any, backward ``j``), the rounds without a forward
being the cool-down. Per round, the forwards depend only on the previous round and the backwards form one upward
chain (stage p-1 first). For ``M >= p`` rounds ``1..M-p`` apply one and the same homogeneous max-plus map ``A``
(``A(x + c) = A(x) + c``) to the round state ``x_j`` (each stage's round-j forward and backward end); once a round
shifts every component by the same ``c`` (``x_j = x_{j-1} + c``), ``x_{j+r} = x_j + r c`` until round M-p, so the
recurrence jumps there and finishes the cool-down: exact (up to float rounding), and O(p (transient + p)) instead
of O(p M). For identical stages it gives ``(M + p - 1)(F + B)``, the textbook bubble ``(p - 1)(F + B)`` (SC'21
eq. 1). ``ready[k]`` delays stage k's first op (e.g. an exposed parameter all-gather).

Interleaved 1F1B (SC'21 section 2.2.2; megatron-core ``forward_backward_pipelining_with_interleaving``, 0.16):
v chunks per stage, model chunk ``j p + s`` on stage s; forward k of a rank runs chunk ``(k // p) % v`` on
micro-batch ``(k // (p v)) p + k % p``, warm-up ``2 (p - s - 1) + (v - 1) p`` forwards (``memory.interleaved_
warmup``). The op order and dependencies are compiled once per (p, v, M) into a topological list (cached) and
evaluated by the same recurrence. Identical chunks give ``(M v + p - 1)(f + b)``: the 1F1B bubble over v.

End of the iteration: each stage k runs its ``sync[k]`` (exposed DP gradient reduction) after its last op. With
``step`` (per stage: the optimizer step, plus the parameter all-gather when not overlapped) the step starts for all
stages at the barrier ``T = max_k (end_k + sync_k)``: megatron-core's gradient-norm clipping all-reduces over the
model-parallel group (``clip_grad`` > 0, Megatron-LM's default 1.0), so no stage steps before the slowest is done;
the iteration is ``T + max_k step_k``. Without ``step`` the iteration is ``max_k (end_k + sync_k)`` (the v1 model).

Per stage: ``stage_busy_ms`` = its own work (``M (F + B)`` summed over chunks, + sync + step + ready),
``stage_total_ms`` = when it would finish (end + sync + step); the bottleneck is the busiest stage (it sets the
steady state: the cycle time of 1F1B is ``max_k (F_k + B_k)``), ``bubble_ms`` = iteration - its busy time.
"""

from __future__ import annotations

from functools import lru_cache

from .types import Event, PipelineCost

_PERIOD_RTOL = 1e-12    # a round is a pure shift when all components move by the same amount to this tolerance


# ----- 1F1B: the round recurrence ------------------------------------------------------------------------------------
def _ends_rounds(fwd: list[float], bwd: list[float], m: int, r0: list[float]) -> list[float]:
    """``one_f_one_b_ends`` for ``m >= p`` without a record: the same recurrence on the round state only (each
    stage's last forward and backward end), O(p) memory, with the periodic jump."""
    p = len(fwd)
    up, last = None, [0.0] * p                  # warm-up: stage k-1's warm-up row; each stage's last warm-up end
    for k in range(p):
        row, t = [], r0[k]
        for i in range(p - k - 1):
            if up is not None and up[i] > t:
                t = up[i]
            t += fwd[k]
            row.append(t)
        last[k] = t
        up = row
    F, B = [0.0] * p, [0.0] * p
    for k in range(p):                          # round 0: forward w_k after the last warm-up forwards
        t = last[k]
        if k and last[k - 1] > t:
            t = last[k - 1]
        F[k] = t + fwd[k]
    t = F[p - 1] + bwd[p - 1]
    B[p - 1] = t
    for k in range(p - 2, -1, -1):
        t = (t if t > F[k] else F[k]) + bwd[k]
        B[k] = t
    j, steady, jump = 1, m - p, m - p >= 3      # rounds 1..m-p: every stage has a forward (the same map)
    while j < m:
        pf, pb = F, B
        F, B = [0.0] * p, [0.0] * p
        for k in range(p):
            if j < steady + k + 1:              # stage k still has forward w_k + j
                t = pb[k]
                if k and pf[k - 1] > t:
                    t = pf[k - 1]
                F[k] = t + fwd[k]
            else:
                F[k] = pf[k]
        t = 0.0
        for k in range(p - 1, -1, -1):
            own = F[k] if j < steady + k + 1 else pb[k]
            t = (t if t > own else own) + bwd[k]
            B[k] = t
        if jump and 2 <= j < steady:
            c = B[0] - pb[0]
            tol = _PERIOD_RTOL * (abs(B[0]) + 1.0)
            if all(abs(B[k] - pb[k] - c) <= tol and abs(F[k] - pf[k] - c) <= tol for k in range(p)):
                n = steady - j
                F = [x + n * c for x in F]
                B = [x + n * c for x in B]
                j = steady
                jump = False
        j += 1
    return B


def one_f_one_b_ends(fwd: list[float], bwd: list[float], m: int, ready: list[float] | None = None,
                     record: list | None = None) -> list[float]:
    """End time of each stage's last op under 1F1B. ``record``: a list to fill with ``(stage, is_forward,
    micro-batch, start, end)`` of every op (then the periodic jump is not taken, so that every op is visited)."""
    p = len(fwd)
    if record is None and m >= p:
        return _ends_rounds(fwd, bwd, m, ready or [0.0] * p)
    w = [min(p - k - 1, m) for k in range(p)]
    r0 = ready or [0.0] * p
    f = [[0.0] * m for _ in range(p)]          # forward end times [stage][micro-batch]
    b = [[0.0] * m for _ in range(p)]
    for k in range(p):                          # warm-up forwards
        fk, t, up = fwd[k], r0[k], f[k - 1] if k else None
        row = f[k]
        for i in range(w[k]):
            s = t if up is None or up[i] < t else up[i]
            t = row[i] = s + fk
            if record is not None:
                record.append((k, True, i, s, t))
    j = 0
    jumpable = record is None and m - p >= 3
    while j < m:
        for k in range(p):                      # the round's forwards: previous round only
            i = w[k] + j
            if i < m:
                prev = b[k][j - 1] if j else (f[k][i - 1] if i else r0[k])
                s = prev if k == 0 or f[k - 1][i] < prev else f[k - 1][i]
                f[k][i] = s + fwd[k]
                if record is not None:
                    record.append((k, True, i, s, f[k][i]))
        for k in range(p - 1, -1, -1):          # the round's backwards: one upward chain
            i = w[k] + j
            last = f[k][i] if i < m else (b[k][j - 1] if j else f[k][m - 1])
            s = last if k == p - 1 or b[k + 1][j] < last else b[k + 1][j]
            b[k][j] = s + bwd[k]
            if record is not None:
                record.append((k, False, j, s, b[k][j]))
        if jumpable and 2 <= j < m - p:
            c = b[0][j] - b[0][j - 1]
            tol = _PERIOD_RTOL * (abs(b[0][j]) + 1.0)
            if all(abs(b[k][j] - b[k][j - 1] - c) <= tol and abs(f[k][w[k] + j] - f[k][w[k] + j - 1] - c) <= tol
                   for k in range(p)):
                n = m - p - j                   # jump to round m - p: every component shifts by n c
                for k in range(p):
                    f[k][w[k] + m - p] = f[k][w[k] + j] + n * c
                    b[k][m - p] = b[k][j] + n * c
                j = m - p
                jumpable = False
        j += 1
    return [b[k][m - 1] for k in range(p)]


# ----- interleaved 1F1B: a compiled op list ---------------------------------------------------------------------------
def _interleaved_order(s: int, p: int, v: int, m: int) -> list[tuple[bool, int, int]]:
    """Rank s's op order under megatron-core's interleaved 1F1B: (is_forward, chunk, micro-batch)."""
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


@lru_cache(maxsize=256)
def _compiled(p: int, v: int, m: int) -> tuple:
    """Topological op list of interleaved 1F1B: per op (stage, is_forward, chunk, micro-batch, dep, prev) with
    ``dep``/``prev`` indices into the list (-1: none)."""
    orders = [_interleaved_order(s, p, v, m) for s in range(p)]
    last = p * v - 1
    index: dict[tuple[bool, int, int], int] = {}   # (is_forward, model chunk, micro-batch) -> list position
    ops, pos, prev = [], [0] * p, [-1] * p
    moved = True
    while moved:
        moved = False
        for s in range(p):
            order = orders[s]
            while pos[s] < len(order):
                is_f, c, i = order[pos[s]]
                k = c * p + s
                if is_f:
                    dep = -1 if k == 0 else index.get((True, k - 1, i))
                else:
                    dep = index.get((True, k, i)) if k == last else index.get((False, k + 1, i))
                if dep is None:
                    break
                index[(is_f, k, i)] = len(ops)
                ops.append((s, is_f, c, i, dep, prev[s]))
                prev[s] = len(ops) - 1
                pos[s] += 1
                moved = True
    if any(pos[s] < len(orders[s]) for s in range(p)):
        raise ValueError("pipeline schedule deadlocked; check num_micro_batches against the stages")
    return tuple(ops)


PROBE_GROUPS = (5, 10)    # interleaved: micro-batch groups (of p) simulated before looking for the periodic regime


def _run_interleaved(fwd, bwd, m, r0, record=None, per_stage=None) -> list[float]:
    p, v = len(fwd), len(fwd[0])
    ops = _compiled(p, v, m)
    end = [0.0] * len(ops)
    last = [0.0] * p
    for n, (s, is_f, c, i, dep, prev) in enumerate(ops):
        t = end[prev] if prev >= 0 else r0[s]
        if dep >= 0 and end[dep] > t:
            t = end[dep]
        e = end[n] = t + (fwd[s][c] if is_f else bwd[s][c])
        last[s] = e
        if record is not None:
            record.append((s, c, is_f, i, t, e))
        if per_stage is not None:
            per_stage[s][0 if is_f else 1].append(e)
    return last


def _group_shift(per_stage, p: int, v: int, m: int) -> float | None:
    """The shift c if the last two steady groups of every stage's forwards and backwards both moved by the same c
    (a full-state period of the interleaved map), else None."""
    from .memory import interleaved_warmup
    g, total = p * v, m * v
    c = None
    for s, (fe, be) in enumerate(per_stage):
        w = interleaved_warmup(s, p, v, m)
        for seq, hi in ((fe, total), (be, total - w)):
            lo = hi - 3 * g
            if lo < 0 or (seq is fe and lo < w):
                return None
            for k in range(lo + g, hi):
                d = seq[k] - seq[k - g]
                if c is None:
                    c = d
                elif abs(d - c) > _PERIOD_RTOL * (abs(seq[k]) + 1.0):
                    return None
    return c


def interleaved_ends(fwd: list[list[float]], bwd: list[list[float]], m: int, ready: list[float] | None = None,
                     record: list | None = None) -> list[float]:
    """End time of each stage's last op under interleaved 1F1B; ``record`` as in ``one_f_one_b_ends`` (with the
    chunk: ``(stage, chunk, is_forward, micro-batch, start, end)``).

    Without a record and for many micro-batch groups: the schedule of ``PROBE_GROUPS`` groups first (5, then 10
    if not yet periodic); once its last
    steady groups repeat with a common shift c on every stage, the interleaved map is periodic (the same max-plus
    argument as 1F1B's, with the group of p micro-batches as the period), and the schedule of M micro-batches ends
    ``(M - M') / p`` shifts later: exact, in O(groups p^2 v) instead of O(M p v)."""
    p, v = len(fwd), len(fwd[0])
    r0 = ready or [0.0] * p
    for groups in PROBE_GROUPS:
        probe = groups * p
        if record is not None or m % p or m <= probe + p:
            break
        per_stage = [([], []) for _ in range(p)]
        last = _run_interleaved(fwd, bwd, probe, r0, per_stage=per_stage)
        c = _group_shift(per_stage, p, v, probe)
        if c is not None:
            n = (m - probe) // p
            return [e + n * c for e in last]
    return _run_interleaved(fwd, bwd, m, r0, record)


# ----- iteration ------------------------------------------------------------------------------------------------------
def _finish(ends: list[float], work: list[float], sync: list[float], step: list[float] | None,
            num_chunks: int, ready: list[float] | None = None) -> PipelineCost:
    p = len(ends)
    stp = step or [0.0] * p
    pro = ready or [0.0] * p
    barrier = max(ends[k] + sync[k] for k in range(p))
    it = barrier + max(stp) if step is not None else barrier
    busy = [work[k] + sync[k] + stp[k] + pro[k] for k in range(p)]
    bott = busy.index(max(busy))
    return PipelineCost(iteration_ms=it, stage_total_ms=[ends[k] + sync[k] + stp[k] for k in range(p)],
                        bottleneck=bott, bubble_ms=max(0.0, it - busy[bott]), num_chunks=num_chunks,
                        stage_busy_ms=busy)


def one_f_one_b(fwd: list[float], bwd: list[float], sync: list[float], num_micro_batches: int, *,
                ready: list[float] | None = None, step: list[float] | None = None,
                events: list | None = None) -> PipelineCost:
    """1F1B; ``fwd[k]``, ``bwd[k]`` per micro-batch, ``sync[k]`` once per iteration after the stage's last op,
    ``step[k]`` after the barrier (see the module docstring). ``events``: a list to extend with the timeline."""
    m = num_micro_batches
    rec = [] if events is not None else None
    ends = one_f_one_b_ends(fwd, bwd, m, ready, rec)
    cost = _finish(ends, [m * (fwd[k] + bwd[k]) for k in range(len(fwd))], sync, step, 1, ready)
    if events is not None:
        events.extend(Event(k, 0, i, "forward" if is_f else "backward", s, e) for k, is_f, i, s, e in rec)
        _tail_events(events, ends, sync, step, cost.iteration_ms)
    return cost


def interleaved_one_f_one_b(fwd: list[list[float]], bwd: list[list[float]], sync: list[float],
                            num_micro_batches: int, events: list | None = None, *,
                            ready: list[float] | None = None, step: list[float] | None = None) -> PipelineCost:
    """Interleaved 1F1B; ``fwd[s][j]``/``bwd[s][j]``: chunk j of stage s per micro-batch (model chunk ``j p + s``)."""
    m, v = num_micro_batches, len(fwd[0])
    rec = [] if events is not None else None
    ends = interleaved_ends(fwd, bwd, m, ready, rec)
    cost = _finish(ends, [m * (sum(f) + sum(b)) for f, b in zip(fwd, bwd)], sync, step, v, ready)
    if events is not None:
        events.extend(Event(s, c, i, "forward" if is_f else "backward", t0, t1) for s, c, is_f, i, t0, t1 in rec)
        _tail_events(events, ends, sync, step, cost.iteration_ms)
    return cost


def _tail_events(events: list, ends: list[float], sync: list[float], step: list[float] | None, it: float) -> None:
    """Each stage's sync box after its last op; the step boxes after the barrier."""
    for k, e in enumerate(ends):
        if sync[k] > 0:
            events.append(Event(k, -1, -1, "sync", e, e + sync[k]))
    if step is not None:
        barrier = it - max(step)
        for k, st in enumerate(step):
            if st > 0:
                events.append(Event(k, -1, -1, "step", barrier, barrier + st))


def one_f_one_b_events(fwd: list[float], bwd: list[float], sync: list[float], m: int) -> list[Event]:
    """The 1F1B schedule's events (the same recurrence as ``one_f_one_b``)."""
    events: list[Event] = []
    one_f_one_b(fwd, bwd, sync, m, events=events)
    return events
