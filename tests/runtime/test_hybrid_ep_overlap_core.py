"""The installed megatron-core (0.16.1 on Python 3.11, 0.19.x on 3.12) builds the EP overlap's combined 1F1B
schedule from ``build_schedule_plan`` (pipeline_parallel/combined_1f1b.py), which GPTModel has and the hybrid
model classes (MambaModel; 0.19's HybridModel) do not: why the planner refuses the overlap on a hybrid-pattern run
(search/megatron/hybrid_pattern.py EP_OVERLAP_REFUSAL, tests/unit/test_hybrid_ep_overlap.py). Likewise the
fine-grained offload's chunk handler (``preprocess_for_fine_grained_offloading``): GPTModel starts it; before
HybridModel (0.18) MambaModel does not, so the offload is a no-op on a hybrid run there
(hybrid_pattern.OFFLOAD_SINCE); HybridModel (and 0.19's MambaModel, its subclass) does."""

import importlib

import pytest


def _hybrid_model():
    try:
        return importlib.import_module("megatron.core.models.hybrid.hybrid_model").HybridModel
    except ImportError:
        return None


def test_only_gpt_model_builds_the_ep_overlap_schedule():
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.mamba import MambaModel
    assert hasattr(GPTModel, "build_schedule_plan") and hasattr(GPTModel, "preprocess_for_fine_grained_offloading")
    assert not hasattr(MambaModel, "build_schedule_plan")
    if _hybrid_model() is None:        # 0.16 / 0.17: MambaModel starts no offload
        assert not hasattr(MambaModel, "preprocess_for_fine_grained_offloading")


def test_hybrid_model_does_not_build_it_and_starts_the_offload():
    hybrid = _hybrid_model()
    if hybrid is None:
        pytest.skip("this megatron-core has no HybridModel (0.16.1: MambaModel only)")
    assert not hasattr(hybrid, "build_schedule_plan")
    assert hasattr(hybrid, "preprocess_for_fine_grained_offloading")
