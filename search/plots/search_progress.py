"""``aceso search --plot FILE``: the accepted moves of the search and the final comparison.

Data (``progress``, ``comparison``; no matplotlib): the search's trace (``Move.as_dict()``, what ``--trace``
writes), one point per accepted move: the iteration time and memory after it, which primitive chain it was, and
whether the plan fits; each stage count's search is its own segment, starting at the time before its first move.
The memory is the bottleneck stage's when the trace records it (``bottleneck_memory_*_mib``), else the fullest
stage's (``max_memory_*_mib``; ``*_mb`` in old traces). The x axis is the evaluation count at acceptance when the trace records one (key
``evaluations``), else the move's number within its stage count. ``comparison`` gives the bars: the uniform
Megatron baseline, the best Megatron-LM-expressible plan when the search reports one, and the heterogeneous plan
the search returns (after its exact refinements, hence possibly below the last move).
"""

from __future__ import annotations

from dataclasses import dataclass

from search.io.units import legacy_keys
from . import DPI, FALLBACK, Target, save

WIDTH_IN, HEIGHT_IN = 14.0, 7.5
MAX_LABELS = 24          # stage-count labels along the top
EVAL_KEYS = ("evaluations", "evaluation")   # the trace's evaluation count at acceptance, if recorded
# the planner's primitives (``primitives.APPLY``) keep their colours from picture to picture; others get the rest
PRIMITIVE_COLORS = {"move_units": "#4e79a7", "rebalance": "#a0cbe8", "inc_tp": "#f28e2b", "dec_tp": "#ffbe7d",
                    "inc_dp": "#59a14f", "dec_dp": "#8cd17d", "tp_to_dp": "#b07aa1", "dp_to_tp": "#d4a6c8",
                    "inc_mbs": "#9c755f", "dec_mbs": "#d7b5a6"}


@dataclass(frozen=True)
class Point:
    num_stages: int
    x: float                 # position in its stage count's segment: evaluations, or the move number
    time_ms: float | None    # None: no finite time (the plan did not fit)
    memory_mb: float | None
    fits: bool
    primitive: str           # the chain's first primitive (the one aimed at the bottleneck); "start" first
    hops: int                # primitives in the chain (1: a single move; more: a multi-hop chain)


def progress(moves: list[dict]) -> tuple[dict[int, list[Point]], str, str]:
    """Per stage count, its points in order; the x axis's name; whose memory the points carry (the bottleneck
    stage's when the trace records it, else the fullest stage's)."""
    by_eval = bool(moves) and all(any(m.get(k) is not None for k in EVAL_KEYS) for m in moves)
    moves = [legacy_keys(m) for m in moves]      # traces written before the MiB names read too
    mem = "bottleneck" if moves and all("bottleneck_memory_after_mib" in m for m in moves) else "max"
    out: dict[int, list[Point]] = {}
    for m in moves:
        S = m["num_stages"]
        pts = out.setdefault(S, [])
        if not pts:
            pts.append(Point(S, 0.0, m["time_before_ms"], m[f"{mem}_memory_before_mib"], m["fits_before"], "start", 0))
        x = float(next(m[k] for k in EVAL_KEYS if m.get(k) is not None)) if by_eval else float(len(pts))
        pts.append(Point(S, x, m["time_after_ms"], m[f"{mem}_memory_after_mib"], m["fits_after"], m["primitives"][0],
                         len(m["primitives"])))
    return out, ("evaluations in the stage count's search" if by_eval else "accepted move"), mem


def comparison(base, best_ms: float, megatron_ms: float | None = None,
               target: str = "aceso") -> list[tuple[str, float | None]]:
    """(label, iteration ms) bars; a baseline that does not fit has None. With ``target`` megatron-lm the search's
    own plan is the Megatron-LM-expressible one (no heterogeneous bar)."""
    if target == "megatron-lm":
        megatron_ms, best_ms = best_ms, None
    rows: list[tuple[str, float | None]] = []
    if base is not None and base.fits:
        cp = f" cp{base.cp}" if base.cp > 1 else ""
        rows.append((f"uniform Megatron baseline\npp{base.pp} tp{base.tp}{cp} dp{base.dp} mbs/rank {base.micro_batch_per_rank}, "
                     f"recompute {base.recompute}", base.iteration_ms))
    else:
        rows.append(("uniform Megatron baseline\n(no uniform configuration fits)", None))
    if megatron_ms is not None:
        rows.append(("Megatron-LM-expressible plan\n(drop-in: aceso export --to megatron-lm)", megatron_ms))
    if best_ms is not None:
        rows.append(("heterogeneous plan\n(aceso runtime)", best_ms))
    return rows


def draw(out: Target, moves: list[dict], bars: list[tuple[str, float | None]], memory_limit_mb: float,
         title: str) -> None:
    """Write the search picture: time and memory after each move (left), legend and comparison bars (right)."""
    from matplotlib.lines import Line2D

    from . import pyplot
    plt = pyplot()
    segments, xname, mem = progress(moves)
    fig = plt.figure(figsize=(WIDTH_IN, HEIGHT_IN), dpi=DPI)
    W, H = WIDTH_IN, HEIGHT_IN
    ax_t = fig.add_axes((1.0 / W, 3.95 / H, 7.3 / W, 2.65 / H))
    ax_m = fig.add_axes((1.0 / W, 0.75 / H, 7.3 / W, 2.55 / H), sharex=ax_t)
    ax_c = fig.add_axes((9.35 / W, 0.75 / H, 4.4 / W, 3.3 / H))
    names = sorted({p.primitive for pts in segments.values() for p in pts if p.hops})
    spare = iter(FALLBACK * (1 + len(names) // len(FALLBACK)))
    color = {n: PRIMITIVE_COLORS.get(n) or next(spare) for n in names}
    by_eval = xname.startswith("evaluations")
    # by evaluations: every stage count's search gets a segment of the same width (they have the same budget)
    span = max([p.x for pts in segments.values() for p in pts] + [1.0]) if by_eval else 0.0
    offset, ticks = 0.0, []
    for S in sorted(segments):
        pts = segments[S]
        xs = [offset + p.x for p in pts]
        end = offset + span if by_eval else xs[-1]
        for ax, ys in ((ax_t, [p.time_ms for p in pts]), (ax_m, [_gb(p.memory_mb) for p in pts])):
            ok = [(x, y, p) for x, y, p in zip(xs, ys, pts) if y is not None]
            ax.plot([x for x, _, _ in ok], [y for _, y, _ in ok], color="#888888", linewidth=0.8, zorder=1)
            for marker, keep in (("o", lambda p: p.hops <= 1), ("D", lambda p: p.hops > 1)):
                sel = [(x, y, p) for x, y, p in ok if keep(p)]
                if sel:
                    ax.scatter([x for x, _, _ in sel], [y for _, y, _ in sel], s=28, marker=marker, zorder=2,
                               c=[color.get(p.primitive, "white") for _, _, p in sel], linewidths=0.8,
                               edgecolors=["#c00000" if not p.fits else "black" for _, _, p in sel])
        gap = 0.04 * span if by_eval else 1.0
        ticks.append(((offset + end) / 2, S))
        for ax in (ax_t, ax_m):
            ax.axvline(end + gap / 2, color="#cccccc", linewidth=0.8)
        offset = end + gap
    xname = (f"evaluations within each search (0 to {span:,.0f}); one segment per number of stages S" if by_eval
             else "accepted moves in order; one segment per number of stages S")
    _finish_progress(ax_t, ax_m, ticks, xname, mem, memory_limit_mb, bool(segments))
    if by_eval:
        ax_m.tick_params(labelbottom=False, bottom=False)

    def dot(face, edge="black", marker="o", label=""):
        return Line2D([], [], marker=marker, linestyle="", markerfacecolor=face, markeredgecolor=edge, label=label)
    handles = [dot("white", label="start of a stage count's search")]
    handles += [dot(color[n], label=n) for n in names]
    if any(p.hops > 1 for pts in segments.values() for p in pts):
        handles.append(dot("#dddddd", marker="D", label="multi-hop chain (its first primitive)"))
    if any(not p.fits for pts in segments.values() for p in pts):
        handles.append(dot("white", edge="#c00000", label="plan does not fit in memory"))
    fig.legend(handles=handles, loc="upper left", bbox_to_anchor=(9.2 / W, 1 - 0.75 / H), fontsize=8,
               frameon=False, title="accepted move (primitive)", title_fontsize=8.5,
               ncol=1 if len(handles) <= 7 else 2, alignment="left")
    _draw_bars(ax_c, bars)
    fig.suptitle(title, x=0.12 / W, ha="left", fontsize=11, y=1 - 0.12 / H, va="top")
    save(fig, out)


def _gb(mb: float | None) -> float | None:
    return None if mb is None else mb / 1024.0


def _finish_progress(ax_t, ax_m, ticks, xname: str, mem: str, limit_mb: float, any_moves: bool) -> None:
    ax_t.set_ylabel("iteration time (ms)")
    ax_t.set_title("iteration time after each accepted move, per number of stages", fontsize=10, loc="left")
    who = "the bottleneck stage" if mem == "bottleneck" else "the fullest stage"
    ax_m.set_ylabel(f"memory of {who.split()[-2]} stage (GiB)")
    ax_m.set_title(f"memory of {who} after each move", fontsize=10, loc="left")
    ax_m.axhline(limit_mb / 1024.0, color="#c00000", linestyle="--", linewidth=1.1)
    ax_m.text(1.0, limit_mb / 1024.0, f" limit {limit_mb / 1024:.1f} GiB", color="#c00000", fontsize=8,
              va="center", ha="left", transform=ax_m.get_yaxis_transform())
    ax_m.set_ylim(0, max(ax_m.get_ylim()[1], limit_mb / 1024.0 * 1.08))
    ax_m.set_xlabel(xname)
    for ax in (ax_t, ax_m):
        ax.grid(axis="y", color="#dddddd", linewidth=0.6)
        ax.set_axisbelow(True)
    ax_t.tick_params(labelbottom=False)
    sec = ax_t.secondary_xaxis("top")
    every = max(1, -(-len(ticks) // MAX_LABELS))   # many stage counts: label every k-th segment (none: no moves)
    shown = ticks[::every]
    sec.set_xticks([x for x, _ in shown], [f"S={S}" if k == 0 else str(S) for k, (_, S) in enumerate(shown)],
                   fontsize=7.5)
    sec.tick_params(length=0)
    if not any_moves:
        ax_t.text(0.5, 0.5, "no accepted moves: the starting plans were already the best found",
                  transform=ax_t.transAxes, ha="center", va="center", fontsize=9, color="#555555")


def _draw_bars(ax, bars: list[tuple[str, float | None]]) -> None:
    """Horizontal bars of iteration time, each labelled above, with the speedup over the uniform baseline."""
    base = bars[0][1]
    ys = [1.25 * k for k in range(len(bars))][::-1]
    palette = {"uniform": "#bab0ac", "Megatron-LM": "#a0cbe8", "heterogeneous": "#4e79a7"}
    colors = [next((c for k, c in palette.items() if label.startswith(k)), "#76b7b2") for label, _ in bars]
    vals = [v or 0.0 for _, v in bars]
    top = max(vals) or 1.0
    ax.barh(ys, vals, color=colors, height=0.5)
    for y, (label, v) in zip(ys, bars):
        ax.text(0.0, y + 0.3, label, va="bottom", fontsize=8, linespacing=1.15)
        if v is None:
            ax.text(0.02 * top, y, "does not fit", va="center", fontsize=8, color="#c00000")
            continue
        speed = f"  {base / v:.3f}x" if base else ""
        ax.text(v + 0.02 * top, y, f"{v:,.1f} ms{speed}", va="center", fontsize=8.5,
                fontweight="bold" if label.startswith("heterogeneous") else "normal")
    ax.set_yticks([])
    ax.set_ylim(-0.5, ys[0] + 0.95)
    ax.set_xlim(0, top * 1.55)
    from . import time_axis
    time_axis(ax, top * 1.55, "predicted iteration time")
    ax.set_title("final comparison (speedup over the uniform baseline)", fontsize=10, loc="left")
    ax.grid(axis="x", color="#dddddd", linewidth=0.6)
    ax.set_axisbelow(True)
    for side in ("left", "right", "top"):
        ax.spines[side].set_visible(False)
