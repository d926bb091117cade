"""Gradient and optimizer bytes follow megatron-core's DDP buffers and the distributed optimizer's shards.

References: megatron-core's own ``_ParamAndGradBuffer`` built on the meta device as its DDP builds it
(``patches.compat.param_and_grad_buffer``) (its layout code runs unchanged;
only ``torch.cuda.current_device`` is pointed at the meta device) for the buffer sizes, padding and dtypes, and the
hand-computed bytes per parameter of docs/distrib_optimizer.md (megatron-core: bf16 weights with fp32 gradients
are 6 + 12/d bytes with the distributed optimizer, 18 without; d = the shard group, dp x cp).
"""

from __future__ import annotations

import random
import warnings
from unittest import mock

import pytest

from search.costmodel.memory import ddp_buffer_numel, state_bytes_per_param
from search.spec.model import ModelSpec

warnings.filterwarnings("ignore", message=".*Transformer Engine.*")
torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from megatron.core.distributed import DistributedDataParallelConfig  # noqa: E402
from megatron.core.process_groups_config import ProcessGroupCollection  # noqa: E402

from aceso_megatron.model.meta_groups import Group  # noqa: E402
from aceso_megatron.testing.meta_params import build_chunk, world_of_one  # noqa: E402
from patches.compat import param_and_grad_buffer  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def one_rank():
    with world_of_one():
        yield


def megatron_buffer(params, dpc: int, dist: bool, fp32_grads: bool, bucket_size=None):
    """megatron-core's grad (and param) buffer for ``params`` over a shard group of ``dpc`` ranks."""
    groups = ProcessGroupCollection()
    groups.tp, groups.dp_cp = Group(1), Group(dpc)
    cfg = DistributedDataParallelConfig(use_distributed_optimizer=dist, grad_reduce_in_fp32=fp32_grads)
    with mock.patch("torch.cuda.current_device", return_value="meta"):
        return param_and_grad_buffer(cfg, torch.bfloat16, torch.float32 if fp32_grads else torch.bfloat16, params,
                                     Group(dpc), bucket_size, {p: str(i) for i, p in enumerate(params)}, 1.0,
                                     list(range(len(params))), False, groups)


def _params(numels, shared=()):
    with torch.device("meta"):
        ps = [torch.nn.Parameter(torch.empty(n, dtype=torch.bfloat16)) for n in numels]
    for i in shared:
        ps[i].shared_embedding = True
    return ps


@pytest.mark.parametrize("seed", range(12))
def test_buffer_layout_equals_megatron_core(seed):
    """Random parameter lists, shard groups, bucket sizes and a tied embedding: same elements and buckets."""
    rng = random.Random(seed)
    numels = [rng.choice((1, 63, 64, 65, 127, 4096, 12288, 50000)) * rng.randint(1, 7) for _ in range(rng.randint(1, 30))]
    dpc, dist = rng.choice((1, 2, 3, 6, 8, 48, 96)), seed % 3 != 0
    bucket = rng.choice((None, 4096, 100_000))
    shared = frozenset({0}) if seed % 4 == 1 else frozenset()
    buf = megatron_buffer(_params(numels, shared), dpc, dist, seed % 2 == 0, bucket)
    assert ddp_buffer_numel(numels, dpc, dist, bucket, shared) == (buf.numel, len(buf.buckets))
    assert buf.numel >= sum(numels)


@pytest.mark.parametrize("fp32_grads", (True, False))
@pytest.mark.parametrize("dist", (True, False))
def test_grad_and_param_buffers_of_a_real_stage(dist, fp32_grads):
    """A Llama-style stage as megatron-core builds it: the grad buffer's dtype follows grad_reduce_in_fp32, the
    distributed optimizer adds a bf16 param buffer of the same (padded) size that the weights move into, and the
    padding is a few elements per tensor (what the cost model leaves out, ``ddp_buffer_numel``)."""
    model = ModelSpec(name="l", family="llama", num_layers=2, hidden_size=512, num_attention_heads=8,
                      num_query_groups=2, ffn_hidden_size=1408, seq_length=256, vocab_size=32000,
                      activation="swiglu", normalization="rmsnorm", position_embedding="rope", tied_embeddings=False,
                      add_bias_linear=False, params_dtype="bf16")
    with torch.device("meta"):
        params = list(build_chunk(model, 2, 1, (2,), 0, 0).parameters())
    numels = [p.numel() for p in params]
    buf = megatron_buffer(params, 8, dist, fp32_grads, bucket_size=40_000_000)
    assert buf.grad_data.dtype == (torch.float32 if fp32_grads else torch.bfloat16)
    assert (buf.param_data is not None) == dist and (not dist or buf.param_data.numel() == buf.numel)
    assert ddp_buffer_numel(numels, 8, dist, 40_000_000) == (buf.numel, len(buf.buckets))
    pad = buf.numel - sum(numels)
    assert 0 <= pad <= 63 * len(numels) + 1024 and (dist or pad == 0)


def test_bytes_per_parameter_follow_megatron_cores_table():
    """docs/distrib_optimizer.md's table (bf16 params, fp32 grads): 18 B without, 6 + 12/d with the distributed
    optimizer; bf16 gradients save 2 B; fp32 training keeps 4 + 4 + 8."""
    for d in (1, 8, 64):
        w, g, o = state_bytes_per_param("bf16", True, d, grad_fp32=True)
        assert w + g + o == pytest.approx(6 + 12 / d)
        w, g, o = state_bytes_per_param("bf16", True, d, grad_fp32=False)
        assert w + g + o == pytest.approx(4 + 12 / d)
    assert sum(state_bytes_per_param("bf16", False, 8, grad_fp32=True)) == 18
    assert sum(state_bytes_per_param("fp32", False, 8)) == 16
