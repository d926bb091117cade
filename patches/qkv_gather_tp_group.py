"""The QKV all-gather of tp above the query groups on a stage's own TP group.

Target: the module globals ``all_gather_last_dim_from_tensor_parallel_region`` and
``get_tensor_model_parallel_rank`` of ``megatron.core.transformer.attention`` (replaced by versions that take the
group of the attention running them) and ``SelfAttention.get_query_key_value_tensors``, wrapped to name that group
(``self.pg_collection.tp``) for the duration of the call when ``num_query_groups`` is below its TP size. Outside the
wrapped method, or with an explicit group, both behave as upstream.

Reason: with tp above the query groups megatron-core all-gathers the QKV output over TP and picks this rank's K/V
group and query heads by its TP rank (attention.py of 0.16.1 ~1398-1476). 0.16.1 calls
``all_gather_last_dim_from_tensor_parallel_region`` without a group and reads ``get_tensor_model_parallel_rank()``,
both the global TP group, which per-stage groups leave unset (``group.size()`` on None: ``AttributeError``); 0.19.2
passes its group to the gather and reads its rank, except for the output gate's slice (``attention_output_gate``),
which still reads the global rank. The gather's backward (a reduce-scatter) keeps the group it was given, so naming
the group only during the call is enough; a recomputed forward runs the wrapped method again.

Applied by ``build_runtime`` when some stage's tp exceeds the model's query groups. Tested megatron-core versions:
0.16.1, 0.19.2 (``tests/distributed/test_query_groups_plans.py``: tp 2 with one query group equals the
single-process model). Remove when megatron-core passes its ``pg_collection.tp`` everywhere in this path.
"""

from __future__ import annotations

import contextvars
import functools

from ._base import Swaps, check_version

NAME = "qkv_gather_tp_group"
TESTED_VERSIONS = ("0.16.1", "0.19.2")
_swaps = Swaps()
_GROUP: contextvars.ContextVar = contextvars.ContextVar("aceso_qkv_gather_group", default=None)   # set by the call


def _gather(original):
    def gather(input_, group=None):
        own = _GROUP.get()
        return original(input_, group if group is not None or own is None else own)

    return gather


def _rank(original):
    def rank():
        own = _GROUP.get()
        return original() if own is None else own.rank()

    return rank


def _on_own_group(method):
    @functools.wraps(method)
    def wrapped(self, *args, **kwargs):
        if self.config.num_query_groups >= self.world_size:
            return method(self, *args, **kwargs)
        token = _GROUP.set(self.pg_collection.tp)
        try:
            return method(self, *args, **kwargs)
        finally:
            _GROUP.reset(token)

    return wrapped


def is_applied() -> bool:
    return _swaps.active


def apply() -> None:
    """Swap in the group-taking gather and rank and wrap the method (idempotent)."""
    if _swaps.active:
        return
    check_version(NAME, TESTED_VERSIONS)
    from megatron.core.transformer import attention as att

    _swaps.set(att, "all_gather_last_dim_from_tensor_parallel_region",
               _gather(att.all_gather_last_dim_from_tensor_parallel_region))
    _swaps.set(att, "get_tensor_model_parallel_rank", _rank(att.get_tensor_model_parallel_rank))
    _swaps.set(att.SelfAttention, "get_query_key_value_tensors",
               _on_own_group(att.SelfAttention.get_query_key_value_tensors))


def revert() -> None:
    """Restore megatron-core's method."""
    _swaps.restore()
