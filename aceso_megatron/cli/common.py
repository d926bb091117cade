"""Argument and output helpers of the runtime's subcommands, with the same options and behaviour as the planner's
(``search/cli/common.py``): ``aceso profile --model`` reads like ``aceso search --model``, and ``-o``/``--slurm``
files are written by ``search.io.files`` (checked first, atomic, devices and FIFOs in place). Kept here so that
``aceso_megatron`` never imports the planner's CLI layer.
"""

from __future__ import annotations

import argparse

from search.io.argtypes import positive_int
from search.io.files import check_output, write_output  # noqa: F401  (re-exported for the subcommands)
from search.spec.model import ModelSpec
from search.spec.presets import load_model


def add_model_args(p: argparse.ArgumentParser, required: bool = True) -> None:
    p.add_argument("--model", required=required, help="preset name (see `aceso models`) or a spec file")
    p.add_argument("--num-layers", type=positive_int, default=None, help="override the preset's depth")


def model_from_args(args: argparse.Namespace) -> ModelSpec:
    return load_model(args.model, num_layers=args.num_layers)
