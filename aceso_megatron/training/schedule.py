"""The learning-rate schedule of ``aceso train`` and how a resumed run reconciles it with its checkpoint.

megatron-core's ``OptimizerParamScheduler``: linear warm-up from 0 to ``--lr``, then decay to ``--min-lr``. A
checkpoint stores the schedule's shape beside its step count. Resuming follows Megatron-LM
(``megatron/training/training.py`` ``get_optimizer_param_scheduler`` and the scheduler's ``_check_and_set``):

- neither flag: the command line must describe the checkpoint's schedule; a difference (typically a longer
  ``--train-iters``, which moves the default ``--lr-decay-iters``) is refused before anything is loaded, naming the
  value and both flags -- it would otherwise change the learning rate silently (Megatron-LM asserts);
- ``--override-opt_param-scheduler``: the command line's schedule, continued at the checkpoint's step count (a
  longer ``--train-iters`` stretches the decay: the rate jumps to the new curve);
- ``--use-checkpoint-opt_param-scheduler``: the checkpoint's schedule; the command line's ``--lr`` & co. are ignored.
"""

from __future__ import annotations

import argparse

# (state-dict key, what sets it on the command line)
FIELDS = (("max_lr", "--lr"), ("min_lr", "--min-lr"), ("lr_warmup_steps", "--lr-warmup-iters"),
          ("lr_decay_steps", "--lr-decay-iters (default --train-iters)"), ("lr_decay_style", "--lr-decay-style"),
          ("start_wd", "--weight-decay"), ("end_wd", "--weight-decay"),
          ("wd_incr_style", "constant"))   # wd_incr_steps: no effect with a constant weight decay


def build_scheduler(args: argparse.Namespace, optimizer):
    """megatron-core's ``OptimizerParamScheduler`` over the runtime's optimizer, with the resume policy of the two
    Megatron-LM flags (``args`` may lack them: neither)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    for group in optimizer.param_groups:  # the runtime's optimizer groups carry their own max/min lr
        group["max_lr"], group["min_lr"] = args.lr, args.min_lr
    decay = args.lr_decay_iters or args.train_iters
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=args.lr, min_lr=args.min_lr, lr_warmup_steps=args.lr_warmup_iters,
        lr_decay_steps=decay, lr_decay_style=args.lr_decay_style,
        start_wd=args.weight_decay, end_wd=args.weight_decay, wd_incr_steps=decay, wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=bool(getattr(args, "use_checkpoint_opt_param_scheduler", False)),
        override_opt_param_scheduler=bool(getattr(args, "override_opt_param_scheduler", False)),
    )


def mismatch(saved: dict, scheduler) -> str | None:
    """Why the command line's schedule differs from the checkpoint's, when neither flag settles it; else None."""
    if scheduler.override_opt_param_scheduler or scheduler.use_checkpoint_opt_param_scheduler:
        return None
    for key, flag in FIELDS:
        if key in saved and saved[key] != getattr(scheduler, key):
            return (f"was saved with {key} {saved[key]!r} in its learning-rate schedule but the command line "
                    f"gives {getattr(scheduler, key)!r} ({flag}); add --use-checkpoint-opt_param-scheduler to keep the "
                    "checkpoint's schedule, or --override-opt_param-scheduler to continue on the command line's")
    return None


def load_state(scheduler, saved: dict) -> None:
    """Restore the step count (and, with ``--use-checkpoint-opt_param-scheduler``, the shape) from ``saved``."""
    if saved.get("wd_incr_style") == scheduler.wd_incr_style == "constant":   # older checkpoints: train_iters
        saved = {**saved, "wd_incr_steps": scheduler.wd_incr_steps}
    scheduler.load_state_dict(saved)
    for group in scheduler.optimizer.param_groups:   # the groups' own max/min lr follow the schedule in use
        group["max_lr"], group["min_lr"] = scheduler.max_lr, scheduler.min_lr
    scheduler.step(0)   # the groups' lr again, from those

