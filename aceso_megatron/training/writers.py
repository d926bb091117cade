"""TensorBoard and Weights & Biases scalars of ``aceso train``, under Megatron-LM's names and flags.

``--tensorboard-dir DIR`` writes event files with ``torch.utils.tensorboard.SummaryWriter`` (as Megatron-LM's
``global_vars._set_tensorboard_writer``; needs the ``tensorboard`` package: ``pip install -e ".[tensorboard]"``).
``--wandb-project P --wandb-exp-name N`` logs the same scalars with ``wandb.log`` (as Megatron-LM's
``_set_wandb_writer``: run name N, config = the arguments, files under ``--wandb-save-dir``, default
``SAVE/wandb``; needs ``wandb``, an optional extra, never required otherwise). Only the writing rank (the last)
opens them. The scalars, every ``--log-interval`` steps, with Megatron-LM's names (``training.py``
``training_log``/``evaluate_and_print_results``):

==============================  ===============================================================
``lm loss``                     the step's mean per-token loss
``learning-rate``               the step's learning rate
``grad-norm``                   the gradient norm before clipping
``iteration-time``              mean seconds per step over the interval
``throughput``                  model TFLOP/s per GPU (Megatron-LM's ``--log-throughput``)
``batch-size``                  the global batch, samples
``mem-max-allocated-bytes``     per stage (``.../stage-I``): CUDA max allocated; on CPU ``mem-max-rss-bytes``
``lm loss validation`` (+ppl)   at each evaluation
==============================  ===============================================================
"""

from __future__ import annotations

import argparse
import importlib.util
import os

from search.io.errors import AcesoError


def check_args(args: argparse.Namespace) -> None:
    """Torch-free checks of the writer flags (``aceso launch`` runs them before any process starts)."""
    from search.io.files import check_output_folder

    check_output_folder(getattr(args, "tensorboard_dir", None), "--tensorboard-dir")
    check_output_folder(getattr(args, "wandb_save_dir", None), "--wandb-save-dir")
    if getattr(args, "tensorboard_dir", None):
        if importlib.util.find_spec("tensorboard") is None:
            raise AcesoError("--tensorboard-dir needs the tensorboard package: pip install -e \".[tensorboard]\" "
                             "(or pip install tensorboard)")
    if getattr(args, "wandb_project", None):
        if not args.wandb_exp_name:
            raise AcesoError("--wandb-project needs --wandb-exp-name NAME (the run's name, as Megatron-LM)")
        if importlib.util.find_spec("wandb") is None:
            raise AcesoError("--wandb-project needs the wandb package: pip install -e \".[wandb]\" (or pip install "
                             "wandb)")
    elif getattr(args, "wandb_exp_name", None):
        raise AcesoError("--wandb-exp-name needs --wandb-project PROJECT")


class Writers:
    """The open TensorBoard writer and W&B run of the writing rank (none elsewhere or without the flags)."""

    def __init__(self, args: argparse.Namespace, is_writer: bool) -> None:
        self.tb = self.wandb = None
        if not is_writer:
            return
        if getattr(args, "tensorboard_dir", None):
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=args.tensorboard_dir)
        if getattr(args, "wandb_project", None):
            import wandb

            save_dir = args.wandb_save_dir or (os.path.join(args.save, "wandb") if args.save else None)
            if save_dir:
                os.makedirs(save_dir, exist_ok=True)
            wandb.init(project=args.wandb_project, name=args.wandb_exp_name, dir=save_dir,
                       config={k: v for k, v in vars(args).items() if not callable(v)})
            self.wandb = wandb

    def scalars(self, iteration: int, values: dict[str, float]) -> None:
        if self.tb is not None:
            for k, v in values.items():
                self.tb.add_scalar(k, v, iteration)
        if self.wandb is not None:
            self.wandb.log(values, step=iteration)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
        self.tb = self.wandb = None


def train_scalars(rec: dict, global_batch_size: int, device: str) -> dict[str, float]:
    """Megatron-LM's scalar names for one ``{"kind": "train"}`` log record."""
    mem = "mem-max-allocated-bytes" if device == "cuda" else "mem-max-rss-bytes"
    out = {"lm loss": rec["loss"], "learning-rate": rec["lr"], "grad-norm": rec["grad_norm"],
           "iteration-time": rec["iteration_time_ms"] / 1e3, "throughput": rec["tflops_per_gpu"],
           "batch-size": float(global_batch_size)}
    out.update({f"{mem}/stage-{i}": mb * 2**20 for i, mb in enumerate(rec["stage_max_memory_mib"])})
    return out
