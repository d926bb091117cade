"""What megatron-core 0.16.1's vocab-parallel cross-entropy holds, measured on CPU, against the last stage's loss
terms of the cost model (``head_act_mb``'s fp32 softmax and ``head_peak_mb``, search/costmodel/analytic.py).

The loss runs as ``LanguageModule.compute_language_model_loss`` runs it: dt-byte logits from the output layer go
into ``tensor_parallel.vocab_parallel_cross_entropy`` (the default; ``--cross-entropy-loss-fusion`` with the native
impl runs the same ``VocabParallelCrossEntropy`` steps jit-fused, ``fusions/fused_cross_entropy.py``), the logits
are dropped once the loss is computed (``GPTModel._postprocess`` returns the loss only), then backward. Every
tensor storage an op creates is tracked (a ``TorchDispatchMode``: bytes at creation, released when the storage
dies), so the peak of live bytes over the whole forward + backward and the bytes kept between them are the
exact allocations, independent of the allocator. The logits are the unit of the check: s b V elements.

What megatron-core does (tensor_parallel/cross_entropy.py): ``.float()`` makes one fp32 copy, the max subtraction,
exp and division run in place on it, and it is saved for backward as the softmax (4 bytes per logit kept); backward
writes the gradient into that same storage, and autograd casts it to the logits' dtype (dt bytes) while it is
alive. So the peak is (4 + dt) bytes per logit, of which 4 are the kept softmax: the transient beyond what is kept
is dt, not dt + 4.
"""

from __future__ import annotations

import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

S, B, H, V = 64, 2, 16, 512


@pytest.fixture(scope="module")
def single_process():
    from aceso_megatron.testing import free_port
    from aceso_megatron.testing.reference import init_single_process

    init_single_process(free_port())


class LiveBytes(TorchDispatchMode):
    """Bytes of the tensor storages created inside the mode that are still alive, and their peak."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self._seen: set[int] = set()

    def _release(self, key: int, n: int) -> None:
        self.live -= n
        self._seen.discard(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                key = st.data_ptr()
                if key and key not in self._seen:
                    self._seen.add(key)
                    n = st.nbytes()
                    self.live += n
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(st, self._release, key, n)
        return out


def _run(dtype: torch.dtype) -> tuple[int, int, int]:
    """(peak, kept after forward, logits bytes) of the output layer's logits + megatron-core's loss, beyond the
    output layer's input and weight (made outside the tracker)."""
    from megatron.core import tensor_parallel

    torch.manual_seed(0)
    x = torch.randn(S, B, H, dtype=dtype, requires_grad=True)
    w = torch.randn(V, H, dtype=dtype, requires_grad=True)
    target = torch.randint(0, V, (S, B))
    with LiveBytes() as live:
        logits = torch.matmul(x, w.t())                                   # [s, b, V] in dt, as the output layer
        nbytes = logits.untyped_storage().nbytes()
        loss = tensor_parallel.vocab_parallel_cross_entropy(logits, target)
        del logits                                                        # _postprocess keeps the loss only
        kept = live.live - loss.untyped_storage().nbytes()
        loss.sum().backward()
    return live.peak, kept, nbytes


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_loss_keeps_fp32_softmax_and_peaks_at_it_plus_the_logits(single_process, dtype):
    from search.costmodel.memory import LOSS_KEPT_BYTES, loss_transient_bytes

    dt = torch.tensor([], dtype=dtype).element_size()
    peak, kept, logits = _run(dtype)
    elems = logits // dt
    # per-token tensors (max, sum, masks, loss) + the x / w gradients and their .grad copies (megatron-core writes
    # the weight gradient into its preallocated grad buffer: not the loss's)
    slack = 64 * S * B + 2 * dt * (S * B * H + V * H)
    # by hand: the fp32 softmax is kept; at the peak the dt-byte logits (forward) or their gradient's cast
    # (backward) live beside it -- in fp32 .float() is the logits themselves, modified in place: nothing beside it
    hand_kept, hand_peak = 4 * elems, (4 + (dt if dt < 4 else 0)) * elems
    assert abs(kept - hand_kept) <= slack, (kept, hand_kept)
    assert abs(peak - hand_peak) <= slack, (peak, hand_peak)
    # the cost model: kept (head_act_mb, in the stage's activations) + transient (head_peak_mb) = the peak
    assert LOSS_KEPT_BYTES * elems == hand_kept
    assert abs(LOSS_KEPT_BYTES * elems + loss_transient_bytes(elems, dt) - peak) <= slack
