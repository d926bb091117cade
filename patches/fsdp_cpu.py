"""Megatron FSDP on CPU: megatron-core's ``FullyShardedDataParallel`` without CUDA streams.

Target: the name ``torch`` in ``megatron.core.distributed.fsdp.src.megatron_fsdp.megatron_fsdp`` and
``...megatron_fsdp.param_and_grad_buffer``: a view of torch whose ``cuda.Stream``, ``cuda.Event``, ``cuda.stream``
and ``cuda.current_stream`` are host placeholders (one stream: waits and events are no-ops, ``stream(s)`` a
null context); everything else is torch itself.

Reason: ``MegatronFSDP._init_fsdp_param_and_grad_buffer`` creates two CUDA side streams
(``side_stream_for_buffer_copy_and_grad_accum``, ``side_stream_for_param_gather``:
``RuntimeError: torch.cuda.Stream requires CUDA support`` on CPU), and the all-gather / reduce-scatter pipelines
of ``param_and_grad_buffer`` run their collectives under ``torch.cuda.stream(...)`` and order them with
``current_stream().wait_stream``. On CPU every operation runs in program order on the host, so one stream is what
those calls mean; the collectives themselves are gloo's. Only these two modules see the placeholders: the global
``torch.cuda.Stream`` stays unpatched (the meta-device build check relies on it failing). The rest of CPU mode
(``device="cuda"`` factories, ``torch.cuda.synchronize``, the CUDA RNG) is ``patches.cpu_mode``'s.

Tested megatron-core versions: 0.16.1 (torch 2.13.0 CPU; ``FullyShardedDataParallel`` also needs einops).
Applied by ``build_runtime`` for Megatron FSDP plans on CPU. Remove when Megatron FSDP takes a CPU device.
"""

from __future__ import annotations

import contextlib
import importlib

import torch

from ._base import Swaps, check_version

NAME = "fsdp_cpu"
TESTED_VERSIONS = ("0.16.1",)
MODULES = ("megatron.core.distributed.fsdp.src.megatron_fsdp.megatron_fsdp",
           "megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer")
_swaps = Swaps()


class _Event:
    def __init__(self, *args, **kwargs) -> None:
        pass

    def record(self, *args) -> None:
        pass

    def wait(self, *args) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class _Stream:
    """The host's one stream: work is already in program order."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def wait_stream(self, *args) -> None:
        pass

    def wait_event(self, *args) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, *args) -> _Event:
        return _Event()


class _Cuda:
    """``torch.cuda`` with host streams."""

    Stream = _Stream
    Event = _Event

    @staticmethod
    def stream(s=None):
        return contextlib.nullcontext()

    @staticmethod
    def current_stream(device=None) -> _Stream:
        return _Stream()

    def __getattr__(self, name):
        return getattr(torch.cuda, name)


class _Torch:
    """``torch`` with ``cuda`` as ``_Cuda``."""

    cuda = _Cuda()

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
        _swaps.set(importlib.import_module(name), "torch", view)


def revert() -> None:
    _swaps.restore()
