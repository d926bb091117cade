"""``aceso explain PLAN --plot FILE``: one figure, the pipeline timeline above the memory per stage.

Titled with the model, cluster, batch and the predicted samples/s and MFU. Inputs are what explain already
computed (the cost model, its ``PlanCost``, the report's per-stage shapes); see ``timeline`` and ``memory`` for
the data behind each panel.
"""

from __future__ import annotations

import textwrap

from . import DPI, Target, save
from search.spec.plan import span_text
from search.io.text import shape as stage_shape
from . import memory as memory_panel
from . import timeline as timeline_panel

WIDTH_IN = 14.0
LEFT_IN, LEGEND_IN, RIGHT_IN = 1.5, 3.4, 0.15   # row labels, the legend column, margin
TITLE_IN = 0.8
MEMORY_IN = 3.8
GAP_IN = 0.75                                    # between the panels: the timeline's axis label and note


LINE_IN = 0.13                                   # one line of a memory bar's label (7 pt, line spacing 1.1)
CHAR_IN = 0.056                                  # mean advance of a 7 pt DejaVu Sans character (0.58 em)


def _bottom_in(num_stages: int, label_lines: int = 4) -> float:
    """Room under the memory bars for their labels (four lines or more, or one rotated line with many stages)."""
    return 1.0 + LINE_IN * max(0, label_lines - 4) if num_stages <= 8 else 1.7


def _label_chars(num_stages: int) -> int:
    """Characters of a memory bar's label line that fit under its bar (90% of its share of the axes)."""
    return max(8, int((WIDTH_IN - LEFT_IN - LEGEND_IN - RIGHT_IN) / max(num_stages, 1) * 0.9 / CHAR_IN))


def _timeline_in(num_stages: int, num_chunks: int, bottleneck: int) -> float:
    rows = len(timeline_panel.shown_stages(num_stages, bottleneck))
    return max(1.8, rows * timeline_panel.row_inches(num_chunks))


def figure_inches(num_stages: int, num_chunks: int, bottleneck: int = 0, label_lines: int = 4) -> tuple[float, float]:
    """(width, height) of the figure: a fixed width, a timeline as tall as its rows, a fixed memory panel, room for
    the bar labels' lines."""
    h = (TITLE_IN + _timeline_in(num_stages, num_chunks, bottleneck) + GAP_IN + MEMORY_IN
         + _bottom_in(num_stages, label_lines))
    return WIDTH_IN, round(h, 2)


def stage_labels(report: dict) -> tuple[list[str], list[str]]:
    """(timeline row labels, memory bar labels) from explain's report stages."""
    rows, bars = [], []
    many = len(report["stages"]) > 8
    width = _label_chars(len(report["stages"]))
    for s in report["stages"]:
        shape = stage_shape({**s, "sp": False})
        rows.append(f"stage {s['index']}  {shape}")
        if "units" in s:
            span = "units {}-{}".format(*s["units"]) if not s.get("chunks") else s["chunks"]
        else:
            span = "ops {}-{}".format(*s["ops"])
        rc = s.get("recompute_text") or ", ".join(f"{k} {v}" for k, v in s["recompute"].items())
        if "ops" in s:    # a reference config: the number of recomputed ops
            rc = f"recompute {s['recompute'].get('ops', 0)} ops"
        if many:
            bars.append(f"{s['index']}: {span} · {rc}")
        else:       # wrapped to the bar's width: neighbouring labels never run into each other
            lines = [f"stage {s['index']}", shape, span, rc]
            bars.append("\n".join(textwrap.fill(line, width, break_on_hyphens=False) for line in lines))
    return rows, bars


def draw(out: Target, cm, cost, report: dict, plan=None) -> None:
    """Write the explain figure for ``cost`` (a ``PlanCost`` of ``cm``) to ``out``."""
    from . import pyplot
    plt = pyplot()
    stages = cost.stages
    S = len(stages)
    v = max(len(s.chunk_fwd_ms) for s in stages) or 1
    M = report["num_micro_batches"]
    events = timeline_panel.boxes(cm, stages, M)
    segs = memory_panel.segments(cm, plan, stages)
    rows, bars = stage_labels(_with_recompute_text(report, plan))
    lines = max(label.count("\n") + 1 for label in bars)
    w, h = figure_inches(S, v, cost.bottleneck_stage, lines)
    fig = plt.figure(figsize=(w, h), dpi=DPI)
    t_in, b_in = _timeline_in(S, v, cost.bottleneck_stage), _bottom_in(S, lines)
    ax_w = w - LEFT_IN - LEGEND_IN - RIGHT_IN
    ax_t = fig.add_axes((LEFT_IN / w, (b_in + MEMORY_IN + GAP_IN) / h, ax_w / w, t_in / h))
    ax_m = fig.add_axes((LEFT_IN / w, b_in / h, ax_w / w, MEMORY_IN / h))
    h_t = timeline_panel.draw(ax_t, events, rows, cost.iteration_ms, cost.bottleneck_stage, v, ax_w * DPI)
    h_m = memory_panel.draw(ax_m, segs, cost.memory_limit_mb, bars, [s.fits for s in stages], cost.bottleneck_stage)
    for ax, handles in ((ax_t, h_t), (ax_m, h_m)):
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False,
                  borderaxespad=0.0)
    end = max(e.end_ms for e in events)
    if abs(end - cost.iteration_ms) > 1e-6 * max(cost.iteration_ms, 1.0):
        from matplotlib.transforms import offset_copy
        ax_t.set_xlabel(ax_t.get_xlabel(), loc="left")
        ax_t.text(1.0, 0.0, f"note: the schedule's boxes end at {end:,.1f} ms; the {cost.cost_model} model's "
                  f"pipeline formula gives {cost.iteration_ms:,.1f} ms (dashed)", ha="right", va="top", fontsize=7.5,
                  color="#555555", transform=offset_copy(ax_t.transAxes, fig, y=-0.3, units="inches"))
    fig.suptitle(_title(report, cost), x=0.12 / w, ha="left", fontsize=11, y=1 - 0.12 / h, va="top")
    save(fig, out)


def _title(r: dict, cost) -> str:
    fit = "fits" if cost.fits else "DOES NOT FIT"
    return (f"{r['model']} on {r.get('cluster', '?')}: global batch {r['global_batch_size']} = "
            f"{r['num_micro_batches']} micro-batches of {r['micro_batch_size']}\n"
            f"predicted {cost.iteration_ms:,.1f} ms per iteration, {cost.samples_per_s:,.2f} samples/s, "
            f"MFU {100 * cost.mfu:.1f}%, max memory {cost.max_memory_mb / 1024:.1f} GiB ({fit}); bottleneck stage "
            f"{cost.bottleneck_stage} ({cost.bottleneck_resource}); {cost.cost_model} cost model")


def _with_recompute_text(report: dict, plan) -> dict:
    """The report with each stage's chunks and recompute counts taken from the plan (all chunks) when known."""
    if plan is None:
        return report
    stages = []
    for s, st in zip(report["stages"], plan.stages):
        s = dict(s, recompute_text=memory_panel.recompute_text(st))
        if st.num_chunks > 1:
            s["chunks"] = "units " + " ".join(span_text(a, b) for a, b in st.spans)
        stages.append(s)
    return dict(report, stages=stages)
