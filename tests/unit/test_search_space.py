"""The search space: per-rank micro-batches (data parallelism limited only by the GPUs and the global batch), GPU
splits, plan-level switches from the training spec and the cost model, and the legality rules of each target."""

import pytest

from search.spec.cluster import parse_cluster
from search.pricing import make_cost_model
from search.costmodel.types import ALL_FEATURES, Features, Shape
from search.io.errors import AcesoError
from search.spec.plan import uniform_plan
from search.planner.space import Space
from search.planner.state import State
from search.spec.presets import load_model
from search.spec.training import TrainingSpec


def _space(model="gpt-1.3b", cluster="1x8-h100", gbs=512, priced=ALL_FEATURES, target="aceso", layers=None,
           **training):
    m = load_model(model, num_layers=layers)
    return m, Space.of(m, parse_cluster(cluster), TrainingSpec(global_batch_size=gbs, **training), priced=priced,
                       target=target)


def test_dp_is_limited_only_by_gpus_and_global_batch():
    # 2304 H100s, TP8 PP6 DP48 at --micro-batch-size 1 (a published configuration): pipeline micro-batch 48
    model, space = _space("gpt-175b", "288x8-h100", 2304)
    starts = model.layer_starts
    st = State(48, (Shape(8, 48, 1, True),) * 6, tuple(starts[16 * k] for k in range(7)), Features(True, True, True))
    assert space.legal(st)
    assert space.legal_mbs(st.shapes) == [48, 96, 192, 384]          # per-rank 1, 2, 4, 8
    plan = uniform_plan(model, 6, 8, 48, 48, 2304, cluster=parse_cluster("288x8-h100"), sequence_parallel=True)
    assert plan.micro_batch_per_rank(0) == 1 and plan.num_micro_batches == 48
    assert [384] * 6 in space.gpu_splits(6)                          # the even split exists for S = 6


def test_mixed_dp_share_one_pipeline_micro_batch():
    _, space = _space(cluster="2x8-h100", gbs=256)
    assert space.legal_mbs((Shape(1, 8), Shape(1, 16))) == [16, 32, 64]   # per-rank (2, 1), (4, 2), (8, 4)
    assert space.legal_mbs((Shape(1, 8), Shape(2, 4))) == [8, 16, 32]     # (1, 2), (2, 4), (4, 8)
    # a stage's dp doubling: m kept when every per-rank batch stays a candidate, else that stage's per-rank kept
    assert space.retarget_mbs((Shape(1, 4), Shape(1, 8)), 8, keep=1, old_dp=4) == 8
    assert space.retarget_mbs((Shape(1, 4), Shape(1, 16)), 8, keep=1, old_dp=8) == 16
    assert space.retarget_mbs((Shape(1, 1), Shape(1, 64)), 8) is None     # per-rank ratio 64 > 8 / 1


def test_gpu_splits_keep_dp_ratios_powers_of_two():
    _, space = _space(cluster="1x8-h100")
    assert space.gpu_splits(3) == [[2, 2, 4]]
    _, big = _space("gpt-175b", "288x8-h100", 2304)
    for counts in big.gpu_splits(5):
        assert sum(counts) == 2304 and max(counts) // min(counts) in (1, 2, 4)


def test_feature_combinations_from_training_and_cost_model():
    _, space = _space()
    assert space.features[0] == Features(True, True, True) and len(space.features) == 6
    assert all(f.distributed_optimizer or not f.overlap_param_gather for f in space.features)
    _, off = _space(distributed_optimizer=False)
    assert {f.distributed_optimizer or f.overlap_param_gather for f in off.features} == {False}
    _, compat = _space(priced=frozenset())                 # a model that prices none: exactly the v1 space
    assert compat.features == (Features(),) and compat.sps == (False,) and compat.vs == (1,) and compat.cps == (1,)
    with pytest.raises(AcesoError, match="--overlap on"):
        _space(priced=frozenset(), overlap_grad_reduce=True)
    with pytest.raises(AcesoError, match="--virtual-stages"):
        _space(priced=frozenset(), virtual_stages=[2])


def test_cp_candidates_follow_the_model():
    _, space = _space(context_parallel_sizes=[1, 2, 3, 4])
    assert space.cps == (1, 2, 4)                          # 2 cp must divide the 2048 tokens
    _, t5 = _space("t5-770m", "1x8-h100", 512, context_parallel_sizes=[1, 2], virtual_stages=[1, 2])
    assert t5.cps == (1,) and t5.vs == (1,)                # megatron-core's T5 has neither


def test_interleaving_needs_micro_batches_in_groups_of_stages():
    model, space = _space(gbs=96, layers=4)
    shapes = (Shape(2, 2, 1, True),) * 2
    bounds = (0, 2, 4, 6, 8)
    assert space.legal(State(4, shapes, bounds, space.features[0]))       # 24 micro-batches, 2 stages
    assert not space.legal(State(32, shapes, bounds, space.features[0]))  # 3 micro-batches
    assert not space.legal(State(4, shapes, bounds[:3] + (8,), space.features[0]))  # 3 chunks on 2 stages


def test_megatron_lm_space_is_uniform_and_cuts_on_layers():
    model, space = _space(target="megatron-lm", layers=4)
    f = space.features[0]
    assert space.legal(State(8, (Shape(2, 2, 1, True),) * 2, (0, 2, 8), f))       # uneven layers are fine
    assert not space.legal(State(8, (Shape(2, 2, 1, True),) * 2, (0, 3, 8), f))   # inside layer 1
    assert not space.legal(State(8, (Shape(2, 2, 1, True), Shape(4, 1, 1, True)), (0, 4, 8), f))
    assert not space.legal(State(8, (Shape(2, 2, 1, True), Shape(2, 2, 1, False)), (0, 4, 8), f))


def test_sequence_parallel_rules():
    model, space = _space(layers=4)
    assert space.shape_ok(Shape(2, 4, 1, True)) and space.shape_ok(Shape(2, 4, 1, False))
    assert not space.shape_ok(Shape(1, 8, 1, True))
    _, on = _space(layers=4, sequence_parallel=True)
    assert not on.shape_ok(Shape(2, 4, 1, False)) and on.sp_for(4, 1, False) is True
    cm = make_cost_model(model, parse_cluster("1x8-h100"), TrainingSpec(global_batch_size=512))
    assert "sequence_parallel" in cm.features


def test_cost_model_coverage_filters_shapes():
    # a cost model that covers only some (per-rank batch, tp) pairs (aceso-compat's profiled files)
    m = load_model("gpt-1.3b")
    space = Space.of(m, parse_cluster("1x4-v100"), TrainingSpec(global_batch_size=512),
                     allowed={(1, 1), (2, 1), (1, 2)})
    assert space.allows(1, 2, 4) and not space.allows(1, 4, 16)          # per-rank 2 at tp 1, per-rank 4
    assert {(s.tp, s.dp) for s in space.shapes(4, 4)} == {(1, 4)}        # tp 2 x dp 2 runs per-rank 2 at tp 2
    assert space.legal_mbs((Shape(1, 1), Shape(2, 1))) == [1]             # m = 2 would run per-rank 2 at tp 2
    assert space.candidate_shapes() - space.allowed == {(b, t) for b in (1, 2, 4, 8) for t in (1, 2, 4)} - \
        {(1, 1), (2, 1), (1, 2)}


def test_tp1_plans_of_a_tp_comm_overlap_run_are_in_the_space():
    """--tp-comm-overlap asks for TE's TP overlap on every tp > 1 stage; Megatron-LM turns sequence parallelism
    off at tp 1 and asserts the overlap only with it (validate_args), so a tp-1 plan runs without the flag:
    ``normalize`` turns it off there, and the space keeps that plan (it refused every tp-1 plan of such a run)."""
    for target in ("aceso", "megatron-lm"):
        model, space = _space(tp_comm_overlap=True, target=target)
        assert all(f.tp_comm_overlap for f in space.features)
        starts = model.layer_starts
        tp1 = space.normalize(State(8, (Shape(1, 4), Shape(1, 4)), (0, starts[12], starts[-1]), space.features[0]))
        assert not tp1.features.tp_comm_overlap and space.legal(tp1), space.refusal(tp1)
        # the flag stays what the run asked for where a stage has tp > 1
        tp2 = space.normalize(State(8, (Shape(2, 2, 1, True),) * 2, tp1.bounds, space.features[0]))
        assert tp2.features.tp_comm_overlap and space.legal(tp2)
        assert not space.legal(tp2._replace(features=tp1.features))
