"""Train with a plan on megatron-core: data, Adam + LR schedule, logs, evaluation, checkpoints.

  aceso train plan.json --cpu --mock-data --train-iters 20              # a 1-GPU plan, in this process
  aceso launch plan.json --cpu -- --mock-data --train-iters 20          # any plan: one process per GPU
  python -m torch.distributed.run --nproc-per-node 4 -m aceso_megatron.training.train plan.json \
      --data-path data/corpus ...

Argument names follow Megatron-LM. Every --log-interval steps the last stage prints loss, grad norm, learning
rate, iteration time, samples/s, tokens/s per GPU, TFLOP/s per GPU (and MFU on GPUs) and the max memory of each
stage (JSON lines with --log-file); at the end it prints the plan's predicted iteration time and memory beside
the measured ones. --save/--load use megatron-core dist_checkpointing keyed by canonical names, so a checkpoint of
one plan resumes under another;
`latest_checkpointed_iteration.txt` only ever names a complete checkpoint; --keep-last N rotates them, SIGTERM or
Ctrl-C saves after the step under way and exits 143/130, --no-load-optim loads the weights only. --tensorboard-dir
and --wandb-project log Megatron-LM's scalars; --config FILE reads the flags from YAML. See docs/train.md.
"""

from __future__ import annotations

import argparse

from ..training.args import add_arguments, check_train_args  # noqa: F401  (add_arguments: the subcommand's contract)


def preflight(plan, device: str, here: bool = False) -> bool:
    """The runtime's checks of ``search.targets.preflight`` (found through this entry point); imports torch only here.
    False: it could not tell here (see ``aceso_megatron.preflight``)."""
    from ..preflight import preflight as runtime_preflight

    return runtime_preflight(plan, device, here=here)


def run(args: argparse.Namespace) -> int:
    from ..training.train import train_from_args  # torch only when the command runs
    from ..errors import bad_input_from_patches

    from search.spec.plan import load_plan

    check_train_args(args, load_plan(args.plan))
    with bad_input_from_patches():
        return train_from_args(args)
