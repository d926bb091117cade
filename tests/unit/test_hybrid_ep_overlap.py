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


# The fine-grained offload on a hybrid model: core_v0.16.1 to core_v0.17.1's MambaModel never starts the offload
# manager's chunk handler (HybridModel's preprocess_for_fine_grained_offloading came with core_v0.18.0), so the flag
# moves nothing there (tests/runtime/test_hybrid_ep_overlap_core.py checks the installed classes).
def _offload_plan():
    from search.settings.stack import FineGrainedOffload, StackSettings
    plain = cut_plan(NANO8, [0, NANO8.num_units], 1, dp=8, gbs=64)
    data = plain.model_dump()
    data["stages"][0]["ep"] = 2
    data["settings"] = {**(data.get("settings") or {}),
                        "stack": StackSettings(offload=FineGrainedOffload(modules=("expert_fc1",))).model_dump()}
    return type(plain).model_validate(data)


def test_the_hybrid_offload_is_written_for_0_18_on_only():
    import pytest

    from search.megatron.config import NotExpressible
    from search.megatron.hybrid_pattern import hybrid_form
    from search.megatron.versions import release
    plan = _offload_plan()
    for version in ("0.18", "0.19"):
        hybrid_form(plan, release(version))
    with pytest.raises(NotExpressible, match="never starts the offload"):
        hybrid_form(plan, release("0.17"))


def test_the_import_refuses_a_0_17_hybrid_line_with_the_offload():
    import pytest

    from search.io.errors import AcesoError
    from search.megatron.hybrid_pattern import args_line, hybrid_form
    from search.megatron.importer import read_megatron
    from search.megatron.versions import release
    line = "python pretrain_hybrid.py " + args_line(hybrid_form(_offload_plan(), release("0.18")))
    assert read_megatron(line, world_size=8, version="0.18").plan.settings.stack.offload is not None
    with pytest.raises(AcesoError, match="never starts the offload"):
        read_megatron(line, world_size=8, version="0.17")


def test_the_search_offers_the_hybrid_offload_from_megatron_core_0_18():
    from search.planner import fine_offload
    from search.pricing import cost_model
    from search.settings.plan_settings import PlanSettings
    from search.spec.training import TrainingSpec
    cl = parse_cluster("1x8-h100")
    tr = TrainingSpec(global_batch_size=64)
    for release, offered in (("26.04.01", False), ("0.17", False), ("0.18", True), ("0.19", True)):
        cm = cost_model(NANO8, cl, tr, PlanSettings(release=release))
        assert fine_offload.offered(cm, "megatron-lm") == offered, release
    cm = cost_model(MIXTRAL4, cl, tr, PlanSettings(release="26.04.01"))      # GPTModel: from 0.16
    assert fine_offload.offered(cm, "megatron-lm")


# megatron-core asserts at most one MTP layer with the EP overlap (core_v0.16.1 transformer_config.py:1889 to
# core_v0.19.0 :2709; each release's own config refuses the line: checked with tests/runtime/megatron_lm_oracle.py):
# a GPT MoE model with two MTP layers
def _mtp2():
    return type(MIXTRAL4).model_validate({**MIXTRAL4.model_dump(), "name": "custom", "aceso_db_key": None,
                                          "mtp_num_layers": 2})


def test_the_ep_overlap_with_two_mtp_layers_is_neither_offered_nor_read():
    import pytest

    from search.io.errors import AcesoError
    from search.megatron import megatron_config
    from search.megatron.importer import read_megatron
    from search.megatron.script import args_line
    from search.megatron.versions import release
    m = _mtp2()
    assert not any(c.overlap_ep_comm for c in candidates(m, parse_cluster("1x8-h100"), None, "megatron-lm"))
    plain = cut_plan(m, [0, m.num_units], 1, dp=8, gbs=64)
    data = plain.model_dump()
    data["stages"][0]["ep"] = 2
    line = args_line(megatron_config(type(plain).model_validate(data)), release("0.19"))
    read_megatron(line, world_size=8, version="0.19")
    data["settings"] = {**(data.get("settings") or {}),
                        "moe": MoEPlanSettings(overlap_ep_comm=True, delay_wgrad=True).model_dump()}
    with pytest.raises(ValueError, match="at most one MTP layer"):
        type(plain).model_validate(data)
    for version in ("0.16", "0.19"):
        with pytest.raises(AcesoError, match="at most one MTP layer"):
            read_megatron(line.strip() + " --overlap-moe-expert-parallel-comm --delay-wgrad-compute", world_size=8,
                          version=version)
