"""Argument and output helpers of the runtime's subcommands, with the same options and behaviour as the planner's
(``search/cli/common.py``): ``aceso profile --model`` reads like ``aceso search --model``, and ``-o``/``--slurm``
files are written atomically. Kept here so that ``aceso_megatron`` never imports the planner's CLI layer.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from search.errors import AcesoError
from search.model import ModelSpec
from search.presets import load_model


def add_model_args(p: argparse.ArgumentParser, required: bool = True) -> None:
    p.add_argument("--model", required=required, help="preset name (see `aceso models`) or a spec file")
    p.add_argument("--num-layers", type=int, default=None, help="override the preset's depth")


def model_from_args(args: argparse.Namespace) -> ModelSpec:
    return load_model(args.model, num_layers=args.num_layers)


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
