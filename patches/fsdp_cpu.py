"""Megatron FSDP on CPU: megatron-core's ``FullyShardedDataParallel`` without CUDA streams.

Target: the name ``torch`` in ``megatron.core.distributed.fsdp.src.megatron_fsdp.megatron_fsdp`` and
``...megatron_fsdp.param_and_grad_buffer``: a view of torch whose ``cuda.Stream``, ``cuda.Event``, ``cuda.stream``
and ``cuda.current_stream`` are host placeholders (one stream: waits and events are no-ops, ``stream(s)`` a
null context), and ``torch.distributed``'s collectives (and ``_coalescing_manager``) finished before they return;
everything else is torch itself.

Reason: ``MegatronFSDP._init_fsdp_param_and_grad_buffer`` creates two CUDA side streams
(``side_stream_for_buffer_copy_and_grad_accum``, ``side_stream_for_param_gather``:
``RuntimeError: torch.cuda.Stream requires CUDA support`` on CPU), and the all-gather / reduce-scatter pipelines
of ``param_and_grad_buffer`` run their collectives under ``torch.cuda.stream(...)`` and order them with
``current_stream().wait_stream``. On CPU every operation runs in program order on the host, so one stream is what
those calls mean; the collectives themselves are gloo's, made synchronous because an asynchronous gloo collective
runs on a background thread that no stream orders before its buffer is reused or freed (seen: a worker aborting
with ``malloc(): unaligned tcache chunk detected``). Only these two modules see the placeholders: the global
``torch.cuda.Stream`` stays unpatched (the meta-device build check relies on it failing). The rest of CPU mode
(``device="cuda"`` factories, ``torch.cuda.synchronize``, the CUDA RNG) is ``patches.cpu_mode``'s.

Tested megatron-core versions: 0.16.1 (torch 2.13.0 CPU), 0.19.2 (torch 2.14.1; ``FullyShardedDataParallel`` also
needs einops).
Applied by ``build_runtime`` for Megatron FSDP plans on CPU. Remove when Megatron FSDP takes a CPU device.
"""

from __future__ import annotations

import contextlib
import importlib

import torch
from torch.distributed.distributed_c10d import _IllegalWork

from ._base import Swaps, check_version
from .cpu_mode import HostEvent, HostStream

NAME = "fsdp_cpu"
TESTED_VERSIONS = ("0.16.1", "0.19.2")
MODULES = ("megatron.core.distributed.fsdp.src.megatron_fsdp.megatron_fsdp",
           "megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer")
_swaps = Swaps()


class _Cuda:
    """``torch.cuda`` with host streams."""

    Stream = HostStream
    Event = HostEvent

    @staticmethod
    def stream(s=None):
        return contextlib.nullcontext()

    @staticmethod
    def current_stream(device=None) -> HostStream:
        return HostStream()

    def __getattr__(self, name):
        return getattr(torch.cuda, name)


class _Dist:
    """``torch.distributed`` with every collective finished before it returns: on the host nothing orders an
    asynchronous gloo collective before the buffer it writes is reused or freed (on a GPU, the streams do)."""

    def __getattr__(self, name):
        fn = getattr(torch.distributed, name)
        if name not in _COLLECTIVES:
            return fn

        def finished(*args, **kwargs):
            work = fn(*args, **kwargs)
            if work is not None and not isinstance(work, _IllegalWork):   # inside a coalescing block: its exit waits
                work.wait()
            return work

        return finished


_COLLECTIVES = frozenset(("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "all_gather", "broadcast",
                          "_all_gather_base", "_reduce_scatter_base", "reduce_scatter"))


def _synchronous_coalescing(group=None, device=None, async_ops=False):
    """``_coalescing_manager`` whose collectives are finished when the block exits."""
    return torch.distributed._coalescing_manager(group, device, async_ops=False)


class _Torch:
    """``torch`` with ``cuda`` as ``_Cuda`` and ``distributed`` as ``_Dist``."""

    cuda = _Cuda()
    distributed = _Dist()

    def __getattr__(self, name):
        return getattr(torch, name)


def is_applied() -> bool:
    return _swaps.active


def apply() -> None:
    """Give the two modules the host-stream view of torch (idempotent)."""
    if _swaps.active:
        return
    check_version(NAME, TESTED_VERSIONS)
    view = _Torch()
    for name in MODULES:
        module = importlib.import_module(name)
        _swaps.set(module, "torch", view)
        if hasattr(module, "_coalescing_manager"):
            _swaps.set(module, "_coalescing_manager", _synchronous_coalescing)


def revert() -> None:
    _swaps.restore()
