"""The installed megatron-core (0.16.1 on Python 3.11, 0.19.x on 3.12) builds the EP overlap's combined 1F1B
schedule from ``build_schedule_plan`` (pipeline_parallel/combined_1f1b.py), which GPTModel has and the hybrid
model classes (MambaModel; 0.19's HybridModel) do not: why the planner refuses the overlap on a hybrid-pattern run
(search/megatron/hybrid_pattern.py EP_OVERLAP_REFUSAL, tests/unit/test_hybrid_ep_overlap.py)."""

import importlib

import pytest


def test_only_gpt_model_builds_the_ep_overlap_schedule():
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.mamba import MambaModel
    assert hasattr(GPTModel, "build_schedule_plan")
    assert not hasattr(MambaModel, "build_schedule_plan")


def test_hybrid_model_does_not_build_it():
    try:
        hybrid = importlib.import_module("megatron.core.models.hybrid.hybrid_model").HybridModel
    except ImportError:
        pytest.skip("this megatron-core has no HybridModel (0.16.1: MambaModel only)")
    assert not hasattr(hybrid, "build_schedule_plan")
