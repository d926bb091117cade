"""HF's router without renormalization (``norm_topk_prob`` false: Qwen2-MoE, Qwen3-MoE, DeepSeek's softmax scoring)
is megatron-core's pre-softmax router, in numbers: the reference the HF import's mapping
(``search.spec.hf_moe._router``, tests/unit/test_router_pre_softmax.py) rests on."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
moe_utils = pytest.importorskip("megatron.core.transformer.moe.moe_utils")


def test_pre_softmax_is_hf_routing_without_renormalization():
    """The independent reference, in numbers: HF's router (softmax over all experts, top-k, no renormalization)
    against megatron-core's ``topk_routing_with_score_function(use_pre_softmax=True)``."""
    logits = torch.randn(16, 64, generator=torch.Generator().manual_seed(0))
    weights, experts = torch.topk(torch.softmax(logits, dim=-1), 8, dim=-1)           # HF, norm_topk_prob false
    probs, routing_map = moe_utils.topk_routing_with_score_function(logits, 8, use_pre_softmax=True)
    assert torch.equal(routing_map.nonzero()[:, 1].view(16, 8).sort(-1).values, experts.sort(-1).values)
    assert torch.allclose(probs.gather(1, experts), weights)
    renormed, _ = moe_utils.topk_routing_with_score_function(logits, 8, use_pre_softmax=False)
    assert torch.allclose(renormed.gather(1, experts), weights / weights.sum(-1, keepdim=True))
