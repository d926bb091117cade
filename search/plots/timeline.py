"""The pipeline timeline of a plan: the cost model's own schedule events, drawn one row per stage.

Data (``boxes``, no matplotlib): the events of ``CostModel.pipeline_events`` (the same simulation that gives the
pipeline time; ``types.Event``). When a cost model emits only the coarse kinds (forward, backward, sync), each box is
cut into the ``StageCost`` terms it is the sum of, in the order they run, without moving its ends:

    forward   = fwd_ms (compute, TP collectives included) + p2p_ms / 2 (send/receive of the activation)
    backward  = recompute_ms (the re-run forward comes first) + bwd_ms + p2p_ms / 2 (the gradient)
    sync      = dp_sync_ms (gradient reduction, "dp_comm") + optimizer_ms

(interleaved stages: ``chunk_fwd_ms``/``chunk_bwd_ms`` carry their p2p and recompute already, not split per chunk,
so their boxes stay whole). Finer kinds from the cost model itself (recompute, p2p, dp_comm, ...) are used as they
come (``tp_comm`` / ``cp_comm``: the exposed TP collectives / ring exchange inside each op); a kind ending in
``_hidden`` is communication overlapped with compute (drawn as a thin strip under the row; in dense rows the
per-micro-batch ones as shares per column too, so hundreds of micro-batches read as a band, not a solid bar).
A cost model without ``pipeline_events`` (aceso-compat) gets the 1F1B simulation of its per-stage times, and the
picture says so when that differs from its own pipeline formula.

Drawing (``draw``): boxes as one ``PolyCollection`` per kind; more than ``MAX_ROWS`` stages are sampled evenly
(first, last and bottleneck always shown); when the forward/backward boxes get narrower than ``DENSE_PX`` pixels
(e.g. 64 stages x 500 micro-batches) each row shows instead, per column of ``SHARE_PX`` pixels, the share of that
column's time each kind runs, stacked (the exact integral of its boxes), so sub-pixel boxes neither vanish nor
blend, and idle time (the bubble) stays blank.
"""

from __future__ import annotations

from ..costmodel.pipeline import one_f_one_b_events
from ..costmodel.types import Event, StageCost

COARSE = frozenset({"forward", "backward", "sync"})   # the kinds a cost model emits before it splits them itself
MAX_ROWS = 32           # stages drawn; more are sampled
DENSE_PX = 3.0          # mean forward/backward width (pixels) below which rows show per-pixel shares of each kind
EDGE_PX = 4.0           # mean width from which boxes get white edges (separating neighbours)
SHARE_PX = 4             # dense rows: pixels per share column (wider than a schedule period: no aliasing)
LABEL_PX = 16.0         # box width (pixels) from which the micro-batch number is written in it
HIDDEN_STRIP = (0.28, 0.4)   # where in a row (centred on 0, 1 high) overlapped communication is drawn
ORDER = ("forward", "recompute", "backward", "p2p", "tp_comm", "cp_comm", "dp_comm", "sync", "param_gather",
         "optimizer", "step")
LABELS = {"forward": "forward", "backward": "backward", "recompute": "recompute (forward re-run)",
          "p2p": "p2p send/recv (exposed)", "dp_comm": "DP gradient sync (exposed)", "sync": "DP sync + optimizer",
          "optimizer": "optimizer step", "tp_comm": "TP collectives (exposed)", "cp_comm": "CP ring (exposed)",
          "param_gather": "parameter all-gather (exposed)", "step": "optimizer step (+ parameter all-gather)"}


def schedule_events(cm, stage_costs: list[StageCost], num_micro_batches: int) -> list[Event]:
    """The cost model's pipeline events (or, without ``pipeline_events``, the 1F1B simulation of its stage times)."""
    if hasattr(cm, "pipeline_events"):
        return list(cm.pipeline_events(stage_costs, num_micro_batches))
    fwd = [s.fwd_ms + s.p2p_ms / 2 for s in stage_costs]
    bwd = [s.bwd_ms + s.recompute_ms + s.p2p_ms / 2 for s in stage_costs]
    sync = [s.dp_sync_ms + s.optimizer_ms for s in stage_costs]
    return one_f_one_b_events(fwd, bwd, sync, num_micro_batches)


def boxes(cm, stage_costs: list[StageCost], num_micro_batches: int) -> list[Event]:
    """The timeline's boxes: the schedule events, coarse ones cut into their ``StageCost`` terms."""
    events = schedule_events(cm, stage_costs, num_micro_batches)
    if any(e.kind not in COARSE for e in events):
        return events
    parts = [_terms(s) for s in stage_costs]
    out: list[Event] = []
    for e in events:
        terms = parts[e.stage].get(e.kind)
        if not terms:
            out.append(e)
            continue
        t = e.start_ms
        for j, (kind, d) in enumerate(terms):   # back to back; the last piece ends exactly where the event ends
            end = e.end_ms if j == len(terms) - 1 else min(t + d, e.end_ms)
            out.append(Event(e.stage, e.chunk, e.micro_batch, kind, t, end))
            t = end
    return out


def _terms(s: StageCost) -> dict[str, list[tuple[str, float]]]:
    """The ``StageCost`` terms each coarse event kind of this stage is the sum of, in the order they run."""
    terms = {"sync": [("dp_comm", s.dp_sync_ms), ("optimizer", s.optimizer_ms)]}
    if not s.chunk_fwd_ms:                      # interleaved chunks carry their p2p and recompute already
        terms["forward"] = [("forward", s.fwd_ms), ("p2p", s.p2p_ms / 2)]
        terms["backward"] = [("recompute", s.recompute_ms), ("backward", s.bwd_ms), ("p2p", s.p2p_ms / 2)]
    return {k: [(n, d) for n, d in v if d > 0] for k, v in terms.items()}


def busy_ms(events: list[Event], num_stages: int) -> list[float]:
    """Per stage, the time its boxes cover (hidden communication excluded: it overlaps other boxes)."""
    out = [0.0] * num_stages
    for e in events:
        if not hidden(e.kind):
            out[e.stage] += e.end_ms - e.start_ms
    return out


def hidden(kind: str) -> bool:
    return kind.endswith("_hidden")


def shown_stages(num_stages: int, bottleneck: int, max_rows: int = MAX_ROWS) -> list[int]:
    """All stages, or ``max_rows`` of them evenly spaced, always with the first, the last and the bottleneck
    (which takes the place of the pick nearest to it)."""
    if num_stages <= max_rows:
        return list(range(num_stages))
    step = (num_stages - 1) / (max_rows - 1)        # > 1: the rounded picks are distinct
    picks = [round(k * step) for k in range(max_rows)]
    if bottleneck not in picks:
        near = min(range(1, max_rows - 1), key=lambda k: abs(picks[k] - bottleneck))
        picks[near] = bottleneck
    return sorted(picks)


def kinds_in_order(events: list[Event]) -> list[str]:
    seen = {e.kind for e in events}
    known = [k for k in ORDER if k in seen] + [k + "_hidden" for k in ORDER if k + "_hidden" in seen]
    return known + sorted(seen - set(known))


def row_inches(num_chunks: int) -> float:
    """Height of one stage row."""
    return 0.42 if num_chunks == 1 else 0.16 * num_chunks + 0.1


def draw(ax, events: list[Event], stage_labels: list[str], iteration_ms: float, bottleneck: int,
         num_chunks: int, width_px: float) -> list:
    """Draw the timeline on ``ax``; returns the legend handles. ``stage_labels[s]`` names stage s."""
    from matplotlib.patches import Patch

    from . import color_of
    S = len(stage_labels)
    rows = shown_stages(S, bottleneck)
    row_of = {s: r for r, s in enumerate(rows)}
    end = max([e.end_ms for e in events] + [iteration_ms]) * 1.02
    px_per_ms = width_px / end
    work = [e.end_ms - e.start_ms for e in events if e.kind in ("forward", "backward") and e.stage in row_of]
    mean_px = px_per_ms * sum(work) / max(len(work), 1)
    dense = mean_px < DENSE_PX
    kinds = kinds_in_order(events)
    per_mb = {e.kind for e in events if e.micro_batch >= 0 and not hidden(e.kind)}
    lane_kinds = [k for k in kinds if k in per_mb]
    others: dict[str, str] = {}
    colors = {k: color_of(k, others) for k in kinds}
    shown = [e for e in events if e.stage in row_of]
    if dense:   # per-micro-batch kinds as stacked shares per pixel (hidden ones in the row's bottom strip), the
        # per-iteration rest (sync, step, hidden DP / parameter gather) as boxes
        band = [k for k in kinds if hidden(k) and any(e.kind == k and e.micro_batch >= 0 for e in shown)]
        cols = int(width_px) // SHARE_PX
        _draw_shares(ax, [e for e in shown if e.kind in per_mb and e.micro_batch >= 0], row_of, lane_kinds,
                     colors, end, cols)
        _draw_shares(ax, [e for e in shown if e.kind in band and e.micro_batch >= 0], row_of, band, colors, end,
                     cols, height_px=4, extent=HIDDEN_STRIP, alpha=0.6)
        shown = [e for e in shown if not ((e.kind in per_mb or e.kind in band) and e.micro_batch >= 0)]
    _draw_boxes(ax, shown, row_of, [], 1 if dense else num_chunks, colors, edges=mean_px >= EDGE_PX)
    if not dense:
        _label_micro_batches(ax, events, row_of, num_chunks, px_per_ms)
    handles = []
    for k in kinds:
        hid = hidden(k)
        base = LABELS.get(k.removesuffix("_hidden"), k.removesuffix("_hidden").replace("_", " "))
        name = base.replace(" (exposed)", "") + " overlapped (hidden)" if hid else base
        handles.append(Patch(facecolor=colors[k], alpha=0.6 if hid else 1.0, hatch="////" if hid else None,
                             label=name))
    _frame(ax, rows, S, stage_labels, bottleneck, iteration_ms, end, handles, dense, num_chunks)
    return handles


def _frame(ax, rows, S, stage_labels, bottleneck, iteration_ms, end, handles, dense, num_chunks) -> None:
    """Axes, row labels, the bottleneck band, the iteration line and the title note."""
    from matplotlib.patches import Patch
    row_of = {s: r for r, s in enumerate(rows)}
    if bottleneck in row_of:
        r = row_of[bottleneck]
        ax.axhspan(r - 0.5, r + 0.5, color="#fff3b0", zorder=0)
        handles.append(Patch(facecolor="#fff3b0", label=f"bottleneck stage ({bottleneck})"))
    line = ax.axvline(iteration_ms, color="black", linestyle="--", linewidth=1.2)
    line.set_label(f"iteration {iteration_ms:,.1f} ms")
    handles.append(line)
    ax.set_xlim(0, end)
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_yticks(range(len(rows)), [stage_labels[s] for s in rows], fontsize=8 if len(rows) <= 16 else 6.5)
    if bottleneck in row_of:
        ax.get_yticklabels()[row_of[bottleneck]].set_fontweight("bold")
    from . import time_axis
    time_axis(ax, end, "time in the iteration")
    note = "" if len(rows) == S else f": {len(rows)} of {S} stages, evenly spaced"
    note += "; dense: each kind's share of the time, stacked" if dense else ""
    note += f"; chunk lanes 0-{num_chunks - 1} per stage" if num_chunks > 1 and not dense else ""
    ax.set_title("pipeline timeline (cost model's schedule)" + note, fontsize=10, loc="left")
    ax.grid(axis="x", color="#dddddd", linewidth=0.6)
    ax.set_axisbelow(True)


def _draw_boxes(ax, events: list[Event], row_of: dict[int, int], lane_kinds: list[str], num_chunks: int,
                colors: dict[str, str], edges: bool) -> None:
    """One ``PolyCollection`` per kind (numpy corners: 100k boxes in well under a second)."""
    import numpy as np
    from matplotlib.collections import PolyCollection
    groups: dict[str, list] = {}
    for e in events:
        groups.setdefault(e.kind, []).append((e.start_ms, e.end_ms, row_of[e.stage], e.chunk, e.micro_batch))
    for kind, rows in groups.items():
        x0, x1, r, chunk, mb = np.asarray(rows, dtype=float).T
        y0, y1 = (np.broadcast_to(y, x0.shape) for y in _lanes(kind, r, chunk, mb, lane_kinds, num_chunks))
        verts = np.stack([np.stack([x0, y0], -1), np.stack([x0, y1], -1), np.stack([x1, y1], -1),
                          np.stack([x1, y0], -1)], axis=1)
        hid = hidden(kind)
        ax.add_collection(PolyCollection(verts, facecolors=colors[kind], edgecolors="white" if edges else "none",
                                         linewidths=0.4 if edges else 0.0, hatch="////" if hid else None,
                                         alpha=0.6 if hid else 1.0))


def _draw_shares(ax, events: list[Event], row_of: dict[int, int], kinds: list[str], colors: dict[str, str],
                 end_ms: float, width_px: int, height_px: int = 32, extent: tuple[float, float] = (-0.4, 0.4),
                 alpha: float = 1.0) -> None:
    """Dense timelines: each row is a stacked strip, per pixel column the share of that column's time each kind
    runs (exact: the integral of its boxes over the column), top down in ``kinds`` order, idle time left blank; so
    sub-pixel boxes neither vanish nor blend into each other's colours."""
    import numpy as np
    from matplotlib.colors import to_rgba
    edges = np.linspace(0.0, end_ms, width_px + 1)
    per_row: dict[int, dict[str, list]] = {}
    for e in events:
        per_row.setdefault(row_of[e.stage], {}).setdefault(e.kind, []).append((e.start_ms, e.end_ms))
    palette = np.array([to_rgba(colors[k], alpha) for k in kinds] + [(1.0, 1.0, 1.0, 0.0)])
    y = (np.arange(height_px) + 0.5) / height_px
    for r, spans in per_row.items():
        share = np.zeros((len(kinds), width_px))
        for j, k in enumerate(kinds):
            if k in spans:
                a = np.asarray(spans[k], dtype=float)
                share[j] = np.diff(_covered(a[:, 0], a[:, 1], edges)) / np.diff(edges)
        cum = np.cumsum(np.clip(share, 0.0, 1.0), axis=0)                 # (K, W)
        which = (cum[:, None, :] <= y[None, :, None]).sum(axis=0)       # (H, W): the kind under each pixel
        ax.imshow(palette[which], extent=(0.0, end_ms, r + extent[1], r + extent[0]), aspect="auto",
                  interpolation="nearest", zorder=1)


def _covered(starts, ends, at):
    """Total length of the intervals [starts, ends) left of each point of ``at`` (piecewise linear: slope +1 after
    a start, -1 after an end)."""
    import numpy as np
    pts = np.concatenate([starts, ends])
    slope = np.concatenate([np.ones_like(starts), -np.ones_like(ends)])
    order = np.argsort(pts, kind="stable")
    pts, slope = pts[order], np.cumsum(slope[order])
    cum = np.concatenate([[0.0], np.cumsum(slope[:-1] * np.diff(pts))])
    return np.interp(at, pts, cum, left=0.0, right=cum[-1])


def _lanes(kind: str, row, chunk, mb, lane_kinds: list[str], num_chunks: int):
    """Vertical extent (y0, y1) of boxes of one kind in their rows (rows are 1 high, centred on the row index):
    per-iteration work (sync, optimizer) the whole row; per micro-batch boxes a lane per kind (``lane_kinds``:
    dense) or per chunk; overlapped communication a strip along the row's bottom."""
    import numpy as np
    top, height = row - 0.4, 0.8
    if hidden(kind):
        return row + HIDDEN_STRIP[0], row + HIDDEN_STRIP[1]
    if lane_kinds and kind in lane_kinds:
        n, j = len(lane_kinds), np.full_like(row, lane_kinds.index(kind))
    elif num_chunks > 1 and not lane_kinds:
        n, j = num_chunks, np.maximum(chunk, 0)
    else:
        return top, top + height
    whole = mb < 0
    h = height / n
    return np.where(whole, top, top + j * h), np.where(whole, top + height, top + (j + 1) * h)


def _label_micro_batches(ax, events: list[Event], row_of: dict[int, int], num_chunks: int, px_per_ms: float) -> None:
    """The micro-batch number inside forward/backward boxes wide enough to hold it."""
    wide = [e for e in events if e.kind in ("forward", "backward") and e.stage in row_of
            and (e.end_ms - e.start_ms) * px_per_ms >= LABEL_PX]
    if len(wide) > 3000:
        return
    size = 6.5 if num_chunks == 1 else 5.5
    for e in wide:
        y0, y1 = _lanes(e.kind, row_of[e.stage], e.chunk, e.micro_batch, [], num_chunks)
        ax.text((e.start_ms + e.end_ms) / 2, float(y0 + y1) / 2, str(e.micro_batch), ha="center", va="center",
                fontsize=size, color="white", clip_on=True)
