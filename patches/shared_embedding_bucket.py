"""An embedding copy in a DDP bucket of its own without the distributed optimizer too.

Target: ``megatron.core.distributed.param_and_grad_buffer._ParamAndGradBuffer.__init__`` (a wrapper around the
original).

Reason: megatron-core gives a parameter flagged ``shared_embedding`` its own bucket only with the distributed
optimizer (``_does_param_require_new_bucket``, a function local to ``__init__``, so it cannot be swapped alone).
Without it the tied output layer shares the last stage's single bucket (DDP does not bucket stages after the
first), and that bucket must wait until the embedding copies are summed (``parallel.grads.hold_embedding_buckets``):
the stage never overlaps its gradient reduction. After the original ``__init__`` the wrapper cuts the buffer's
buckets before and after each ``shared_embedding`` parameter, as megatron-core's rule does for the distributed
optimizer. Without the distributed optimizer a buffer has no padding, so the parameters keep their places in the
buffer (``param.main_grad`` views are unchanged); only the bucket bookkeeping is rebuilt, with the buffer's own
``_new_bucket``. Buffers of the distributed optimizer are left as megatron-core built them.

On 0.19 the layout is computed outside the buffer (``param_layout``; without the distributed optimizer
``_compute_default_per_buffer_param_layout``, which splits nothing out either) and ``_new_bucket`` takes each
bucket's parameters with extra main grads; the wrapper is the same.

Tested megatron-core versions: 0.16.1, 0.19.2. Applied by ``build_runtime`` when the plan has embedding copies on several
stages. Remove when megatron-core splits shared embeddings out whatever the optimizer.
"""

from __future__ import annotations

import functools
import inspect

from ._base import Swaps, check_version

NAME = "shared_embedding_bucket"
TESTED_VERSIONS = ("0.16.1", "0.19.2")
_swaps = Swaps()


def is_applied() -> bool:
    return _swaps.active


def _segments(buf) -> list[list]:
    """The buffer's parameters in buffer order, cut at the original bucket boundaries and around every
    ``shared_embedding`` parameter."""
    out = []
    for bucket in buf.buckets:
        cur = []
        for p in sorted(bucket.params_list, key=lambda q: buf.param_index_map[q][0]):
            if getattr(p, "shared_embedding", False):
                out += [s for s in (cur, [p]) if s]
                cur = []
            else:
                cur.append(p)
        if cur:
            out.append(cur)
    return out


def split_shared_embedding_buckets(buf) -> None:
    """Rebuild ``buf``'s buckets with each ``shared_embedding`` parameter alone (no-op when already so)."""
    if buf.ddp_config.use_distributed_optimizer:
        return
    segments = _segments(buf)
    if len(segments) == len(buf.buckets):
        return
    # 0.19: each bucket also lists its parameters whose main_grad lives outside the buffer (none in fp32 / bf16
    # training, kept as they were); 0.16.1's _new_bucket has no such argument
    extra = {p for b in buf.buckets for p in getattr(b, "params_with_extra_main_grads", ())}
    takes_extra = "bucket_params_with_extra_main_grads" in inspect.signature(buf._new_bucket).parameters
    buf.bucket_indices, buf.buckets, buf.param_to_bucket = [], [], {}
    for i, seg in enumerate(segments):
        lo = buf.param_index_map[seg[0]][0]
        hi = buf.param_index_map[seg[-1]][1]
        for p in seg:
            start, end, _ = buf.param_index_map[p]
            buf.param_index_map[p] = (start, end, i)
        buf.bucket_indices.append((lo, hi))
        kw = {"bucket_params_with_extra_main_grads": [p for p in seg if p in extra]} if takes_extra else {}
        buf.buckets.append(buf._new_bucket(bucket_params=seg, start_index=lo, end_index=hi,
                                           numel_unpadded=hi - lo, bucket_id=i, **kw))


def _splitting(original):
    @functools.wraps(original)
    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        split_shared_embedding_buckets(self)

    return init


def apply() -> None:
    """Install the wrapper (idempotent)."""
    if _swaps.active:
        return
    check_version(NAME, TESTED_VERSIONS)
    from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBuffer as B

    _swaps.set(B, "__init__", _splitting(B.__init__))


def revert() -> None:
    _swaps.restore()
