"""Activation accounting: the bytes a forward pass keeps alive for its backward.

CPU (and a cross-check on GPU): ``torch.autograd.graph.saved_tensors_hooks`` sees every tensor autograd saves
(``ctx.save_for_backward`` of megatron-core's checkpoint functions included). Tensors are counted by their
storage, once each (views share one), leaving out parameters (they are weights, not activations) and any storage
the caller excludes (e.g. the T5 encoder output a cross-attention unit reads: the cost model counts it once per
stage, not per unit).

GPU: the caching allocator's counters. ``memory_allocated`` after the forward minus before, less the unit's
output (the next unit's input, counted there) plus the unit's input when autograd kept it (the saved-tensor
hook says whether it did). ``max_memory_allocated`` during the backward, relative to its start, is the
backward's transient peak (re-materialised activations, gradient buffers, workspaces).
"""

from __future__ import annotations

import weakref
from typing import Self

import torch


def storage_key(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


class _Wrapped:
    """What autograd keeps instead of a saved tensor while a ``_SavedHooks`` context is active."""

    __slots__ = ("t",)

    def __init__(self, t: torch.Tensor):
        self.t = t


class _SavedHooks:
    """A ``saved_tensors_hooks`` context whose ``_pack`` returns the tensor or a ``_Wrapped`` holding it."""

    _hooks = None

    def _pack(self, t):
        raise NotImplementedError

    @staticmethod
    def _unpack(w):
        return w.t if isinstance(w, _Wrapped) else w

    def __enter__(self) -> Self:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


class _Kept(_Wrapped):
    """Held by autograd while ``SavedTensors`` is active: alive exactly as long as the graph node that saved it
    (a weak reference tells whether it still is)."""

    __slots__ = ("__weakref__",)


class SavedTensors(_SavedHooks):
    """Context manager recording the storages autograd saves inside it and still keeps.

    Only what a graph node holds counts: torch 2.13 also passes some tensors through the pack hook that no node
    keeps (the dropout noise of a forward under ``no_grad``, as inside a full-recompute checkpoint), so each saved
    tensor is wrapped and counted while its wrapper is alive.
    """

    def __init__(self, exclude: list[torch.Tensor] | None = None, params=()):
        self.skip = {storage_key(t)[0] for t in list(params) + list(exclude or []) if t is not None}
        self.kept: dict[int, list[weakref.ref]] = {}  # storage data pointer at save time -> wrappers

    def _pack(self, t):
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return t
        ptr = t.untyped_storage().data_ptr()
        if not ptr or ptr in self.skip:
            return t
        kept = _Kept(t)
        self.kept.setdefault(ptr, []).append(weakref.ref(kept))
        return kept

    def _live(self, ptr: int) -> torch.Tensor | None:
        return next((k.t for r in self.kept.get(ptr, ()) if (k := r()) is not None), None)

    @property
    def nbytes(self) -> int:
        """Bytes of the kept storages now, each once: a storage released after saving (megatron-core's
        ``CheckpointWithoutOutput`` resizes it to 0 until backward re-materialises it) counts 0."""
        live = (self._live(ptr) for ptr in self.kept)
        return sum(tensor_bytes(t) for t in live if t is not None)

    def holds(self, t: torch.Tensor) -> bool:
        return self._live(storage_key(t)[0]) is not None


def tensor_bytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


def allocated() -> int:
    return torch.cuda.memory_allocated()


def reset_peak() -> None:
    torch.cuda.reset_peak_memory_stats()


def peak() -> int:
    return torch.cuda.max_memory_allocated()


class _Held(_Wrapped):
    """Held by autograd while ``LiveSaved`` is active; frees its count on release."""

    __slots__ = ("owner", "ptr")

    def __init__(self, t, owner, ptr):
        super().__init__(t)
        self.owner, self.ptr = owner, ptr

    def __del__(self):
        if self.ptr:
            self.owner._release(self.ptr)


class LiveSaved(_SavedHooks):
    """Live bytes of saved activations over a whole training step, and their peak (CPU memory accounting).

    Every tensor autograd saves is wrapped in a holder; the storage counts while any holder of it is alive (the
    graph node that saved it still exists), parameters excluded. Recomputed forwards inside backward save
    through autograd too, so the re-materialisation transient is part of the peak. Thread-local like
    ``saved_tensors_hooks``: on CPU the backward runs on the calling thread.
    """

    def __init__(self, params=()):
        self.skip = {storage_key(p)[0] for p in params}
        self.refs: dict[int, int] = {}
        self.sizes: dict[int, int] = {}
        self.live = 0
        self.peak = 0

    def _pack(self, t):
        if not isinstance(t, torch.Tensor):
            return t
        ptr, nbytes = storage_key(t)
        if not ptr or ptr in self.skip:
            return _Held(t, self, 0)
        if self.refs.get(ptr, 0) == 0:
            self.sizes[ptr] = nbytes
            self.live += nbytes
            self.peak = max(self.peak, self.live)
        self.refs[ptr] = self.refs.get(ptr, 0) + 1
        return _Held(t, self, ptr)

    def _release(self, ptr: int) -> None:
        n = self.refs.get(ptr, 0) - 1
        if n <= 0:
            self.refs.pop(ptr, None)
            self.live -= self.sizes.pop(ptr, 0)
        else:
            self.refs[ptr] = n
