"""Adam's state across optimizer kinds: a checkpoint of the distributed optimizer loaded by a plan with the plain
one, and back, keeping the moments, the fp32 master weights and the step count.

megatron-core 0.16.1 writes both kinds per parameter, keyed by the model's sharded tensors (so re-sharded for any
TP/DP/pipeline layout on load): the plain optimizer through ``optim_state_to_sharding_state``, the distributed one
in its ``fully_reshardable`` format (``sharded_param_state_fully_reshardable``). Adam's moments have the same keys
in both, ``optimizer.state.exp_avg.NAME`` and ``optimizer.state.exp_avg_sq.NAME``. The kinds differ in three places:

- the fp32 master weights: ``optimizer.state.param.NAME`` (distributed), ``optimizer.state.fp32_param.NAME``
  (plain, bf16/fp16 model: ``Float16OptimizerWithFloat16Params``), none for a plain fp32 model
  (``FP32Optimizer``: the model's own ``NAME`` is the master copy);
- the step count: in every param group of the common state (distributed: ``param_groups[i]["step"]``), or as
  ``state["common_step"]`` (plain);
- everything else (param groups, the sharding type): each kind's own structure.

So the loader asks the plan's own optimizer for its sharded state dict (``is_loading``), renames each master-weight
key to the one the checkpoint holds, loads those tensors with ``dist_checkpointing.load``, puts them back into the
optimizer's own dict together with the checkpoint's step, and hands that to the optimizer's ``load_state_dict``:
megatron-core's formats on both sides, no converter format of our own.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from search.io.errors import AcesoError

# the master-weight prefixes of the two kinds (the plain fp32 optimizer has none: the model key itself)
_MASTER = ("optimizer.state.param.", "optimizer.state.fp32_param.")


def _saved_key(key: str, saved: set[str]) -> str:
    """The checkpoint's key for the loading optimizer's ``key``: a master weight under the other kind's name."""
    for prefix in _MASTER:
        if prefix in key:
            head, name = key.split(prefix, 1)  # head: a ChainedOptimizer's prefix, if any
            for cand in [head + p + name for p in _MASTER] + [name]:
                if cand in saved or f"{cand}_w" in saved:   # SwiGLU fc1: saved as gate and up halves
                    return cand
    return key


def _saved_step(common: dict) -> float | None:
    """The step count the checkpoint's optimizer recorded (either kind), or None when it never stepped."""
    found: set[float] = set()

    def walk(node):
        if isinstance(node, dict):
            for k, v in node.items():
                if k == "common_step":
                    found.add(float(v))
                elif k == "param_groups" and isinstance(v, list):
                    found.update(float(g["step"]) for g in v if isinstance(g, dict) and "step" in g)
                else:
                    walk(v)
        elif isinstance(node, (list, tuple)):
            for v in node:
                walk(v)

    walk(common.get("optimizer"))
    if len(found) > 1:
        raise AcesoError(f"the optimizer's step counts differ per parameter group ({sorted(found)})")
    return found.pop() if found else None


def _set_step(node, step: float) -> None:
    """Write ``step`` where the loading optimizer's ``load_state_dict`` reads it."""
    if isinstance(node, dict):
        if isinstance(node.get("param_groups"), list):
            if isinstance(node.get("state"), dict):   # plain: torch's state dict
                node["state"]["common_step"] = torch.tensor(step, dtype=torch.float32)
            else:                                      # distributed: its param groups
                for g in node["param_groups"]:
                    g["step"] = step
        for v in node.values():
            _set_step(v, step)
    elif isinstance(node, list):
        for v in node:
            _set_step(v, step)


def load_other_kind(rt, model_sd: dict, ckpt_dir: Path, where: str) -> None:
    """Load the optimizer state of ``ckpt_dir``, written by the other optimizer kind, into ``rt.optimizer``
    (collective). ``model_sd``: the model's sharded state dict (its ``data`` the parameters, which the
    optimizer's own sharded state dict maps by identity); the weights are loaded already. ``where`` starts the
    refusal of a checkpoint lacking a tensor."""
    from dataclasses import replace

    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedBase

    from .checkpoint import OPTIMIZER_METADATA

    ckpt = str(ckpt_dir)
    saved = set(dist_checkpointing.load_tensors_metadata(ckpt))
    own = rt.optimizer.sharded_state_dict(model_sd, is_loading=True, metadata=OPTIMIZER_METADATA)
    flat: dict[int, ShardedBase] = {}

    def to_slot(leaf):
        if not isinstance(leaf, ShardedBase):
            return leaf
        flat[len(flat)] = replace(leaf, key=_saved_key(leaf.key, saved))
        return _Slot(len(flat) - 1)

    dict_list_map_inplace(to_slot, own)
    lacking = next((s.key for s in flat.values() if s.key not in saved and f"{s.key}_w" not in saved), None)
    found = [None] * dist.get_world_size()  # every rank checks its own tensors: agree before anyone loads
    dist.all_gather_object(found, lacking)
    if (key := next((k for k in found if k is not None), None)) is not None:
        raise AcesoError(f"{where} has no {key} to convert Adam's state from; add --no-load-optim to load the "
                         "weights only")
    loaded = dist_checkpointing.load(flat, ckpt)
    dict_list_map_inplace(lambda v: loaded[v.index] if isinstance(v, _Slot)
                          else v.unwrap() if isinstance(v, LocalNonpersistentObject) else v, own)
    try:
        step = _saved_step(dist_checkpointing.load_common_state_dict(ckpt))
    except AcesoError as e:
        raise AcesoError(f"{where}: {e}; add --no-load-optim to load the weights only") from None
    if step is not None:
        _set_step(own, step)
    rt.optimizer.load_state_dict(own)


class _Slot:
    """Where a loaded tensor goes back into the optimizer's own state dict."""

    def __init__(self, index: int):
        self.index = index
