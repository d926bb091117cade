"""Pictures of plans, searches and training runs (``--plot`` on explain/search/train/launch, ``aceso plot``).

Every picture is drawn from data the rest of the project already computes, gathered by a pure, matplotlib-free
function that the tests check (``timeline.boxes``, ``memory.segments``, ``search_progress.progress``,
``training.read_log``); the drawing functions only lay those out. matplotlib is an optional extra
(``pip install -e ".[plot]"``) imported only when a picture is drawn, always with the Agg backend (no display
needed); without it ``--plot`` is one line and exit 2 before any work starts (``target``).

Output: the format comes from the file extension (png, svg, pdf) unless ``--plot-format`` says otherwise; the file
is written under a temporary name and renamed, so a failed drawing leaves nothing half-written. Sizes are fixed
(``DPI`` and each figure's inches), so a PNG is exactly ``inches x DPI`` pixels.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from search.io.errors import AcesoError

FORMATS = ("png", "svg", "pdf")
DPI = 100
INSTALL_HINT = 'pip install -e ".[plot]" (or pip install matplotlib)'

# one colour per kind of box or bar, shared by every picture (Tableau 10: distinguishable, colour-blind safe-ish)
COLORS = {
    "forward": "#4e79a7", "backward": "#59a14f", "recompute": "#f28e2b", "p2p": "#e15759", "tp_comm": "#b07aa1",
    "cp_comm": "#ff9da7", "dp_comm": "#9c755f", "sync": "#9c755f", "optimizer": "#bab0ac", "step": "#bab0ac",
    "param_gather": "#edc948",
}
FALLBACK = ("#76b7b2", "#edc948", "#ff9da7", "#b07aa1", "#86bcb6", "#d37295")


@dataclass(frozen=True)
class Target:
    """Where a picture goes and in which format."""

    path: Path
    fmt: str


def add_arguments(p: argparse.ArgumentParser, what: str) -> None:
    """``--plot FILE`` and ``--plot-format`` for a subcommand; ``what`` says what the picture shows."""
    p.add_argument("--plot", metavar="FILE", default=None,
                   help=f"draw {what} to FILE (.png, .svg or .pdf; needs matplotlib: {INSTALL_HINT})")
    p.add_argument("--plot-format", choices=FORMATS, default=None,
                   help="image format of --plot (default: from the file extension)")


def target(path: str | None, fmt: str | None = None, option: str = "--plot", matplotlib: bool = True) -> Target | None:
    """The checked output of ``--plot`` (None when not asked for): a file that can be written (``search.io.files``), a
    known format, and (``matplotlib``) matplotlib importable. Raises ``AcesoError`` (one line, exit 2) otherwise;
    call it before any long work."""
    if path is None:
        return None
    from search.io.files import check_output
    if not path.strip() or path == "-":
        raise AcesoError(f"{option} {path!r}: give an image file name (e.g. {option} out.png); a picture cannot go "
                         "to stdout")
    check_output(path, option)      # a folder, a missing or unwritable folder: one line
    p = Path(path)
    ext = p.suffix.lower().lstrip(".")
    fmt = fmt or ext
    if fmt not in FORMATS:
        raise AcesoError(f"{option} {path}: unknown image format {('.' + ext) if ext else '(no extension)'}; "
                         f"end the name in .png, .svg or .pdf or give --plot-format")
    if matplotlib:
        pyplot()
    return Target(p, fmt)


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend, or ``AcesoError`` saying how to install it."""
    try:
        import matplotlib
    except ImportError:
        raise AcesoError(f"--plot needs matplotlib, which is not installed; install it with {INSTALL_HINT}") from None
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    return plt


def save(fig, out: Target, option: str = "--plot") -> None:
    """Write ``fig`` to ``out`` and close it: a regular file through a temporary file beside it and a rename (the
    replaced file's permissions kept), a device or FIFO in place (``search.io.files``' rules)."""
    from search.io.files import _in_place
    plt = pyplot()
    dest = str(out.path)
    kw = {"format": out.fmt, "dpi": DPI, "metadata": _metadata(out.fmt)}
    try:
        if _in_place(dest):
            fig.savefig(dest, **kw)
            return
        target = os.path.realpath(dest)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(target) or ".", prefix=f".{os.path.basename(target)}.",
                                   suffix=f".{out.fmt}")
        os.close(fd)
        try:
            fig.savefig(tmp, **kw)
            if os.path.exists(target):
                os.chmod(tmp, os.stat(target).st_mode & 0o7777)
            else:
                umask = os.umask(0)
                os.umask(umask)
                os.chmod(tmp, 0o666 & ~umask)   # mkstemp makes it private; a picture gets the usual permissions
            os.replace(tmp, target)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
    except OSError as e:
        raise AcesoError(f"{option} {dest}: cannot write it ({e.strerror or type(e).__name__}); nothing was written") \
            from None
    finally:
        plt.close(fig)


def _metadata(fmt: str) -> dict:
    """No creation dates: the same input gives the same file bytes (a committed picture does not churn)."""
    if fmt == "png":
        return {"Software": None}
    if fmt == "svg":
        return {"Date": None}
    return {"CreationDate": None, "ModDate": None}


def time_axis(ax, end_ms: float, what: str) -> None:
    """An x axis of milliseconds labelled readably: at most 6 ticks, in seconds from 10 s on (``what (s)``), else
    in ms with thousands separators; so tick labels never run into each other or out of the axes."""
    from matplotlib.ticker import FuncFormatter, MaxNLocator
    secs = end_ms >= 10_000.0
    ax.xaxis.set_major_locator(MaxNLocator(nbins=5, steps=[1, 2, 2.5, 5, 10]))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x / 1000:,.6g}" if secs else f"{x:,.6g}"))
    ax.set_xlabel(f"{what} ({'s' if secs else 'ms'})")


def color_of(kind: str, others: dict[str, str]) -> str:
    """The colour of a box kind: the shared table, else the next fallback colour (stable per kind)."""
    base = kind.removesuffix("_hidden").removesuffix("_exposed")
    if base in COLORS:
        return COLORS[base]
    if kind not in others:
        others[kind] = FALLBACK[len(others) % len(FALLBACK)]
    return others[kind]


# ----- the one call each command makes (nothing happens without --plot) -------------------------------------------
def draw_explain(args, cm, cost, report: dict, plan=None) -> None:
    """``aceso explain --plot``: timeline and memory per stage of ``cost`` (``report``: explain's JSON report)."""
    out = target(getattr(args, "plot", None), getattr(args, "plot_format", None))
    if out is not None:
        from .explain import draw
        draw(out, cm, cost, report, plan)


def draw_search(args, result, base, plan, megatron_ms: float | None = None) -> None:
    """``aceso search --plot``: the accepted moves (``result.moves``) and the final comparison bars: the uniform
    baseline ``base``, the best Megatron-LM-expressible plan's time ``megatron_ms`` (when the search has one) and the
    search's ``plan`` (heterogeneous; with ``args.target`` megatron-lm, the Megatron-LM plan itself)."""
    out = target(getattr(args, "plot", None), getattr(args, "plot_format", None))
    if out is None:
        return
    from .search_progress import comparison, draw
    best_ms = plan.predicted.iteration_time_ms
    cluster = plan.cluster.label if plan.cluster else f"{plan.world_size} GPUs"
    title = (f"aceso search: {plan.model.name} on {cluster}, global batch {plan.global_batch_size}; "
             f"{result.evals} plans evaluated in {result.seconds:.1f} s, {len(result.moves)} accepted moves")
    limit = plan.cluster.memory_mb if plan.cluster else float("nan")
    bars = comparison(base, best_ms, megatron_ms, getattr(args, "target", "aceso"))
    draw(out, [m.as_dict() for m in result.moves], bars, limit, title)


def draw_training(log_file, path: str, fmt: str | None = None, option: str = "--plot") -> None:
    """``aceso plot LOG`` and ``aceso train --plot``: the training picture of the JSON-lines log ``log_file``."""
    out = target(path, fmt, option, matplotlib=False)
    from .training import draw, read_log, title_of
    log = read_log(log_file)        # a bad log is its own line, with or without matplotlib
    pyplot()
    draw(out, log, title_of(log, Path(log_file).name))


def check_training(args) -> None:
    """``aceso train --plot``, before training starts: a valid target, matplotlib present, a log to draw from."""
    if getattr(args, "plot", None) is None:
        return
    target(args.plot, getattr(args, "plot_format", None), matplotlib=False)
    if not getattr(args, "log_file", None):
        raise AcesoError("--plot draws from the run's JSON log: add --log-file FILE (e.g. --log-file train.jsonl)")
    pyplot()


def train_args(args) -> list[str]:
    """``aceso launch --plot``: checked here (before anything starts), then handed to ``aceso train``."""
    if getattr(args, "plot", None) is None:
        return []
    target(args.plot, args.plot_format, matplotlib=False)   # matplotlib: with the train arguments' checks
    return ["--plot", args.plot] + (["--plot-format", args.plot_format] if args.plot_format else [])
