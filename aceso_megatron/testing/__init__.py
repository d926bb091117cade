"""Multi-process helpers for tests and benchmarks: spawn one process per rank on a free port (gloo, CPU).

``spawn(world_size, fn, *args)`` starts ``world_size`` processes with ``torch.multiprocessing`` that each
initialise a gloo group and call ``fn(rank, world_size, *args)`` (nanotron's idea of a decorator that spawns
ranks, as a function). The ranks are forked from one forkserver per test session that imported torch,
megatron-core and the runtime once (``PRELOAD``), so a rank does not pay that import (~5 s CPU) again; like
"spawn", each rank starts from a clean interpreter state (nothing the parent patched or initialised), with the
parent's environment and working directory as they are at the call; a rank ends as ``aceso train`` does
(``training.teardown.destroy_groups``: megatron-core's groups, then torch's). ``run_plans`` is the worker the
distributed tests use: several plans per process group, so building and tearing down groups is paid once; each
plan's runtime is released (``teardown.release``) before the next is built.
The single-process stock reference the runtime is tested against is ``testing.reference``.
"""

from __future__ import annotations

import atexit
import multiprocessing.forkserver
import os
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from multiprocessing.reduction import DupFd


from ..parallel.distenv import free_port  # noqa: F401  (re-exported for tests)


# imported once by the forkserver the ranks are forked from (what every rank would otherwise import itself)
PRELOAD = ["torch", "torch.distributed", "megatron.core", "megatron.core.models.gpt", "megatron.core.models.T5",
           "megatron.core.optimizer", "megatron.core.distributed", "aceso_megatron.training.engine",
           "aceso_megatron.testing.reference", "aceso_megatron.testing.frozen"]
_forkserver_started = False


def _context():
    """The forkserver start method, preloaded with ``PRELOAD``; the server is stopped (and waited for, so its
    ranks' CPU time is the session's) when this process exits."""
    global _forkserver_started
    if not _forkserver_started:
        mp.set_forkserver_preload(PRELOAD)
        atexit.register(multiprocessing.forkserver._forkserver._stop)
        _forkserver_started = True
    return "forkserver"


class _Stdio:
    """The caller's stdout and stderr (e.g. pytest's capture): pickled for a forked process, its descriptors go
    with the fork request, and ``attach()`` there puts them on fds 1 and 2."""

    def __init__(self, dups=None):
        self.dups = dups

    def __reduce__(self):   # called while the process is being started: DupFd sends the fd along
        return _Stdio, ((DupFd(1), DupFd(2)),)

    def attach(self) -> None:
        for fd, dup in zip((1, 2), self.dups):
            new = dup.detach()
            os.dup2(new, fd)
            os.close(new)


def _as_caller(env: dict, stdio: _Stdio) -> None:
    """A process forked from the forkserver has the server's environment and standard streams (those of when it
    started): take the caller's, as "spawn" does."""
    os.environ.clear()
    os.environ.update(env)
    stdio.attach()


def _entry(rank: int, world_size: int, port: int, fn, args, backend: str = "gloo", env=None, stdio=None) -> None:
    if env is not None:
        _as_caller(env, stdio)
    warnings.filterwarnings("ignore")
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
    finally:
        from ..training.teardown import destroy_groups

        destroy_groups()   # megatron-core's groups, then torch's, as aceso train ends (training/teardown.py)


def spawn(world_size: int, fn, *args, backend: str = "gloo") -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes (gloo; ``backend="nccl"``: one GPU each);
    raises if any fails."""
    mp.start_processes(_entry, args=(world_size, free_port(), fn, args, backend, dict(os.environ), _Stdio()),
                       nprocs=world_size, join=True, start_method=_context())


def _call(fn, args, env: dict, stdio: _Stdio, cwd: str) -> None:
    _as_caller(env, stdio)
    os.chdir(cwd)
    torch.set_num_threads(1)
    rc = fn(*args)
    if rc:
        raise SystemExit(rc)


def run_fresh(fn, *args, cwd=None) -> None:
    """``fn(*args)`` (e.g. a CLI's ``main(argv)``) in one process forked from the preloaded forkserver: a fresh
    interpreter without a process group, like ``python -m ...`` as a subprocess, with the caller's environment,
    ``cwd`` (default: the caller's) and one torch thread, without paying the torch and megatron-core import
    again; raises if it fails or returns a non-zero exit status."""
    ctx = mp.get_context(_context())
    p = ctx.Process(target=_call, args=(fn, args, dict(os.environ), _Stdio(), str(cwd or os.getcwd())))
    p.start()
    p.join()
    if p.exitcode != 0:
        raise RuntimeError(f"{fn.__module__}.{fn.__qualname__}({', '.join(map(repr, args))}): exit status "
                           f"{p.exitcode}")


def make_batches(model, micro_batch_size: int, global_batch_size: int, seed: int = 0,
                 loss_mask: bool = False) -> list[dict]:
    """Random token micro-batches: ``{"tokens", "labels"}`` (GPT), ``{"enc_tokens", "dec_tokens", "labels"}`` (T5);
    with ``loss_mask`` also an uneven ``loss_mask`` (each sample keeps its own number of tokens, between a quarter
    and all of them, with random holes), so per-micro-batch and per-token normalisation differ."""
    g = torch.Generator().manual_seed(seed)
    if model.is_t5:
        enc = torch.randint(0, model.vocab_size, (global_batch_size, model.seq_length), generator=g)
        dec = torch.randint(0, model.vocab_size, (global_batch_size, model.decoder_seq_length + 1), generator=g)
        out = [{"enc_tokens": enc[i:i + micro_batch_size], "dec_tokens": dec[i:i + micro_batch_size, :-1],
                "labels": dec[i:i + micro_batch_size, 1:]} for i in range(0, global_batch_size, micro_batch_size)]
    else:
        tok = torch.randint(0, model.vocab_size, (global_batch_size, model.seq_length + 1), generator=g)
        out = [{"tokens": tok[i:i + micro_batch_size, :-1], "labels": tok[i:i + micro_batch_size, 1:]}
               for i in range(0, global_batch_size, micro_batch_size)]
    if loss_mask:
        s = out[0]["labels"].size(1)
        keep = torch.randint(s // 4, s + 1, (global_batch_size, 1), generator=g)
        mask = ((torch.arange(s).unsqueeze(0) < keep) & (torch.rand(global_batch_size, s, generator=g) > 0.2)).float()
        for j, b in enumerate(out):
            b["loss_mask"] = mask[j * micro_batch_size:(j + 1) * micro_batch_size]
    return out


def scheduled_steps(rt, scheduler, batches: list[dict], iterations, per_step: int) -> list[float]:
    """Train steps ``iterations`` of ``rt``, step ``it`` on micro-batches ``[per_step*it, per_step*(it+1))`` of
    ``batches``, the learning-rate ``scheduler`` stepped after each (as ``aceso train`` does): the losses."""
    losses = []
    for it in iterations:
        losses.append(rt.train_step(iter(batches[per_step * it:per_step * (it + 1)])))
        scheduler.step(1)
    return losses


def run_plans(rank: int, world_size: int, plans: list[dict], out: str, seed: int, num_steps: int,
              train_config, loss_mask: bool = False) -> None:
    """For each plan: loss and full gradients of step 1, the losses of ``num_steps`` optimizer steps and the full
    weights after them, and evidence of the overlaps the plan asks for (``overlapped_buckets``: DDP buckets whose
    reduction started during the backward of step 2, summed over ranks; ``param_gather_deferred``: after the last
    step no parameter all-gather had started yet).

    Rank 0 writes ``[{"losses": [...], "grads": {...}, "grad_norm": float, "params": {...}, ...}, ...]`` to ``out``,
    with every rank's copy of each router's expert bias after the last step (``"expert_bias"``).
    """
    from ..parallel.gather import all_expert_biases
    from ..parallel.grads import clip_grad_norm
    from ..training.engine import build_runtime
    from ..training.teardown import release

    from patches.compat import reset_moe_metrics

    results = []
    for raw in plans:
        reset_moe_metrics()    # megatron-core's MoE aux-loss log, sized by the first MoE model's layers + MTP depths
        rt = build_runtime(raw, rank, world_size, seed=seed, train_config=train_config)
        batches = make_batches(rt.plan.model, rt.plan.micro_batch_size, rt.plan.global_batch_size, seed, loss_mask)
        losses = [rt.forward_backward(iter(batches))]
        grads = rt.full_grads()
        if rt.sharded_optimizer:  # megatron-core's clipping inside its distributed optimizer
            _, norm, _ = rt.optimizer.step()
        else:
            norm = clip_grad_norm(rt, rt.train_config.clip_grad)
            rt.optimizer.step()
        overlapped = 0
        for i in range(num_steps - 1):
            losses.append(rt.train_step(iter(batches)))
            overlapped += rt.overlapped_buckets if i == 0 else 0
        deferred = rt.plan.overlap_param_gather and not any(
            bg.param_gather_dispatched for m in rt.models for bg in getattr(m, "bucket_groups", ()))
        counts = torch.tensor([overlapped, int(deferred)], dtype=torch.int64)
        dist.all_reduce(counts)
        results.append({"losses": losses, "grads": grads, "grad_norm": float(norm), "params": rt.full_params(),
                        "overlapped_buckets": int(counts[0]), "param_gather_deferred": int(counts[1]) > 0,
                        "expert_bias": all_expert_biases(rt)})
        release(rt)   # before the next plan's build: its hooks, model, buffers and optimizer (teardown)
        dist.barrier()
    if rank == 0:
        torch.save(results, Path(out))
