"""Argument helpers shared by subcommands: model/cluster/training options and output writing (``search.io.files``:
checked before the work, atomic for regular files, in place for devices and FIFOs, one line on failure)."""

from __future__ import annotations

import argparse
import json
import sys

from search.io.argtypes import headroom, positive_float, positive_int
from search.spec.cluster import ClusterSpec, parse_cluster
from search.io.files import check_output, write_output, write_outputs  # noqa: F401  (re-exported for the subcommands)
from search.spec.model import ModelSpec
from search.spec.presets import load_model


def add_model_args(p: argparse.ArgumentParser, required: bool = True) -> None:
    p.add_argument("--model", required=required, help="preset name (see `aceso models`) or a spec file")
    p.add_argument("--num-layers", type=positive_int, default=None, help="override the preset's depth")


def add_cluster_args(p: argparse.ArgumentParser, required: bool = True) -> None:
    p.add_argument("--cluster", required=required, help="NODESxGPUS-gpu, e.g. 1x8-h100 (see `aceso clusters`)")
    add_gpu_file_arg(p)
    add_memory_limit_arg(p)
    add_headroom_arg(p)


def add_gpu_file_arg(p: argparse.ArgumentParser) -> None:
    """``--gpu-file FILE`` (repeatable): GPU records added to the presets before the command runs (docs/gpus.md)."""
    p.add_argument("--gpu-file", action="append", default=None, metavar="FILE",
                   help="a GPU record (JSON, docs/gpus.md) whose name --cluster and plans may use; repeatable")


def add_memory_limit_arg(p: argparse.ArgumentParser, help: str = "per-GPU memory budget in MiB (2^20 bytes)") -> None:
    """``--memory-limit-mib``; its old name ``--memory-limit-mb`` (the same MiB number) still works, unlisted."""
    p.add_argument("--memory-limit-mib", type=positive_float, default=None, dest="memory_limit_mb", help=help)
    p.add_argument("--memory-limit-mb", type=positive_float, dest="memory_limit_mb", help=argparse.SUPPRESS)


def add_headroom_arg(p: argparse.ArgumentParser) -> None:
    from ..costmodel.memory import DEFAULT_HEADROOM
    p.add_argument("--memory-headroom", type=headroom, default=DEFAULT_HEADROOM,
                   help=f"share of each GPU's memory a plan must leave free (default {DEFAULT_HEADROOM:g}: NCCL "
                        "buffers, allocator fragmentation; docs/costmodel.md Memory)")


def add_release_arg(p: argparse.ArgumentParser) -> None:
    """``--release``: the software release priced (``search/settings/releases.py``; default the newest container)."""
    from search.settings.releases import NAMES, NEWEST
    p.add_argument("--release", default=None, metavar="RELEASE",
                   help=f"the NeMo / Megatron-Bridge container ({', '.join(NAMES)}) or megatron-core / Megatron-LM "
                        f"version (0.16, core_v0.17.0) whose kernels to price (default: the newest, {NEWEST}; "
                        "docs/costmodel.md, releases)")


def release_of(args: argparse.Namespace) -> str | None:
    """``--release`` checked (one line naming the option on a bad value), or None."""
    r = getattr(args, "release", None)
    if r is None:
        return None
    from search.io.errors import AcesoError
    from search.settings.releases import resolve
    try:
        resolve(r)
    except AcesoError as e:
        raise AcesoError(f"--{e}") from None
    return r


def add_calibration_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--calibration", default=None, metavar="FILE",
                   help="price on the GPUs and links your own runs measured (a file of `aceso calibrate`)")


def calibrated(args: argparse.Namespace, cluster: ClusterSpec | None) -> ClusterSpec | None:
    """``cluster`` with ``--calibration FILE`` applied (search.costmodel.calibration.apply_calibration); as is without one."""
    path = getattr(args, "calibration", None)
    if path is None or cluster is None:
        return cluster
    from search.costmodel.calibration import apply_calibration, load_calibration
    return apply_calibration(cluster, load_calibration(path))


def add_megatron_version_arg(p: argparse.ArgumentParser, what: str) -> None:
    from ..megatron.versions import tags
    known = tags()
    p.add_argument("--megatron-version", default=None, metavar="VERSION",
                   help=f"the Megatron-LM release {what}: {', '.join(known)} (or 0.NN; default the newest, "
                        f"{known[-1]}); its flags, defaults and rules (docs/megatron.md)")


def model_from_args(args: argparse.Namespace) -> ModelSpec:
    return load_model(args.model, num_layers=args.num_layers)


def cluster_from_args(args: argparse.Namespace) -> ClusterSpec:
    return calibrated(args, parse_cluster(args.cluster, memory_limit_mb=args.memory_limit_mb))


def print_json(obj) -> None:
    """``obj`` as JSON; numpy scalars (a cost model's ``np.bool_``, ``np.float64``) as their Python values."""
    sys.stdout.write(json.dumps(obj, indent=2, default=_plain) + "\n")


def _plain(o):
    if hasattr(o, "item") and callable(o.item):
        return o.item()
    raise TypeError(f"Object of type {type(o).__name__} is not JSON serializable")


def print_rows(title: str, rows: list[dict], left: tuple[str, ...] = (), footer: str | None = None) -> None:
    """``rows`` (dicts with the same keys) as a table on stdout, one row per line and every cell whole at any
    terminal or pipe width (None is '-', lists and dicts their items): a cut cell such as "llama3…" can stand for
    two values. Columns in ``left`` are left-aligned, the rest right-aligned."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    def text(v) -> str:
        return "-" if v is None else ", ".join(map(str, v)) if isinstance(v, (list, dict)) else str(v)

    cells = [[text(v) for v in r.values()] for r in rows]
    t = Table(title=title, box=box.SIMPLE_HEAD)
    for i, col in enumerate(rows[0]):
        t.add_column(col, justify="left" if col in left else "right", no_wrap=True,
                     min_width=max(len(col), *(len(c[i]) for c in cells)))
    for c in cells:
        t.add_row(*c)
    con = Console(width=1000, soft_wrap=True)
    con.print(t)
    if footer:
        con.print(footer)
