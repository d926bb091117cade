"""megatron-core's EP overlap (``--overlap-moe-expert-parallel-comm``) builds its combined 1F1B schedule from
``model.build_schedule_plan``, which only GPTModel has (core_v0.17.1 to core_v0.19.0; pretrain_hybrid.py's
forward_step takes no ``return_schedule_plan``): a hybrid-pattern run (HybridModel) cannot run it. The search does
not offer it on a hybrid model and a hybrid plan with it is not expressible; a GPT MoE model keeps it. (The
installed megatron-core's classes: tests/runtime/test_hybrid_ep_overlap_core.py.)"""

from search.megatron.expressible import check_expressible
from search.megatron.hybrid_pattern import EP_OVERLAP_REFUSAL
from search.planner.dispatchers import candidates
from search.settings.moe_plan import MoEPlanSettings
from search.spec.cluster import parse_cluster
from tests.hybrid_plans import MIXTRAL4, NANO8, cut_plan


def test_the_search_offers_the_ep_overlap_to_gpt_models_only():
    cl = parse_cluster("1x8-h100")
    assert any(m.overlap_ep_comm for m in candidates(MIXTRAL4, cl, None, "megatron-lm"))
    assert not any(m.overlap_ep_comm for m in candidates(NANO8, cl, None, "megatron-lm"))
    assert candidates(NANO8, cl, None, "megatron-lm")        # the dispatchers are still offered


def test_a_hybrid_plan_with_the_ep_overlap_is_not_expressible():
    plain = cut_plan(NANO8, [0, NANO8.num_units], 1, dp=8, gbs=64)
    assert check_expressible(plain) is None
    data = plain.model_dump()
    data["settings"] = {**(data.get("settings") or {}),
                        "moe": MoEPlanSettings(overlap_ep_comm=True, delay_wgrad=True).model_dump()}
    data["stages"][0]["ep"] = 2
    overlap = type(plain).model_validate(data)
    assert EP_OVERLAP_REFUSAL in check_expressible(overlap)


def test_the_import_refuses_a_hybrid_line_with_the_ep_overlap():
    import pytest

    from search.io.errors import AcesoError
    from search.megatron.hybrid_pattern import args_line, hybrid_form
    from search.megatron.importer import read_megatron
    plain = cut_plan(NANO8, [0, NANO8.num_units], 1, dp=8, gbs=64)
    data = plain.model_dump()
    data["stages"][0]["ep"] = 2
    line = "python pretrain_hybrid.py " + args_line(hybrid_form(type(plain).model_validate(data)))
    assert read_megatron(line, world_size=8).plan.stages[0].ep == 2
    with pytest.raises(AcesoError, match="--overlap-moe-expert-parallel-comm"):
        read_megatron(line.strip() + " --overlap-moe-expert-parallel-comm --delay-wgrad-compute", world_size=8)
