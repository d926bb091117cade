"""Argument helpers shared by subcommands: model/cluster/training options and output writing."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from ..cluster import ClusterSpec, parse_cluster
from ..errors import AcesoError
from ..model import ModelSpec
from ..presets import load_model


def add_model_args(p: argparse.ArgumentParser, required: bool = True) -> None:
    p.add_argument("--model", required=required, help="preset name (see `aceso models`) or a spec file")
    p.add_argument("--num-layers", type=int, default=None, help="override the preset's depth")


def add_cluster_args(p: argparse.ArgumentParser, required: bool = True) -> None:
    p.add_argument("--cluster", required=required, help="NODESxGPUS-gpu, e.g. 1x8-h100 (see `aceso clusters`)")
    p.add_argument("--memory-limit-mb", type=float, default=None, help="per-GPU memory budget in MB")


def model_from_args(args: argparse.Namespace) -> ModelSpec:
    return load_model(args.model, num_layers=args.num_layers)


def cluster_from_args(args: argparse.Namespace) -> ClusterSpec:
    return parse_cluster(args.cluster, memory_limit_mb=args.memory_limit_mb)


def write_output(text: str, dest: str | None) -> None:
    """Write ``text`` to ``dest`` atomically (``-`` or None: stdout); never leaves a half-written file."""
    if dest in (None, "-"):
        sys.stdout.write(text)
        return
    path = Path(dest)
    if path.parent and not path.parent.exists():
        raise AcesoError(f"-o {dest}: folder {path.parent} does not exist; create it first")
    fd, tmp = tempfile.mkstemp(dir=path.parent or ".", prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def print_json(obj) -> None:
    sys.stdout.write(json.dumps(obj, indent=2) + "\n")
