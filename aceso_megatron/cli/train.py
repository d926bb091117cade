"""Train with a plan on megatron-core: data, Adam + LR schedule, logs, evaluation, checkpoints.

  aceso train plan.json --cpu --mock-data --train-iters 20              # a 1-GPU plan, in this process
  aceso launch plan.json --cpu -- --mock-data --train-iters 20          # any plan: one process per GPU
  python -m torch.distributed.run --nproc-per-node 4 -m aceso_megatron.training.train plan.json \
      --data-path data/corpus ...

Argument names follow Megatron-LM. Every --log-interval steps the last stage prints loss, grad norm, learning
rate, iteration time, tokens/s, TFLOP/s per GPU and the max memory of each stage (JSON lines with --log-file);
at the end it prints the plan's predicted iteration time and memory beside the measured ones. --save/--load use
megatron-core dist_checkpointing keyed by canonical names, so a checkpoint of one plan resumes under another;
`latest_checkpointed_iteration.txt` only ever names a complete checkpoint. See docs/train.md.
"""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("plan", help="plan file (from `aceso search`)")
    g = p.add_argument_group("data")
    g.add_argument("--data-path", nargs="+", default=None,
                   help="dataset prefix(es) from `aceso data prepare`, optionally weighted: 0.7 A 0.3 B")
    g.add_argument("--split", default="969,30,1", help="train,valid,test weights (default 969,30,1)")
    g.add_argument("--mock-data", action="store_true", help="synthetic data (megatron-core's mock datasets)")
    g.add_argument("--tokenizer", default="byte", help="tokenizer the data was prepared with: byte or hf:PATH")
    g.add_argument("--data-cache-path", default=None, help="where megatron-core caches dataset indices")
    g = p.add_argument_group("optimizer and schedule")
    g.add_argument("--lr", type=float, default=3e-4, help="peak learning rate (default 3e-4)")
    g.add_argument("--min-lr", type=float, default=0.0, help="learning rate at the end of decay (default 0)")
    g.add_argument("--lr-warmup-iters", type=int, default=0, help="linear warm-up steps from 0 (default 0)")
    g.add_argument("--lr-decay-iters", type=int, default=None, help="decay steps (default --train-iters)")
    g.add_argument("--lr-decay-style", default="cosine",
                   choices=["constant", "linear", "cosine", "inverse-square-root"], help="default cosine")
    g.add_argument("--weight-decay", type=float, default=0.01, help="AdamW weight decay (default 0.01)")
    g.add_argument("--clip-grad", type=float, default=1.0, help="global gradient-norm clip, 0 = off (default 1)")
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.95)
    g.add_argument("--init-method-std", type=float, default=0.02, help="weight init std (default 0.02)")
    g = p.add_argument_group("run")
    g.add_argument("--train-iters", type=int, required=True, help="optimizer steps to train for")
    g.add_argument("--seed", type=int, default=1234, help="weights, data order and dropout seed (default 1234)")
    g.add_argument("--cpu", action="store_true", help="run on CPU with gloo (fp32)")
    g.add_argument("--log-interval", type=int, default=10, help="steps between log lines (default 10)")
    g.add_argument("--log-file", default=None, help="also write JSON lines (one per log/eval, a summary) here")
    g.add_argument("--eval-interval", type=int, default=None, help="evaluate every N steps (default: never)")
    g.add_argument("--eval-iters", type=int, default=2, help="global batches per evaluation (default 2)")
    g.add_argument("--save", default=None, help="checkpoint folder")
    g.add_argument("--save-interval", type=int, default=None, help="save every N steps (and at the end)")
    g.add_argument("--load", default=None, help="resume from the latest checkpoint in this folder, if any")


def run(args: argparse.Namespace) -> int:
    from ..training.train import train_from_args  # torch only when the command runs
    from . import bad_input_from_patches

    with bad_input_from_patches():
        return train_from_args(args)
