"""CPU mode: run stock megatron-core on CPU (gloo, fp32) for tests and laptops.

Target: ``torch.cuda.{current_device, synchronize, current_stream, get_rng_state, set_rng_state, manual_seed}``,
``MoEAlltoAllTokenDispatcher.{cuda_dtoh_stream, _maybe_dtoh_and_synchronize}`` (its host copy of the split
sizes), megatron-core's ``tensor_parallel.random._get_cuda_rng_state/_set_cuda_rng_state``, and tensor factories called with
``device="cuda"`` or an integer device, ``Tensor.cuda()`` and ``Tensor.type()`` (through a ``TorchFunctionMode``);
a logging filter on ``megatron.core.tensor_parallel.random``.

Reason: megatron-core hard-codes CUDA in a few places that CPU training reaches: ``torch.cuda.current_device()``
as the device of buffers (tensor-parallel layers, DDP buckets, ``DotProductAttention``'s ``softmax_offset`` of
GPT-OSS's attention sinks), ``device="cuda"`` in the 1F1B schedule's token
counter and in the causal-mask helper (``transformer/utils.py``), the CUDA RNG state that activation recompute
saves and replays, the current stream that 0.19's ``start_grad_sync`` waits on before reducing a bucket (a host
placeholder: one stream, waits are no-ops), and the MoE alltoall token dispatcher's copy of its split sizes to the
host on a CUDA side stream (created in its ``__init__``; the copy converts only CUDA tensors to the numpy split sizes
the all-to-all takes): on CPU the class's stream is a placeholder and the copy is the numpy conversion alone
(``torch.cuda.Stream`` itself stays unpatched, so the meta-device build check still catches a user's module
that needs CUDA). Without the RNG mapping, seeding fails and the recompute RNG replay silently does
nothing. ``Tensor.type()`` reports the CUDA type name (``torch.cuda.FloatTensor``) because the optimizers and
gradient clipping assert it. With the CUDA RNG mapped onto the CPU generator, every dropout in the rng
tracker's ``fork()`` (attention dropout) "changes the CPU RNG state" and the tracker logs a warning per call; the
fork restores the state all the same, so that one message is filtered out. Reading ``.grad`` of a non-leaf
tensor (megatron-core's distributed optimizer zeroes the grads of its parameter-shard views) goes through the
mode; megatron-core's distributed optimizer sets and reads the ``.grad`` of its parameter-shard views on purpose,
so torch's "not a leaf Tensor" warning is silenced for that read (raised from inside the mode, it escaped the
callers' filters on megatron-core's warnings). The function mode must stay active during backward (recomputed forwards create
tensors too), so it is entered in ``apply()`` and left in ``revert()``, not scoped to a ``with`` block.

Tested megatron-core versions: 0.16.1 (torch 2.13.0 CPU), 0.19.2 (torch 2.14.1, the CUDA build on CPU). Remove when
megatron-core supports a CPU device.
The model side of CPU mode is configuration, not patching: all fusions off, ``use_cpu_initialization=True``,
fp32 (see ``aceso_megatron.model.config``).
"""

from __future__ import annotations

import logging
import warnings

import torch
from torch.overrides import TorchFunctionMode

from ._base import Swaps, check_version

NAME = "cpu_mode"
TESTED_VERSIONS = ("0.16.1", "0.19.2")
_swaps = Swaps()
_mode: _CudaToCpuMode | None = None


def _is_cuda(device) -> bool:
    if isinstance(device, int):
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites ``device=cuda``/``device=<int>`` to CPU; ``Tensor.cuda()`` becomes a no-op."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # megatron-core asserts e.g. ``grad.type() == "torch.cuda.FloatTensor"`` (clip_grads, optimizers)
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if ".cuda." not in name else name
        if getattr(func, "__self__", None) is torch.Tensor.grad and func.__name__ == "__get__" \
                and not args[0].is_leaf:
            with warnings.catch_warnings():   # a parameter shard's .grad, set and read by megatron-core
                warnings.filterwarnings("ignore", message=_NON_LEAF_GRAD)
                return func(*args, **kwargs)
        if func in _BACKWARD_ENTRIES:
            return _backward_in_mode(func, args, kwargs)
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


_NON_LEAF_GRAD = r"The \.grad attribute of a Tensor that is not a leaf Tensor is being accessed"
_BACKWARD_ENTRIES = (torch.autograd.backward, torch.Tensor.backward, torch.autograd.grad)


def _backward_in_mode(func, args, kwargs):
    """Run a backward entry point with the mode active (recomputed forwards create tensors too).

    torch switches a mode off while its handler runs, and the handler's call of ``torch.autograd.backward``
    would dispatch straight back to it; so the mode is re-entered and, for this call only, ``torch.autograd``'s
    ``has_torch_function`` answers False.
    """
    import torch.autograd as ag

    if func is torch.Tensor.backward:
        self, rest = args[0], args[1:]
        names = ("gradient", "retain_graph", "create_graph", "inputs")
        kw = dict(zip(names, rest), **kwargs)
        func, args, kwargs = ag.backward, (self, kw.pop("gradient", None)), kw
    saved = ag.has_torch_function
    ag.has_torch_function = lambda *a, **k: False
    try:
        with _CudaToCpuMode():
            return func(*args, **kwargs)
    finally:
        ag.has_torch_function = saved


class HostEvent:
    """A CUDA event on the host: work is already in program order."""

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


class HostStream:
    """The host's one stream: work is already in program order."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def wait_stream(self, *args) -> None:
        pass

    def wait_event(self, *args) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, *args) -> HostEvent:
        return HostEvent()


def _current_stream(device=None) -> HostStream:
    return HostStream()


class _SameGeneratorFilter(logging.Filter):
    """Drops the rng tracker's warning that a fork changed the CPU RNG: on CPU it is the forked generator."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


_filter = _SameGeneratorFilter()


def _dtoh_on_cpu(self, point: str, tokens_per_expert=None):
    """``MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize`` on CPU: nothing to copy or wait for; the split
    sizes become the numpy arrays the all-to-all takes, at the same point as on CUDA."""
    if not self.drop_and_pad and point == self.cuda_dtoh_point:
        for name in ("input_splits", "output_splits", "output_splits_tp"):
            value = getattr(self, name)
            if torch.is_tensor(value):
                setattr(self, name, value.numpy())
    return tokens_per_expert


def _get_rng_state(*args, **kwargs) -> torch.Tensor:
    return torch.get_rng_state()


def _set_rng_state(state: torch.Tensor, *args, **kwargs) -> None:
    torch.set_rng_state(state)


def is_applied() -> bool:
    return _mode is not None


def apply() -> None:
    """Install the CPU shims (idempotent)."""
    global _mode
    if _mode is not None:
        return
    check_version(NAME, TESTED_VERSIONS)
    from megatron.core.tensor_parallel import random as mrandom

    _swaps.set(torch.cuda, "current_device", lambda: 0)
    _swaps.set(torch.cuda, "synchronize", lambda *a, **k: None)
    _swaps.set(torch.cuda, "current_stream", _current_stream)   # 0.19's start_grad_sync waits on it
    _swaps.set(torch.cuda, "get_rng_state", _get_rng_state)
    _swaps.set(torch.cuda, "set_rng_state", _set_rng_state)
    _swaps.set(torch.cuda, "manual_seed", lambda seed: torch.manual_seed(seed))
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher as a2a

    _swaps.set(a2a, "cuda_dtoh_stream", "cpu")   # not None: its __init__ creates no CUDA stream
    _swaps.set(a2a, "_maybe_dtoh_and_synchronize", _dtoh_on_cpu)
    _swaps.set(torch.cuda.random, "get_rng_state", _get_rng_state)
    _swaps.set(mrandom, "_get_cuda_rng_state", _get_rng_state)
    _swaps.set(mrandom, "_set_cuda_rng_state", _set_rng_state)
    logging.getLogger(mrandom.__name__).addFilter(_filter)
    _mode = _CudaToCpuMode()
    _mode.__enter__()


def revert() -> None:
    """Remove the CPU shims."""
    global _mode
    if _mode is None:
        return
    _mode.__exit__(None, None, None)
    _mode = None
    _swaps.restore()
    from megatron.core.tensor_parallel import random as mrandom

    logging.getLogger(mrandom.__name__).removeFilter(_filter)
