"""``patches.shared_embedding_bucket`` on megatron-core's own ``_ParamAndGradBuffer`` (meta device, as
``test_memory_buffers.py``): without the distributed optimizer each ``shared_embedding`` parameter ends up in a
bucket of its own, cut out of the buckets megatron-core built (hand-computed layouts below), with every parameter
at the same place in the buffer; distributed-optimizer buffers (megatron-core already splits them) are untouched;
``revert()`` restores megatron-core's single shared bucket. The distributed run (overlap, gradients equal to stock
megatron-core) is ``tests/distributed/test_tied_bucket.py``.
"""

from __future__ import annotations

import warnings

import pytest

warnings.filterwarnings("ignore", message=".*Transformer Engine.*")
torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from aceso_megatron.testing.meta_params import world_of_one  # noqa: E402
from patches import shared_embedding_bucket  # noqa: E402
from tests.runtime.test_memory_buffers import _params, megatron_buffer  # noqa: E402


@pytest.fixture(autouse=True)
def one_rank():
    with world_of_one():
        yield
    shared_embedding_bucket.revert()


def _layout(buf):
    return [(b.offset, b.offset + b.grad_data.numel(), [buf.param_index_map[p][:2] for p in b.params_list])
            for b in buf.buckets]


# (numels in registration order, shared indices, bucket_size) -> buckets as (start, end) after the patch.
# Parameters are laid out in reverse order: the last registered one starts at 0.
CASES = [
    ([10, 20, 30, 40], {0}, None, [(0, 90), (90, 100)]),             # the first stage: embedding registered first
    ([40, 30, 20, 10], {3}, None, [(0, 10), (10, 100)]),             # the last stage: the output layer last
    ([10, 20, 30], {1}, None, [(0, 30), (30, 50), (50, 60)]),         # a copy in the middle (T5 position embedding)
    ([30, 30, 30, 30], {0}, 50, [(0, 60), (60, 90), (90, 120)]),      # megatron-core's buckets (0,60) (60,120), cut
    ([5, 7], {0, 1}, None, [(0, 7), (7, 12)]),
]


@pytest.mark.parametrize("numels, shared, bucket_size, want", CASES)
def test_each_shared_embedding_in_a_bucket_of_its_own(numels, shared, bucket_size, want):
    stock = megatron_buffer(_params(numels, shared), 1, False, True, bucket_size)
    shared_embedding_bucket.apply()
    params = _params(numels, shared)
    buf = megatron_buffer(params, 1, False, True, bucket_size)
    assert [(lo, hi) for lo, hi, _ in _layout(buf)] == want == buf.bucket_indices
    assert len(stock.buckets) < len(buf.buckets)
    for p in params:
        bucket = buf.param_to_bucket[p]
        assert p in bucket.params and buf.buckets[buf.param_index_map[p][2]] is bucket
        if getattr(p, "shared_embedding", False):
            assert bucket.params_list == [p]
    # same place in the buffer for every parameter, same buffer size (no padding without the distributed optimizer)
    assert [v[:2] for v in buf.param_index_map.values()] == [v[:2] for v in stock.param_index_map.values()]
    assert buf.numel == stock.numel == sum(numels)


def test_distributed_optimizer_buffers_are_megatron_cores():
    numels, shared = [1000, 64, 3000, 128], {0}
    stock = megatron_buffer(_params(numels, shared), 2, True, True)
    shared_embedding_bucket.apply()
    assert _layout(megatron_buffer(_params(numels, shared), 2, True, True)) == _layout(stock)


def test_revert_restores_the_shared_bucket():
    shared_embedding_bucket.apply()
    shared_embedding_bucket.revert()
    assert not shared_embedding_bucket.is_applied()
    assert len(megatron_buffer(_params([10, 20, 30], {0}), 1, False, True).buckets) == 1
