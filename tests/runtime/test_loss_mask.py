"""The loss counts only tokens whose ``loss_mask`` is 1, normalised by their global count."""

from __future__ import annotations

import pytest
import torch

from tests.tiny_models import GPT


@pytest.fixture(scope="module")
def runtime():
    from aceso_megatron.training.engine import build_runtime
    from aceso_megatron.testing.reference import init_single_process
    from aceso_megatron.testing import free_port

    init_single_process(free_port())
    raw = {"model": GPT.model_dump(), "micro_batch_size": 2, "global_batch_size": 4,
           "stages": [{"num_gpus": 1, "tp": 1, "dp": 1, "start_unit": 0, "end_unit": GPT.num_units,
                       "recompute": ["none"] * GPT.num_units}]}
    return build_runtime(raw, 0, 1, seed=3)


def batches(mask=None, labels_at_masked=None):
    from aceso_megatron.testing import make_batches

    out = make_batches(GPT, 2, 4, seed=11)
    for b in out:
        if mask is not None:
            b["loss_mask"] = mask.clone()
            if labels_at_masked is not None:
                b["labels"] = torch.where(mask.bool(), b["labels"], torch.full_like(b["labels"], labels_at_masked))
    return out


def loss_and_grads(rt, micro_batches):
    loss = rt.forward_backward(iter(micro_batches))
    return loss, {k: v.clone() for k, v in rt.full_grads().items()}


def test_loss_mask(runtime):
    s = GPT.seq_length
    first = torch.zeros(2, s)
    first[:, : s // 2] = 1
    plain, g_plain = loss_and_grads(runtime, batches())
    ones, g_ones = loss_and_grads(runtime, batches(torch.ones(2, s)))
    a, g_a = loss_and_grads(runtime, batches(first))
    b, _ = loss_and_grads(runtime, batches(1 - first))
    assert ones == pytest.approx(plain, rel=1e-6)
    for k in g_plain:
        torch.testing.assert_close(g_ones[k], g_plain[k])
    # linearity: the two halves' means, weighted by their token counts, give the mean over all tokens
    assert (a + b) / 2 == pytest.approx(plain, rel=1e-6)
    # labels under a zero mask do not matter
    a2, g_a2 = loss_and_grads(runtime, batches(first, labels_at_masked=7))
    assert a2 == pytest.approx(a, rel=1e-6)
    for k in g_a:
        torch.testing.assert_close(g_a2[k], g_a[k])
