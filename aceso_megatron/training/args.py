"""``aceso train``'s arguments, torch-free: the parser (``train_parser``, Megatron-LM's names, ``--config`` YAML) and
every check that needs no torch (``check_train_args``), which ``aceso launch`` runs before starting any process and
every worker (``training.train``) again. The subcommand (``aceso_megatron.cli.train``) adds its entry point.
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

from search.io.argparser import AcesoParser
from search.io.argtypes import nonnegative_float, nonnegative_int, positive_float, positive_int, seed
from search.io.errors import AcesoError

from .checkpoint_files import MARKER as CHECKPOINT_MARKER   # torch-free

from search import plots

from .train_config import ConfigAction


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("plan", help="plan file (from `aceso search`)")
    p.add_argument("--config", action=ConfigAction, default=None, metavar="FILE",
                   help="YAML file of train flags (train-iters: 100, ...); command-line flags override it")
    g = p.add_argument_group("data")
    g.add_argument("--data-path", nargs="+", default=None,
                   help="dataset prefix(es) from `aceso data prepare`, optionally weighted: 0.7 A 0.3 B")
    g.add_argument("--split", default="969,30,1", help="train,valid,test weights (default 969,30,1)")
    g.add_argument("--mock-data", action="store_true", help="synthetic data (megatron-core's mock datasets)")
    g.add_argument("--tokenizer", default="byte", help="tokenizer the data was prepared with: byte or hf:PATH")
    g.add_argument("--data-cache-path", default=None, help="where megatron-core caches dataset indices")
    g = p.add_argument_group("optimizer and schedule")
    g.add_argument("--lr", type=nonnegative_float, default=3e-4, help="peak learning rate (default 3e-4)")
    g.add_argument("--min-lr", type=nonnegative_float, default=0.0,
                   help="learning rate at the end of decay (default 0)")
    g.add_argument("--lr-warmup-iters", type=nonnegative_int, default=0, help="linear warm-up steps from 0 (default 0)")
    g.add_argument("--lr-decay-iters", type=positive_int, default=None, help="decay steps (default --train-iters)")
    g.add_argument("--lr-decay-style", default="cosine",
                   choices=["constant", "linear", "cosine", "inverse-square-root"], help="default cosine")
    g.add_argument("--weight-decay", type=nonnegative_float, default=0.01, help="AdamW weight decay (default 0.01)")
    g.add_argument("--clip-grad", type=nonnegative_float, default=1.0,
                   help="global gradient-norm clip, 0 = off (default 1)")
    g.add_argument("--adam-beta1", type=_beta, default=0.9)
    g.add_argument("--adam-beta2", type=_beta, default=0.95)
    g.add_argument("--init-method-std", type=positive_float, default=None,
                   help="weight init std (default: the model's megatron.init_method_std, else 0.02)")
    g.add_argument("--calculate-per-token-loss", action="store_true",
                   help="divide the loss (and MTP's) by the global batch's token count, not each micro-batch's "
                        "own count (Megatron-LM's flag; the default is its default)")
    g = p.add_argument_group("run")
    g.add_argument("--train-iters", type=positive_int, default=None,
                   help="optimizer steps to train for (required, here or in --config)")
    g.add_argument("--seed", type=seed, default=1234, help="weights, data order and dropout seed (default 1234)")
    g.add_argument("--cpu", action="store_true", help="run on CPU with gloo (fp32)")
    g.add_argument("--log-interval", type=positive_int, default=10, help="steps between log lines (default 10)")
    g.add_argument("--log-file", default=None, help="also write JSON lines (one per log/eval, a summary) here")
    g.add_argument("--eval-interval", type=positive_int, default=None, help="evaluate every N steps (default: never)")
    g.add_argument("--eval-iters", type=positive_int, default=2, help="global batches per evaluation (default 2)")
    g.add_argument("--save", default=None, help="checkpoint folder")
    g.add_argument("--save-interval", type=positive_int, default=None, help="save every N steps (and at the end)")
    g.add_argument("--load", default=None, help="resume from the latest checkpoint in this folder, if any")
    g.add_argument("--no-load-optim", action="store_true",
                   help="--load the weights only (Adam's moments start from zero; any optimizer kind)")
    g.add_argument("--no-load-rng", action="store_true", help="--load without the RNG states (they start from --seed)")
    g.add_argument("--keep-last", type=positive_int, default=None, metavar="N",
                   help="after each save keep only the newest N checkpoints in --save (never the one resumed from)")
    g.add_argument("--exit-signal-handler", action=argparse.BooleanOptionalAction, default=True,
                   help="on SIGTERM/SIGINT finish the step, save (with --save) and exit 143/130 (default on)")
    g.add_argument("--override-opt_param-scheduler", action="store_true",
                   help="resuming: use the command line's learning-rate schedule, not the checkpoint's")
    g.add_argument("--use-checkpoint-opt_param-scheduler", action="store_true",
                   help="resuming: use the checkpoint's learning-rate schedule, ignore --lr & co.")
    plots.add_arguments(g, "the loss, step time and predicted vs measured memory per stage at the end (needs "
                           "--log-file; `aceso plot LOG` redraws it)")
    g = p.add_argument_group("TensorBoard and Weights & Biases (Megatron-LM's names; optional extras)")
    g.add_argument("--tensorboard-dir", default=None, help="write TensorBoard event files here (last rank)")
    g.add_argument("--wandb-project", default=None, help="log to this Weights & Biases project (needs wandb)")
    g.add_argument("--wandb-exp-name", default=None, help="the W&B run's name (needed with --wandb-project)")
    g.add_argument("--wandb-save-dir", default=None, help="W&B's local files (default SAVE/wandb)")


def _beta(text: str) -> float:
    value = nonnegative_float(text)
    if value >= 1:
        raise argparse.ArgumentTypeError(f"{text} must be below 1")
    return value


class _TrainArgParser(AcesoParser):
    """``aceso train``'s parser for ``aceso launch``: an error is an ``AcesoError`` line, not an exit."""

    def error(self, message: str) -> None:
        raise AcesoError(f"{self.explain(message)}; see `aceso train --help`")


def train_parser(prog: str = "aceso train", **kw) -> argparse.ArgumentParser:
    """``aceso train``'s arguments in a parser that raises ``AcesoError`` (one line) instead of printing usage."""
    parser = _TrainArgParser(prog=prog, formatter_class=argparse.RawDescriptionHelpFormatter, **kw)
    add_arguments(parser)
    return parser


def parse_train_args(plan: str, argv: list[str]) -> argparse.Namespace:
    """The arguments ``aceso launch PLAN -- ARGV`` hands to every worker, parsed as ``aceso train`` will."""
    try:
        return train_parser(add_help=False).parse_args([plan, *argv])
    except AcesoError as e:
        raise AcesoError(f"the arguments after -- (for aceso train): {e}") from None


def check_train_args(args: argparse.Namespace, plan=None) -> None:
    """Everything about ``aceso train``'s arguments (and, given the ``plan``, their fit to it) that can be checked
    without torch, as one ``AcesoError`` line (``aceso launch`` runs it before starting any process; every worker
    again)."""
    if args.train_iters is None:
        raise AcesoError("the following arguments are required: --train-iters (on the command line or in --config); "
                         "see `aceso train --help`")
    if args.min_lr > args.lr:
        raise AcesoError(f"--min-lr ({args.min_lr}) must not exceed --lr ({args.lr})")
    decay = args.lr_decay_iters or args.train_iters
    if args.lr_warmup_iters >= decay:
        raise AcesoError(f"--lr-warmup-iters ({args.lr_warmup_iters}) must be below the decay steps ({decay})")
    for flag, value in (("--save-interval", args.save_interval), ("--keep-last", args.keep_last)):
        if value is not None and not args.save:
            raise AcesoError(f"{flag} needs --save FOLDER")
    if args.override_opt_param_scheduler and args.use_checkpoint_opt_param_scheduler:
        raise AcesoError("--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler: give one of them")
    if args.mock_data and args.data_path:
        raise AcesoError("--mock-data and --data-path: give one of them")
    if not args.mock_data and not args.data_path:
        raise AcesoError("no training data: give --data-path PREFIX (from `aceso data prepare`) or --mock-data")
    if args.data_path:
        for prefix in data_prefixes(args.data_path):
            _check_prefix(prefix)
        _check_split(args.split)
        _check_tokenizer(args.tokenizer)
        if plan is not None and args.tokenizer == "byte":
            from .tokenizer import ByteTokenizer   # torch-free

            ids = ByteTokenizer().vocab_size
            if plan.model.vocab_size < ids:
                raise AcesoError(f"the plan's model has vocab_size {plan.model.vocab_size} but tokenizer byte has "
                                 f"{ids} ids; make a plan for a model with vocab_size >= {ids}")
    from search.io.files import check_output, check_output_folder

    if args.load is not None and os.path.exists(args.load) and not os.path.isdir(args.load):
        raise AcesoError(f"--load {args.load}: not a folder; give a checkpoint folder")
    for flag, folder in (("--save", args.save), ("--data-cache-path", args.data_cache_path)):
        check_output_folder(folder, flag)
    if args.log_file is not None:

        check_output(args.log_file, "--log-file")
    from .writers import check_args as check_writers   # torch-free

    check_writers(args)
    plots.check_training(args)   # --plot: a known format, a writable target, matplotlib, and a --log-file to draw
    if plan is not None:
        from .fsdp import checkpoint_refusal   # torch-free

        if (msg := checkpoint_refusal(plan, args.save, args.load)) is not None:
            raise AcesoError(msg)
    if args.load:
        _check_resume(args)


def data_prefixes(data_path: list[str]) -> list[str]:
    """The prefixes of ``--data-path`` (``A B`` or the weighted form ``0.7 A 0.3 B``, as megatron-core reads it)."""
    try:
        float(data_path[0])
    except ValueError:
        return list(data_path)
    if len(data_path) % 2:
        raise AcesoError(f"--data-path {' '.join(data_path)}: a weighted blend alternates WEIGHT PREFIX; "
                         "one is missing")
    for w in data_path[::2]:
        try:
            ok = math.isfinite(float(w)) and float(w) >= 0
        except ValueError:
            ok = False
        if not ok:
            raise AcesoError(f"--data-path: weight {w!r} is not a non-negative number (the blend is WEIGHT PREFIX ...)")
    return list(data_path[1::2])


def _check_prefix(prefix: str) -> None:
    for ext in (".bin", ".idx"):
        if prefix.endswith(ext):
            raise AcesoError(f"--data-path {prefix}: give the prefix without {ext}: --data-path {prefix[:-len(ext)]}")
    missing = [ext for ext in (".bin", ".idx") if not os.path.isfile(prefix + ext)]
    if missing:
        raise AcesoError(f"--data-path {prefix}: no {prefix}{missing[0]}; create {prefix}.bin/.idx with "
                         f"`aceso data prepare CORPUS.jsonl -o {prefix}`")


def _check_split(split: str) -> None:
    parts = split.split(",")
    try:
        weights = [float(x) for x in parts]
    except ValueError:
        weights = []
    if not 1 <= len(parts) <= 3 or len(weights) != len(parts) or any(not math.isfinite(w) or w < 0 for w in weights) \
            or sum(weights) <= 0:
        raise AcesoError(f"--split {split}: give up to three non-negative weights train,valid,test, e.g. 969,30,1")


def _check_tokenizer(spec: str) -> None:
    if spec == "byte":
        return
    if spec.startswith("hf:"):
        if not os.path.exists(spec[3:]):
            raise AcesoError(f"--tokenizer {spec}: {spec[3:] or 'the path'} does not exist; give a local Hugging "
                             "Face tokenizer folder")
        return
    raise AcesoError(f"--tokenizer {spec}: unknown tokenizer; use byte or hf:PATH")


def _check_resume(args: argparse.Namespace) -> None:
    """A checkpoint already at ``--train-iters`` would train nothing: say what to raise."""
    marker = Path(args.load) / CHECKPOINT_MARKER
    if not marker.is_file():
        return
    text = marker.read_text(errors="replace").strip()
    if not text.isdigit():
        raise AcesoError(f"--load {args.load}: {CHECKPOINT_MARKER} holds {text[:20]!r}, not an iteration; fix or "
                         "delete it")
    done = int(text)
    if done >= args.train_iters:
        raise AcesoError(f"--load {args.load}: the checkpoint is at iteration {done}, and --train-iters is "
                         f"{args.train_iters}: nothing left to train; raise --train-iters (e.g. --train-iters "
                         f"{done + args.train_iters}) to train on from it")
    from .checkpoint_files import damage_message, damaged_file   # torch-free

    folder = Path(args.load) / f"iter_{done:07d}"
    if not folder.is_dir():
        raise AcesoError(f"--load {args.load}: {CHECKPOINT_MARKER} names iteration {done} but {folder} is missing; "
                         "restore it, or write the iteration of a checkpoint that is there into the marker")
    if (found := damaged_file(folder)) is not None:
        raise AcesoError(damage_message(args.load, done, found))
