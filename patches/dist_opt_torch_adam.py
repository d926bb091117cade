"""Distributed-optimizer checkpoints with torch's Adam: load the fully re-shardable format, with a step count
per parameter.

Target: ``megatron.core.optimizer.distrib_optimizer.DistributedOptimizer._set_main_param_and_optimizer_states``,
``DistributedOptimizer.load_state_dict`` and ``DistributedOptimizer.state_dict``.

Reason: without apex or transformer-engine, megatron-core's distributed optimizer runs torch's Adam, which keeps a
per-parameter ``step`` tensor in its state. Two things break when such an optimizer loads a checkpoint:

1. the ``fully_reshardable`` format (the one that re-shards across TP, DP and pipeline changes, used by
   ``aceso_megatron.training.checkpoint``) skips ``step`` among the loaded tensors (megatron-core restores it from
   the param groups) but then copies every key of the parameter's state, ``step`` included: ``KeyError: 'step'``.
   The wrapper hides ``step`` from that copy and puts it back unchanged.
2. ``load_state_dict`` gives every parameter the *same* ``step`` tensor; torch's Adam increments each parameter's
   ``step`` in place, so after a resume the shared counter advances once per parameter per step and the bias
   correction is wrong from the second step on (a resumed run drifts from the uninterrupted one). The wrapper
   gives each parameter its own copy after loading.
3. ``state_dict`` reads the step count from the per-parameter states and asserts there is exactly one; a
   distributed optimizer that holds no parameter has none. megatron-core builds one on every rank of an MoE
   model (the expert optimizer, its param groups made alike over ranks), so a stage holding only dense layers
   (DeepSeek-V3's first layers on stage 0) could not be checkpointed. The wrapper gives such an optimizer's param
   groups the step of the other optimizers of its chain (``ChainedOptimizer.sharded_state_dict`` is wrapped to
   hand it over): the checkpoint's non-sharded state is rank 0's, and every rank's ``ChainedOptimizer`` asserts
   one step over its param groups after loading, so a stand-in 0 would break the other stages' resume.

Tested megatron-core versions: 0.16.1 (torch 2.13.0), 0.19.2 (torch 2.14.1; the same three faults). Applied by ``build_runtime`` for distributed-optimizer plans
when megatron-core runs torch's Adam (``distrib_optimizer.HAVE_APEX_OR_TE`` false). Remove when megatron-core
copies only the loaded keys and gives each parameter its own step.
"""

from __future__ import annotations

import functools

import torch

from ._base import Swaps, check_version

NAME = "dist_opt_torch_adam"
TESTED_VERSIONS = ("0.16.1", "0.19.2")
_swaps = Swaps()


def needed() -> bool:
    """Whether megatron-core's distributed optimizer runs torch's Adam here (no apex, no transformer-engine)."""
    from megatron.core.optimizer import distrib_optimizer

    return not distrib_optimizer.HAVE_APEX_OR_TE


def is_applied() -> bool:
    return _swaps.active


def _without_step(original):
    @functools.wraps(original)
    def set_states(self, model_param, tensors):
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        state = self.optimizer.state.get(main_param, {})
        step = state.pop("step", None) if "step" not in tensors else None
        try:
            return original(self, model_param, tensors)
        finally:
            if step is not None:
                state["step"] = step

    return set_states


def _own_steps(original):
    @functools.wraps(original)
    def load_state_dict(self, state_dict):
        out = original(self, state_dict)
        for s in self.optimizer.state.values():
            if torch.is_tensor(s.get("step")):
                s["step"] = s["step"].clone()
        return out

    return load_state_dict


def _stepless_when_empty(original):
    @functools.wraps(original)
    def state_dict(self):
        if any(g["params"] for g in self.optimizer.param_groups):
            return original(self)
        inner = self.optimizer.state_dict()
        out = {"optimizer": {k: v for k, v in inner.items() if k != "state"}}
        for group in out["optimizer"]["param_groups"]:
            del group["params"]
            group["step"] = getattr(self, "_chain_step", 0)
        if self.grad_scaler:
            out["grad_scaler"] = self.grad_scaler.state_dict()
        return out

    return state_dict


def _step_of(opt) -> float | None:
    steps = {s["step"].item() for s in opt.optimizer.state.values() if torch.is_tensor(s.get("step"))}
    return next(iter(steps)) if len(steps) == 1 else None


def _hand_over_step(original):
    @functools.wraps(original)
    def sharded_state_dict(self, *args, **kwargs):
        subs = self.chained_optimizers
        step = next((st for o in subs if (st := _step_of(o)) is not None), None)
        for o in subs:
            o._chain_step = step if step is not None else 0
        return original(self, *args, **kwargs)

    return sharded_state_dict


def apply() -> None:
    """Install the wrappers (idempotent)."""
    if _swaps.active:
        return
    check_version(NAME, TESTED_VERSIONS)
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer as D
    from megatron.core.optimizer.optimizer import ChainedOptimizer as C

    _swaps.set(D, "_set_main_param_and_optimizer_states", _without_step(D._set_main_param_and_optimizer_states))
    _swaps.set(D, "load_state_dict", _own_steps(D.load_state_dict))
    _swaps.set(D, "state_dict", _stepless_when_empty(D.state_dict))
    _swaps.set(C, "sharded_state_dict", _hand_over_step(C.sharded_state_dict))


def revert() -> None:
    _swaps.restore()
