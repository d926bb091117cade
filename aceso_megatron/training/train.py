"""``aceso train``: pretraining with a plan on megatron-core, one process per GPU
(``python -m aceso_megatron.training.train`` under torchrun, or ``aceso train`` for a 1-GPU plan).

Per process: check the plan against the launch and its model (``model.layers.check_model``: the layer specs and
the megatron block), before any process group exists; start the process group,
build this rank's stage with the runtime plugin (``engine.build_runtime``: its steps -- patches, fast paths,
precision, groups, chunks, DDP on the stage's DP group, megatron-core Adam, schedule -- each printed in one line by
rank 0, ``build_steps``), put megatron-core's ``OptimizerParamScheduler`` on its optimizer, build the datasets
(``data``), resume from ``--load`` (the last build step, ``load_checkpoint``), run the steps, and tear down in
order (``teardown``: hooks, model, buffers and optimizer released, then the process groups destroyed). Logging,
evaluation and the predicted-vs-measured summary are in ``train_log`` (TensorBoard and W&B in ``writers``); checkpoints in ``checkpoint``, the schedule's resume
policy in ``schedule``, the stop on SIGTERM/SIGINT in ``signals`` (all in ``aceso_megatron.training``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
import time
import warnings

from patches.compat import quiet_cuda_build_notices
from search import plots
from search.io.errors import AcesoError
from search.spec.plan import ParallelPlan, load_plan

from .schedule import build_scheduler  # noqa: F401  (tests build the run's scheduler from here)
from .signals import exit_code
from .signals import name as signal_name

quiet_cuda_build_notices()   # a worker on CPU with torch's CUDA build: no import-time notice (patches.compat)
warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
# third-party deprecations a user cannot act on, printed by every rank otherwise: megatron-core 0.16 calls torch
# 2.13's renamed collectives (distributed optimizer) and torch DCP's old load_state_dict (dist_checkpointing load)
THIRD_PARTY_FUTURE_WARNINGS = (r"`torch\.distributed\.reduce_scatter_tensor` is deprecated",
                               r"`torch\.distributed\.all_gather_into_tensor` is deprecated",
                               r"`load_state_dict` is deprecated and will be removed in future versions")


def quiet_third_party_warnings() -> None:
    for message in THIRD_PARTY_FUTURE_WARNINGS:
        warnings.filterwarnings("ignore", category=FutureWarning, message=message)


def _launch_env() -> tuple[int, int, int]:
    """(world size, rank, local rank) from torchrun's environment; (1, 0, 0) without it."""
    return (int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0)),
            int(os.environ.get("LOCAL_RANK", 0)))


def check_args(args: argparse.Namespace, plan: ParallelPlan, world_size: int) -> None:
    """Everything that can be wrong before a process group starts, as one ``AcesoError`` line."""
    if plan.world_size != world_size:
        how = ("start it with `aceso launch PLAN --cpu -- ...` or torchrun" if world_size == 1
               else f"launch {plan.world_size} processes or use a plan for {world_size} GPUs")
        raise AcesoError(
            f"{args.plan}: the plan needs {plan.world_size} processes (sum of stages[].num_gpus) but this launch "
            f"has {world_size}; {how}"
        )
    from .args import check_train_args   # the torch-free checks `aceso launch` ran before starting us

    check_train_args(args, plan)
    if args.load:   # the torch-free checks passed: the tensor index too, before any process group
        from .checkpoint_files import damage_message, damaged_index, marked_folder

        if (marked := marked_folder(args.load)) is not None and (found := damaged_index(marked[1])) is not None:
            raise AcesoError(damage_message(args.load, marked[0], found))
    if not args.cpu:
        import torch

        if not torch.cuda.is_available():
            from ..model.fast_path import no_cuda_message

            raise AcesoError(no_cuda_message(torch))


def init_distributed(world_size: int, rank: int, local_rank: int, cpu: bool) -> None:
    import torch
    import torch.distributed as dist

    from ..parallel.distenv import ensure_rendezvous_env

    ensure_rendezvous_env()
    if not cpu:
        torch.cuda.set_device(local_rank)
    dist.init_process_group("gloo" if cpu else "nccl", rank=rank, world_size=world_size)


def _train_config(args: argparse.Namespace):
    from .engine import TrainConfig

    wanted = dict(lr=args.lr, weight_decay=args.weight_decay, clip_grad=args.clip_grad, adam_beta1=args.adam_beta1,
                  adam_beta2=args.adam_beta2, init_method_std=args.init_method_std,
                  calculate_per_token_loss=args.calculate_per_token_loss)
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    return TrainConfig(**{k: v for k, v in wanted.items() if k in names})


def train(args: argparse.Namespace, plan: ParallelPlan, rank: int) -> dict:
    """The training loop of this rank; returns the summary (on every rank) and ``stopped_by``: the signal that
    ended it early (``signals``), else 0."""
    from .build_steps import show_build_steps
    from .engine import build_runtime
    from .teardown import release

    device = "cpu" if args.cpu else "cuda"
    show_build_steps()   # the build's steps, one line each from rank 0 (engine.build_runtime), then `checkpoint`
    rt = build_runtime(plan, rank, plan.world_size, seed=args.seed, device=device, train_config=_train_config(args))
    try:
        return _steps(args, plan, rt, device)
    finally:
        release(rt)   # hooks, model, buffers and optimizer dropped however the run ends (teardown)


def _steps(args: argparse.Namespace, plan: ParallelPlan, rt, device: str) -> dict:
    """``train``'s data, resume and steps on the built runtime ``rt``."""
    from . import checkpoint
    from .data import BatchSource, DataConfig, batch_keys, build_datasets, num_samples_needed
    from .signals import ExitSignal
    from .train_log import TrainLogger, evaluate

    scheduler = build_scheduler(args, rt.optimizer)
    data_cfg = DataConfig(data_path=args.data_path, split=args.split, mock=args.mock_data,
                          tokenizer=args.tokenizer, seed=args.seed, cache_dir=args.data_cache_path)
    evals = args.eval_iters if args.eval_interval else 0
    train_ds, valid_ds, _ = build_datasets(plan.model, data_cfg,
                                           num_samples_needed(args.train_iters, evals, plan.global_batch_size))
    keys = batch_keys(plan.model)
    train_src = BatchSource(train_ds, plan.global_batch_size, plan.micro_batch_size, keys)
    valid_src = BatchSource(valid_ds, plan.global_batch_size, plan.micro_batch_size, keys) if evals else None
    start, loaded = 0, load_checkpoint(args, rt, scheduler)
    log = TrainLogger(args, plan, rt, device)
    if loaded:
        start = loaded[0]
        how = "" if loaded[1] else " (written under another plan: re-sharded; RNG states start from --seed)"
        how += " (weights only: Adam's moments start from zero)" if args.no_load_optim else ""
        how += " (RNG states from --seed)" if args.no_load_rng and loaded[1] else ""
        log.message(f"resumed from {args.load} at iteration {start}{how}")
    protect = start if loaded and args.save and _same_folder(args.save, args.load) else None
    save_kw = dict(keep_last=args.keep_last, protect=protect)
    saved, done, stop = start, args.train_iters, 0
    with ExitSignal(device) if args.exit_signal_handler else contextlib.nullcontext() as signals:
        for it in range(start, args.train_iters):
            lr = scheduler.get_lr(rt.optimizer.param_groups[0])
            t0 = time.perf_counter()
            loss = rt.train_step(iter(train_src.micro_batches(it)))
            scheduler.step(1)
            log.step(it + 1, loss, rt.last_grad_norm, lr, time.perf_counter() - t0)
            if valid_src is not None and (it + 1) % args.eval_interval == 0:
                log.eval(it + 1, evaluate(rt, [valid_src.micro_batches(k) for k in range(args.eval_iters)]))
            if args.save and args.save_interval and (it + 1) % args.save_interval == 0:
                log.message(f"saved checkpoint {checkpoint.save(args.save, it + 1, rt, scheduler, **save_kw)}")
                saved = it + 1
            if args.exit_signal_handler and (stop := signals.agreed()):
                done = it + 1
                break
        if args.save and saved < done:
            log.message(f"saved checkpoint {checkpoint.save(args.save, done, rt, scheduler, **save_kw)}")
        if args.exit_signal_handler and not stop:   # a signal after the last step (the final save): done, and 143
            stop = signals.agreed()
    if stop:
        log.message(_stopped(args, stop, done))
    return {**log.summary(), "stopped_by": stop}


def load_checkpoint(args: argparse.Namespace, rt, scheduler):
    """The last build step: ``--load``'s checkpoint into the runtime and the scheduler (``checkpoint.load``: the
    iteration and whether it was written under this plan), or None without ``--load``; one line on rank 0."""
    from . import checkpoint
    from .build_steps import log_step

    if not args.load:
        log_step("checkpoint", "none loaded (no --load): initialised weights, Adam's moments at zero")
        return None
    loaded = checkpoint.load(args.load, rt, scheduler, load_optim=not args.no_load_optim,
                             load_rng=not args.no_load_rng)
    if not loaded:
        log_step("checkpoint", f"none in {args.load}: initialised weights, Adam's moments at zero")
        return loaded
    parts = ["weights"] + ([] if args.no_load_optim else ["optimizer"]) + ["scheduler"]
    parts += [] if args.no_load_rng or not loaded[1] else ["RNG states"]
    how = "" if loaded[1] else ", re-sharded from another plan"
    log_step("checkpoint", f"{', '.join(parts)} loaded from {args.load} at iteration {loaded[0]}{how}")
    return loaded


def _same_folder(a: str, b: str) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)


def _stopped(args: argparse.Namespace, signum: int, iteration: int) -> str:
    """The line a run stopped by a signal ends with: where it stopped and how to go on."""
    head = f"stopped by {signal_name(signum)} after iteration {iteration}/{args.train_iters}"
    if iteration >= args.train_iters:
        return head + (f" (the last); saved {args.save}" if args.save else " (the last)")
    if not args.save:
        return f"{head}; nothing saved (no --save): restart with --save FOLDER to keep progress"
    load = "" if args.load and _same_folder(args.load, args.save) else f" with --load {args.save} added"
    return f"{head}; saved {args.save}; resume with the same command{load}"


def train_from_args(args: argparse.Namespace) -> int:
    """Run training for parsed ``aceso train`` arguments; raises ``AcesoError`` on bad input."""
    quiet_third_party_warnings()
    world_size, rank, local_rank = _launch_env()
    plan = load_plan(args.plan)
    check_args(args, plan, world_size)
    from search.targets.preflight import preflight

    preflight(plan, "cpu" if args.cpu else "cuda", here=True, target="aceso")   # the one pre-flight, before groups
    plots.check_training(args)   # before training: a bad --plot or no matplotlib is exit 2 now, not at the end
    from .teardown import destroy_groups

    init_distributed(world_size, rank, local_rank, args.cpu)
    try:
        stop = train(args, plan, rank)["stopped_by"]
    finally:
        destroy_groups()   # after train released the runtime: megatron-core's groups, then torch's (teardown)
    if getattr(args, "plot", None) and rank == world_size - 1:   # the rank that wrote the log
        plots.draw_training(args.log_file, args.plot, args.plot_format)
    return exit_code(stop) if stop else 0


def main(argv: list[str] | None = None) -> int:
    from ..errors import bad_input_from_patches
    from .args import train_parser

    parser = train_parser("python -m aceso_megatron.training.train", description=__doc__)
    try:
        args = parser.parse_args(argv)
        with bad_input_from_patches():
            return train_from_args(args)
    except AcesoError as e:
        from ..errors import report_bad_input

        report_bad_input(e, "aceso train", rank=_launch_env()[1])   # one line for the whole job
        return e.exit_code


if __name__ == "__main__":
    sys.exit(main())
