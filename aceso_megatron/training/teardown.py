"""The end of a run, the build (``build_steps``) undone in order: the runtime's hooks removed, its model, gradient
buffers and optimizer dropped (``release``), then the process groups destroyed (``destroy_groups``: megatron-core's
``parallel_state.destroy_model_parallel`` and ``torch.distributed.destroy_process_group``, as stock Megatron-LM's
tests end), so that no gloo or NCCL object outlives its process group.

Why the interpreter cannot do it: megatron-core's ``DistributedDataParallel`` registers one hook per parameter on
the parameter's gradient accumulator (an autograd node, C++), keeps the node in ``grad_accs`` and no handle, and
the hook closes over the DDP. Python's garbage collector sees through that node only while ``grad_accs`` is its
one owner; the distributed optimizer's fp32 shards are views of the parameters whose autograd history owns the same
nodes, so the cycle DDP -> node -> hook -> DDP cannot be collected, and with it the model, the optimizer (reached
through the configs' ``grad_scale_func`` / ``finalize_model_grads_func``, bound to the runtime) and every process
group they hold stay alive until interpreter finalization destroys them with the interpreter half gone
(pytorch/pytorch#179291: a rank aborting at exit with "terminate called without an active exception"). Clearing
``grad_accs`` alone leaves the shards' hold; removing the hooks cuts the cycle whatever else holds the nodes.
megatron-core keeps no handle, so the runtime's DDP (``ReleasableDDP``) keeps each hook it makes, removable.
"""

from __future__ import annotations

import gc

import torch.distributed as dist
from megatron.core.distributed import DistributedDataParallel


class _RemovableHook:
    """A DDP gradient hook the autograd node holds; ``remove`` drops the hook (and the DDP it closes over)."""

    __slots__ = ("fn",)

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, *args):
        if self.fn is not None:
            return self.fn(*args)
        return None

    def remove(self) -> None:
        self.fn = None


class ReleasableDDP(DistributedDataParallel):
    """megatron-core's ``DistributedDataParallel`` as it is, keeping the per-parameter gradient hooks it registers
    (``_make_backward_post_hook``, megatron-core 0.16-0.19) so that ``remove_grad_hooks`` can remove them."""

    def _make_backward_post_hook(self, param):
        hook = _RemovableHook(super()._make_backward_post_hook(param))
        self.__dict__.setdefault("_removable_hooks", []).append(hook)
        return hook

    def remove_grad_hooks(self) -> None:
        """The gradient hooks removed and the accumulator nodes let go: the DDP is plain garbage after this."""
        for hook in self.__dict__.pop("_removable_hooks", []):
            hook.remove()
        self.grad_accs.clear()


def release(rt) -> None:
    """Everything ``rt`` (``engine.Runtime``) built dropped, in order: hooks removed (each DDP's gradient and forward
    pre-hooks), the configs' callbacks into the runtime cleared, then the model chunks, their gradient buffers
    and the optimizer. Called by ``train`` when the run ends, however it ends."""
    for m in rt.models:
        if getattr(m, "remove_forward_pre_hook_handles", None):   # distributed optimizer, overlapped param gather
            m.disable_forward_pre_hook(param_sync=False)
        if isinstance(m, ReleasableDDP):
            m.remove_grad_hooks()
    for c in rt.chunks:   # connect_schedule's callbacks, bound to the runtime
        c.config.grad_scale_func = c.config.finalize_model_grads_func = c.config.no_sync_func = None
    rt.models, rt.chunks, rt.held_bucket_groups = [], [], []
    rt.optimizer = rt.communicator = rt.groups = None


def destroy_groups() -> None:
    """After ``release``: what is left of the run collected, then megatron-core's global groups and buffers and
    every torch process group destroyed, while the interpreter is whole."""
    from megatron.core import parallel_state

    gc.collect()
    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
