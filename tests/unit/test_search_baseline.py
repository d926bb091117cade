"""The uniform baseline against an independent enumeration of Megatron-LM configurations, built as ParallelPlans
(``search.spec.plan.uniform_plan``) and priced by the cost model's own ``evaluate``."""

import itertools

import pytest

from search.spec.cluster import parse_cluster
from search.pricing import make_cost_model
from search.spec.plan import ChunkSpec, ParallelPlan, StageSpec, uniform_plan
from search.planner import megatron_lm
from search.planner.api import make_space
from search.planner.baseline import baseline_plan, best_uniform, layer_splits
from search.spec.presets import load_model
from search.spec.training import TrainingSpec

GBS = 64
BATCHES = (8, 16)          # per-rank candidates large enough that the tighter limits need recompute
FEATURES = [dict(distributed_optimizer=d, overlap_grad_reduce=g, overlap_param_gather=p)
            for d, g, p in itertools.product((False, True), repeat=3) if d or not p]


def _recompute(model, a, b, setting):
    """Megatron-LM's recompute settings as per-unit choices, written out independently of megatron_lm.Setting."""
    units = model.units[a:b]
    if setting == "none":
        return ["none"] * len(units)
    if setting == "selective":   # --recompute-granularity selective (core_attn): the attention core only
        return ["selective" if u.kind != "mlp" else "none" for u in units]
    if setting == "full":        # full, uniform, 1 layer per checkpoint
        return ["full"] * len(units)
    n = setting[1]               # full, block, n: the first n layers of the chunk
    layers = list(dict.fromkeys((u.stack, u.layer) for u in units))[:n]
    return ["full" if (u.stack, u.layer) in layers else "none" for u in units]


def _with_setting(plan, setting) -> ParallelPlan:
    stages = [StageSpec(num_gpus=s.num_gpus, tp=s.tp, cp=s.cp, dp=s.dp, sequence_parallel=s.sequence_parallel,
                        chunks=[ChunkSpec(start_unit=c.start_unit, end_unit=c.end_unit,
                                          recompute=_recompute(plan.model, c.start_unit, c.end_unit, setting))
                                for c in s.chunks]) for s in plan.stages]
    return plan.model_copy(update={"stages": stages})


def _reference(model, cluster, cm, layers):
    """(best fitting iteration ms, least memory of any configuration without recompute)."""
    best, least_none = float("inf"), float("inf")
    for pp, tp, b, v, sp in itertools.product((1, 2, 4), (1, 2, 4), BATCHES, (1, 2), (False, True)):
        if 4 % (pp * tp) or (sp and tp == 1) or (v > 1 and (pp == 1 or layers % (pp * v))):
            continue
        dp = 4 // (pp * tp)
        m = b * dp
        if GBS % m or (v > 1 and (GBS // m) % pp):
            continue
        per_chunk = layers // (pp * v)
        settings = ["none", "selective", "full"] + [("block", n) for n in range(1, per_chunk)]
        for feats, setting in itertools.product(FEATURES, settings):
            plan = uniform_plan(model, pp, tp, dp, m, GBS, "none", cluster, sequence_parallel=sp,
                                num_virtual_stages=v, **feats)
            cost = cm.evaluate(_with_setting(plan, setting))
            if setting == "none":
                least_none = min(least_none, cost.max_memory_mb)
            if cost.fits:
                best = min(best, cost.iteration_ms)
    return best, least_none


def _check(model, cluster, training):
    cm = make_cost_model(model, cluster, training)
    want, least_none = _reference(model, cluster, cm, 4)
    res = best_uniform(cm, GBS, make_space(cm, training, "megatron-lm"), model)
    assert res.iteration_ms == pytest.approx(want, rel=1e-12)
    plan = baseline_plan(res, model, cluster, GBS, "analytic")
    assert cm.evaluate(plan).iteration_ms == pytest.approx(res.iteration_ms, rel=1e-12)
    assert megatron_lm.problem(plan) is None
    assert plan.micro_batch_per_rank(0) == res.micro_batch_per_rank and plan.micro_batch_size == res.mbs
    return res, least_none


@pytest.mark.parametrize("squeeze", [0.97, 0.85])
def test_best_uniform_equals_enumeration_of_megatron_configs(squeeze):
    model = load_model("gpt-1.3b", num_layers=4)
    training = TrainingSpec(global_batch_size=GBS, micro_batch_sizes=list(BATCHES))
    res, least_none = _check(model, parse_cluster("1x4-h100"), training)
    assert res.recompute == "none"
    # below the least memory any configuration needs without recompute: every fitting one recomputes
    tight = parse_cluster("1x4-h100", memory_limit_mb=least_none * squeeze)
    res, _ = _check(model, tight, training)
    assert res.fits and res.recompute != "none"


def test_layer_splits_follow_megatron_first_last_adjustment():
    assert layer_splits(24, 4) == [(6, 6, 6, 6)]
    for split in layer_splits(10, 4):  # middle stages equal, first/last take the rest
        assert sum(split) == 10 and split[1] == split[2] and min(split) >= 1
    assert layer_splits(3, 4) == []


def test_a_model_too_big_for_the_cluster_says_how_many_gpus_it_needs(capsys):
    """Issue 32: DeepSeek-V3 on one node said "raise --memory-limit-mib to 1483493", above the H100's 81920 MiB.
    Over the GPU's own memory the line says the model does not fit on these GPUs and the GPUs its model states
    alone need: the published 682.6B parameters (671B + the MTP layer) x 16 bytes (bf16 weight and gradient, fp32
    master weight and Adam moments: ZeRO, section 3.1) over what an H100 leaves (80 GiB less the 3% headroom and
    the 1 GiB reserve); a --memory-limit-mib below the GPU is still the fix it names."""
    from search.cli import main

    usable = 81920 * 0.97 - 1024
    need = int(-(-682.64e9 * 16 // (usable * 2**20)))
    assert need == 133
    for cmd in ("baseline", "search"):
        assert main([cmd, "--model", "deepseek-v3", "--cluster", "1x8-h100", "--global-batch-size", "512",
                     "--target", "megatron-lm"]) == 2
        err = capsys.readouterr().err
        assert f"deepseek-v3 does not fit on 8 h100 GPUs (81920 MiB each)" in err, err
        assert f"need at least {need} GPUs: try --cluster 17x8-h100" in err and "--memory-limit-mib" not in err
    assert main(["baseline", "--model", "llama3-8b", "--cluster", "1x8-h100", "--global-batch-size", "512",
                 "--memory-limit-mib", "8000"]) == 2
    err = capsys.readouterr().err
    assert "raise --memory-limit-mib to" in err and "(the h100 has 81920 MiB)" in err, err


def test_a_bf16_model_on_a_v100_plans_in_fp16_and_writes_it(tmp_path, capsys):
    """Issue 32: bf16 on a V100 was priced at the fp16 peak; ``--precision bf16`` there is now refused
    (tests/unit/test_bad_inputs.py), and a bf16 preset without --precision plans in fp16 with a note. The written
    plan's model is in the precision it was priced in (baseline wrote the preset's bf16)."""
    import json

    from search.cli import main

    args = ["baseline", "--model", "llama3-8b", "--num-layers", "2", "--cluster", "1x8-v100", "--global-batch-size",
            "16", "--json"]
    assert main([*args, "-o", str(tmp_path / "a.json")]) == 0
    out = capsys.readouterr()
    assert "llama3-8b is a bf16 model and the v100 has no bf16: planning fp16" in out.err
    assert main([*args, "--precision", "fp16", "-o", str(tmp_path / "b.json")]) == 0
    assert json.loads(capsys.readouterr().out)["iteration_ms"] == json.loads(out.out)["iteration_ms"]
    for name in ("a.json", "b.json"):
        assert json.loads((tmp_path / name).read_text())["model"]["params_dtype"] == "fp16"


def test_baseline_writes_a_runtime_plan_where_offload_would_win(tmp_path, capsys):
    """Qwen3-30B-A3B on a GB200 rack: the fastest one-stage Megatron-LM setting offloads activations, which the aceso
    runtime does not run; baseline tried it anyway (the offload switch was read from the cost model's training spec,
    not the runtime one) and exited 2 naming activation_offload. Now it writes the best plan the runtime runs."""
    import json

    from search.cli import main

    out = tmp_path / "b.json"
    assert main(["baseline", "--model", "qwen3-30b-a3b", "--cluster", "16x4-gb200:nvl72", "--global-batch-size",
                 "512", "--json", "-o", str(out)]) == 0, capsys.readouterr().err
    plan = json.loads(out.read_text())
    assert plan.get("activation_offload") is None and plan.get("megatron_fsdp") is None
    assert main(["validate", str(out)]) == 0
