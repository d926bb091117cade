"""A T5 model with ``position_embedding: rope`` is refused for the aceso runtime before any search, in one line naming
the field: the runtime's T5 stages build learned absolute position embeddings only, so before, such a spec validated
and trained another model (learned positions, no rotation). Stock megatron-core builds it otherwise:
``T5Model(position_embedding_type="rope")`` holds no position-embedding parameter and rotates the self-attention of
encoder and decoder; Megatron-LM's pretrain_t5.py passes --position-embedding-type through, so it stays a target."""

from __future__ import annotations

from search.spec.model import ModelSpec
from search.targets.capabilities import model_refusal, plan_refusal
from search.spec.plan import uniform_plan
from search.spec.cluster import parse_cluster
from tests.tiny_models import T5

ROPE = ModelSpec.model_validate({**T5.model_dump(), "position_embedding": "rope"})   # validates as a model


def test_t5_rope_is_refused_for_the_runtime_in_one_line():
    why = model_refusal("aceso", ROPE)
    assert why is not None and why.startswith("model.position_embedding rope with T5") and "\n" not in why, why
    plan = uniform_plan(ROPE, 1, 1, 1, 2, 4, cluster=parse_cluster("1x1-cpu"))
    assert plan_refusal(plan, "aceso", "cpu") == why


def test_learned_t5_and_megatron_lm_are_not_refused():
    assert T5.position_embedding == "learned" and model_refusal("aceso", T5) is None
    assert model_refusal("megatron-lm", ROPE) is None

