"""A training run from its JSON-lines log (``aceso train --log-file``): ``--plot`` at the end, ``aceso plot LOG``.

Data (``read_log``, no matplotlib) uses the documented records only (docs/train.md, "Logs"):
``{"kind": "train", iteration, loss, iteration_time_ms, ...}`` every log interval, ``{"kind": "eval", iteration,
loss}`` per validation, and ``{"kind": "summary", measured_iteration_time_ms, measured_stage_memory_mib,
predicted_iteration_time_ms, predicted_stage_memory_mib, memory_kind}`` at the end (``*_mb`` in old logs). ``--log-file`` appends, so a
resumed run continues the same file: for each iteration the last record counts (a run that repeats iterations
replaces them), and the last summary. Other kinds (messages) and unknown fields are ignored.

Panels: loss (train and validation) over iterations; the logged iteration time with the measured mean and the
plan's prediction; per stage the predicted and measured memory (a CPU run's memory is the process's max RSS, which
the picture says is not comparable).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from search.io.errors import AcesoError
from search.io.units import legacy_keys
from . import DPI, Target, save

WIDTH_IN, HEIGHT_IN = 14.0, 5.2


@dataclass
class TrainingLog:
    train: list[dict] = field(default_factory=list)   # by iteration, one record each (the last logged)
    evals: list[dict] = field(default_factory=list)
    summary: dict | None = None


def read_log(path: str | Path) -> TrainingLog:
    """The log's train and eval records (one per iteration, the last wins) and its last summary."""
    label = str(path)
    try:
        lines = Path(path).read_text().splitlines()
    except (FileNotFoundError, IsADirectoryError):
        raise AcesoError(f"{label}: no such log file (write one with aceso train --log-file FILE)") from None
    except UnicodeDecodeError:
        raise AcesoError(f"{label}: not a JSON-lines training log (not text)") from None
    train: dict[int, dict] = {}
    evals: dict[int, dict] = {}
    summary = None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise AcesoError(f"{label}:{n}: not a JSON line ({e.msg}); is this an aceso train --log-file log?") \
                from None
        rec = legacy_keys(rec) if isinstance(rec, dict) else rec    # logs written with *_mb names read too
        kind = rec.get("kind") if isinstance(rec, dict) else None
        if kind in ("train", "eval"):
            if not isinstance(rec.get("iteration"), int) or not isinstance(rec.get("loss"), (int, float)):
                raise AcesoError(f"{label}:{n}: a {kind} record needs an integer iteration and a numeric loss")
            (train if kind == "train" else evals)[rec["iteration"]] = rec
        elif kind == "summary":
            summary = rec
    if not train and not evals and summary is None:
        raise AcesoError(f"{label}: no train, eval or summary records; is this an aceso train --log-file log?")
    return TrainingLog([train[i] for i in sorted(train)], [evals[i] for i in sorted(evals)], summary)


def draw(out: Target, log: TrainingLog, title: str) -> None:
    from . import pyplot
    plt = pyplot()
    fig = plt.figure(figsize=(WIDTH_IN, HEIGHT_IN), dpi=DPI)
    W, H = WIDTH_IN, HEIGHT_IN
    box = (1.45 / H, 2.95 / H)       # below the axes: tick labels, axis label, the step-time legend
    ax_l = fig.add_axes((0.75 / W, box[0], 3.75 / W, box[1]))
    ax_t = fig.add_axes((5.3 / W, box[0], 3.75 / W, box[1]))
    ax_m = fig.add_axes((9.85 / W, box[0], 3.95 / W, box[1]))
    _loss(ax_l, log)
    _step_time(ax_t, log)
    _memory(ax_m, log.summary)
    fig.suptitle(title, x=0.12 / W, ha="left", fontsize=11, y=1 - 0.12 / H, va="top")
    save(fig, out)


def _loss(ax, log: TrainingLog) -> None:
    if log.train:
        ax.plot([r["iteration"] for r in log.train], [r["loss"] for r in log.train], color="#4e79a7",
                marker="o" if len(log.train) <= 60 else None, markersize=3, linewidth=1.2, label="train")
    if log.evals:
        ax.plot([r["iteration"] for r in log.evals], [r["loss"] for r in log.evals], color="#e15759", marker="s",
                markersize=5, linewidth=1.2, label="validation")
    _iterations(ax)
    ax.set_ylabel("loss (per token)")
    ax.set_title("loss", fontsize=10, loc="left")
    if log.train or log.evals:
        ax.legend(fontsize=8, frameon=False)
    else:
        ax.text(0.5, 0.5, "no train records (a run shorter than --log-interval)", ha="center", va="center",
                transform=ax.transAxes, fontsize=9, color="#555555")
    ax.grid(color="#dddddd", linewidth=0.6)


def _step_time(ax, log: TrainingLog) -> None:
    rows = [r for r in log.train if isinstance(r.get("iteration_time_ms"), (int, float))]
    if rows:
        ax.plot([r["iteration"] for r in rows], [r["iteration_time_ms"] for r in rows], color="#59a14f",
                marker="o" if len(rows) <= 60 else None, markersize=3, linewidth=1.2,
                label="logged (mean over each log interval)")
    s = log.summary or {}
    top = max([r["iteration_time_ms"] for r in rows] + [1.0])
    for key, color, name in (("measured_iteration_time_ms", "#59a14f", "measured mean (steps after the first)"),
                             ("predicted_iteration_time_ms", "#4e79a7", "predicted by the plan's cost model")):
        v = s.get(key)
        if isinstance(v, (int, float)) and v == v:
            ax.axhline(v, color=color, linestyle="--" if key.startswith("predicted") else ":", linewidth=1.3,
                       label=f"{name}: {v:,.1f} ms")
            top = max(top, v)
    ax.set_ylim(0, top * 1.12)
    _iterations(ax)
    ax.set_ylabel("iteration time (ms)")
    ax.set_title("step time", fontsize=10, loc="left")
    if ax.get_legend_handles_labels()[0]:      # under the axes: never over the lines it explains
        ax.legend(fontsize=7.5, frameon=False, loc="upper left", bbox_to_anchor=(0.0, -0.2), borderaxespad=0.0)
    ax.grid(color="#dddddd", linewidth=0.6)


def _memory(ax, summary: dict | None) -> None:
    """Grouped bars: per stage the predicted and the measured max memory (GiB)."""
    import numpy as np
    ax.set_title("memory per stage: predicted vs measured", fontsize=10, loc="left")
    measured = (summary or {}).get("measured_stage_memory_mib") or []
    predicted = (summary or {}).get("predicted_stage_memory_mib") or []
    S = max(len(measured), len(predicted))
    if not S:
        ax.text(0.5, 0.5, "no summary record in the log\n(the run did not finish)", ha="center", va="center",
                transform=ax.transAxes, fontsize=9, color="#555555")
        ax.set_xticks([])
        ax.set_yticks([])
        return
    x = np.arange(S)
    w = 0.38
    gb = max(predicted + measured) >= 1024      # GiB, or MiB for small runs (CPU tests)
    scale, unit = (1024.0, "GiB") if gb else (1.0, "MiB")
    if predicted:
        ax.bar(x[:len(predicted)] - w / 2, np.asarray(predicted) / scale, w, color="#4e79a7", label="predicted")
    if measured:
        ax.bar(x[:len(measured)] + w / 2, np.asarray(measured) / scale, w, color="#f28e2b", label="measured")
    shapes = (summary or {}).get("stage_shapes") or []      # logs before stage_shapes: the index alone
    names = [f"stage {i}\n{shapes[i]}" if i < len(shapes) and S <= 8 else str(i) for i in range(S)]
    ax.set_xticks(x, names, fontsize=8 if S <= 16 else 6)
    ax.set_xlim(-0.5 - max(0.0, (4 - S) / 4), S - 0.5 + max(0.0, (4 - S) / 4))   # few stages: narrow bars
    ax.set_xlabel("stage" if S > 8 or not shapes else "")
    ax.set_ylabel(f"{unit} per GPU (max over the stage's ranks)")
    if not predicted:
        ax.text(0.02, 0.97, "the plan carries no prediction", transform=ax.transAxes, fontsize=8, va="top",
                color="#555555")
    if summary.get("memory_kind") == "cpu_max_rss":
        ax.text(0.0, -0.3, "CPU run: measured = the process's max RSS (not comparable)",
                transform=ax.transAxes, fontsize=7.5, color="#555555", va="top")
    ax.legend(fontsize=8, frameon=False)
    ax.grid(axis="y", color="#dddddd", linewidth=0.6)
    ax.set_axisbelow(True)


def _iterations(ax) -> None:
    from matplotlib.ticker import MaxNLocator
    ax.set_xlabel("iteration")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def title_of(log: TrainingLog, source: str) -> str:
    last = log.train[-1] if log.train else None
    parts = [f"training run: {source}"]
    if last:
        parts.append(f"{last['iteration']} iterations, last train loss {last['loss']:.4f}")
        if isinstance(last.get("tokens_per_s"), (int, float)):
            parts.append(f"{last['tokens_per_s']:,.0f} tokens/s")
        if isinstance(last.get("tflops_per_gpu"), (int, float)):
            parts.append(f"{last['tflops_per_gpu']:.2f} TFLOP/s per GPU")
    if log.evals:
        parts.append(f"last validation loss {log.evals[-1]['loss']:.4f}")
    return "; ".join(parts)
