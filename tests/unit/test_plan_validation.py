"""Plans and specs: round trip, and bad input -> exit 2 with one line naming the field (no traceback)."""

import json

import pytest

from search.cli import main
from search.spec.cluster import parse_cluster
from search.io.errors import AcesoError
from search.spec.plan import SCHEMA_VERSION, ParallelPlan, even_split, load_plan, parse_plan, plan_json_schema, uniform_plan
from search.spec.presets import load_model
from tests.conftest import ROOT


def good_plan() -> dict:
    """GPT-350M on 1x8: 3 heterogeneous stages (2 GPUs tp2, 4 GPUs dp4, 2 GPUs tp1 dp2), cut mid-layer."""
    m = load_model("gpt-350m").model_copy(update={"params_dtype": "bf16"})   # (the runtime: no fp16 on H100s)
    stages = [
        dict(num_gpus=2, tp=2, dp=1, start_unit=0, end_unit=17, recompute=["full"] * 17),
        dict(num_gpus=4, tp=1, dp=4, start_unit=17, end_unit=36, recompute=["selective"] * 19),
        dict(num_gpus=2, tp=1, dp=2, start_unit=36, end_unit=48, recompute=["none"] * 12),
    ]
    return dict(model=m.model_dump(), cluster=parse_cluster("1x8-h100").model_dump(), micro_batch_size=4,
                global_batch_size=64, stages=stages)


def test_good_plan_round_trips(tmp_path):
    plan = parse_plan(good_plan())
    assert plan.world_size == 8 and plan.num_micro_batches == 16
    assert plan.stage_of_rank(0) == 0 and plan.stage_of_rank(2) == 1 and plan.stage_of_rank(7) == 2
    assert plan.stage_units(0)[-1].kind == "attention"  # unit 16 = attention half of layer 8
    path = tmp_path / "p.json"
    path.write_text(plan.to_json())
    again = load_plan(path)
    assert again == plan and again.to_json() == plan.to_json()


def test_validate_cli_ok(tmp_path, capsys):
    path = tmp_path / "p.json"
    path.write_text(json.dumps(good_plan()))
    assert main(["validate", str(path), "--world-size", "8"]) == 0
    assert "valid plan" in capsys.readouterr().out


def validate_refuses(d: dict, tmp_path, capsys, needle: str) -> str:
    """``aceso validate`` of plan ``d`` (written in ``tmp_path``) exits 2 with one line, no traceback, naming
    ``needle``: that line."""
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(d))
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert needle in err, err
    return err


def mutate(fn):
    d = good_plan()
    fn(d)
    return d


def _set(path, value):
    def f(d):
        obj = d
        for k in path[:-1]:
            obj = obj[k]
        obj[path[-1]] = value
    return f


def _del(path):
    def f(d):
        obj = d
        for k in path[:-1]:
            obj = obj[k]
        del obj[path[-1]]
    return f


def _many(*fns):
    def f(d):
        for fn in fns:
            fn(d)
    return f


# (mutation, a string the one-line message must contain)
BAD_PLANS = [
    (_set(("stages", 0, "tp"), 3), "stages[0]"),                                   # tp*dp != num_gpus
    (_many(_set(("stages", 0, "tp"), 3), _set(("stages", 0, "num_gpus"), 3)), "tp (3) must divide"),
    (_set(("stages", 1, "dp"), 3), "stages[1]"),
    (_many(_set(("stages", 1, "start_unit"), 16), _set(("stages", 1, "recompute"), ["none"] * 20)),
     "stages[1].start_unit (16) overlaps"),
    (_many(_set(("stages", 1, "start_unit"), 18), _set(("stages", 1, "recompute"), ["none"] * 18)),
     "stages[1].start_unit (18) leaves a gap"),
    (_set(("stages", 1, "start_unit"), 18), "recompute has 19 entries for 18 units"),
    (_set(("stages", 2, "end_unit"), 47), "stages[2]"),                             # recompute length
    (_many(_set(("stages", 2, "end_unit"), 47), _set(("stages", 2, "recompute"), ["none"] * 11)), "end_unit"),
    (_many(_set(("stages", 0, "end_unit"), 0), _set(("stages", 0, "recompute"), [])), "empty"),
    (_set(("stages", 0, "recompute"), ["full"] * 16), "recompute"),
    (_set(("stages", 0, "recompute", 3), "partial"), "stages[0].chunks[0].recompute[3]"),
    (_set(("stages",), []), "stages"),
    (_set(("micro_batch_size",), 0), "micro_batch_size"),
    (_set(("micro_batch_size",), 2), "dp (4) must divide micro_batch_size"),
    (_set(("global_batch_size",), 66), "global_batch_size (66)"),
    (_set(("global_batch_size",), -1), "global_batch_size"),
    (_set(("schema_version",), SCHEMA_VERSION + 1), "schema_version"),
    (_set(("extra_field",), 1), "extra_field"),
    (_set(("stages", 0, "pp"), 2), "stages[0].pp"),
    (_del(("stages", 0, "tp")), "stages[0].tp"),
    (_del(("micro_batch_size",)), "micro_batch_size"),
    (_del(("model",)), "model"),
    (_set(("stages", 0, "num_gpus"), 0), "stages[0].num_gpus"),
    (_set(("stages", 0, "start_unit"), -1), "stages[0].chunks[0].start_unit"),
    (_set(("stages", 0, "tp"), "two"), "stages[0].tp"),
    (_set(("model", "num_attention_heads"), 3), "model"),                           # 1024 % 3 != 0
    (_set(("model", "family"), "bert"), "model.family"),
    (_set(("model", "num_query_groups"), 5), "num_query_groups"),
    (_set(("model", "num_decoder_layers"), 4), "t5 only"),
    (_set(("model", "hidden_size"), 0), "model.hidden_size"),
    (_set(("model", "activation"), "relu"), "model.activation"),
    (_set(("model", "num_layers"), 12), "end_unit (36) is past the model's 24 units"),               # plan no longer covers model
    (_set(("cluster", "num_nodes"), 2), "cluster"),                                 # 8 GPUs used, 16 in cluster
    (_many(_set(("cluster", "gpus_per_node"), 1), _set(("cluster", "num_nodes"), 8)),
     "tp (2) exceeds gpus_per_node"),
    (_many(_set(("cluster", "gpus_per_node"), 3), _set(("cluster", "num_nodes"), 3),
           _set(("stages", 2, "num_gpus"), 3), _set(("stages", 2, "dp"), 3),
           _set(("stages", 1, "tp"), 2), _set(("stages", 1, "dp"), 2),
           _set(("micro_batch_size",), 12), _set(("global_batch_size",), 48)),
     "spans two nodes"),
    (_set(("cluster", "memory_limit_mb"), 1e9), "memory_limit_mb"),
]


@pytest.mark.parametrize("case", range(len(BAD_PLANS)))
def test_bad_plan_gives_exit_2_and_one_line(case, tmp_path, capsys):
    mut, needle = BAD_PLANS[case]
    validate_refuses(mutate(mut), tmp_path, capsys, needle)


def test_at_least_30_bad_cases():
    assert len(BAD_PLANS) >= 30


@pytest.mark.parametrize("content, needle", [("{not json", "not valid JSON"), ("[1, 2]", "plan"),
                                             ("\xff\xfe", "not valid JSON")])
def test_corrupt_plan_file(content, needle, tmp_path, capsys):
    path = tmp_path / "bad.json"
    path.write_bytes(content.encode("latin-1"))
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1


def test_world_size_mismatch(tmp_path, capsys):
    path = tmp_path / "p.json"
    path.write_text(json.dumps(good_plan()))
    assert main(["validate", str(path), "--world-size", "4"]) == 2
    assert "launch has 4" in capsys.readouterr().err


def test_missing_plan_file(capsys):
    assert main(["validate", "/nonexistent/plan.json"]) == 2
    assert "no such plan file" in capsys.readouterr().err


def test_bad_cluster_strings():
    for text, needle in [("8-h100", "NODESxGPUS"), ("1x8-b900", "unknown gpu"), ("0x8-h100", "at least 1")]:
        with pytest.raises(AcesoError, match=needle):
            parse_cluster(text)
    c = parse_cluster("4x8-V100")
    assert c.num_gpus == 32 and c.gpu.name == "v100" and c.node_of(9) == 1


def test_model_spec_file_errors(tmp_path, capsys):
    bad = tmp_path / "m.json"
    bad.write_text(json.dumps({"family": "gpt", "num_layers": 2}))
    assert main(["validate", str(tmp_path / "nope.json")]) == 2
    capsys.readouterr()
    with pytest.raises(AcesoError, match="hidden_size"):
        load_model(str(bad))


def test_uniform_plan_and_even_split():
    assert even_split(10, 3) == [4, 3, 3] and sum(even_split(97, 8)) == 97
    p = uniform_plan(load_model("gpt-1.3b"), num_stages=4, tp=2, dp=1, micro_batch_size=2,
                     global_batch_size=64, cluster=parse_cluster("1x8-a100"))
    assert [s.num_units for s in p.stages] == [12] * 4 and p.world_size == 8
    t5 = uniform_plan(load_model("t5-770m"), num_stages=2, tp=1, dp=1, micro_batch_size=1, global_batch_size=8)
    assert t5.stages[0].end_unit == 24 * 2  # 24 encoder layers of 2 units
    assert t5.stages[1].num_units == 24 * 3


def test_committed_json_schema_is_current():
    committed = (ROOT / "docs" / "plan.schema.json").read_text()
    assert committed == plan_json_schema(), "docs/plan.schema.json is stale: run `python -m search.spec.plan`"
    assert ParallelPlan.model_json_schema()["additionalProperties"] is False


# ----- schema version 2: SP, CP, overlap flags, interleaved chunks ------------------------------------------------
def v2_plan() -> dict:
    """Llama-style 8 layers (16 units) on 1x8: 2 stages tp2 cp2 dp1 with SP, 2 uneven chunks each (VPP 2)."""
    m = load_model("llama2-7b").model_copy(update={"num_layers": 8, "seq_length": 4096})
    spans = [(0, 3), (3, 8), (8, 12), (12, 16)]   # model chunks 0..3: stage 0 holds 0 and 2, stage 1 holds 1 and 3
    chunk = [dict(start_unit=a, end_unit=b, recompute=["selective"] * (b - a)) for a, b in spans]
    stages = [dict(num_gpus=4, tp=2, cp=2, dp=1, sequence_parallel=True, chunks=[chunk[s], chunk[s + 2]])
              for s in range(2)]
    return dict(schema_version=3, model=m.model_dump(), cluster=parse_cluster("1x8-h100").model_dump(),
                micro_batch_size=1, global_batch_size=8, distributed_optimizer=True, overlap_grad_reduce=True,
                overlap_param_gather=True, tp_comm_overlap=True, stages=stages)


def test_v2_plan_round_trips_and_orders_chunks(tmp_path):
    plan = parse_plan(v2_plan())
    assert plan.num_virtual_stages == 2 and plan.world_size == 8
    assert [(s, j, c.start_unit) for s, j, c in plan.chunks_in_order()] == [(0, 0, 0), (1, 0, 3), (0, 1, 8),
                                                                            (1, 1, 12)]
    assert plan.stages[0].num_units == 3 + 4 and len(plan.stage_units(1)) == 5 + 4
    with pytest.raises(ValueError, match="2 virtual chunks"):
        plan.stages[0].start_unit  # the one-span view is for one-chunk stages only
    path = tmp_path / "p.json"
    path.write_text(plan.to_json())
    assert load_plan(path) == plan


def test_v1_plan_loads_as_v2_with_features_off():
    d = good_plan()
    d["schema_version"] = 1
    plan = parse_plan(d)
    assert plan.schema_version == SCHEMA_VERSION and plan.num_virtual_stages == 1
    assert [s.cp for s in plan.stages] == [1, 1, 1] and not any(s.sequence_parallel for s in plan.stages)
    assert not (plan.overlap_grad_reduce or plan.overlap_param_gather or plan.tp_comm_overlap)
    assert [s.start_unit for s in plan.stages] == [0, 17, 36] and plan.stages[1].recompute == ["selective"] * 19
    assert json.loads(plan.to_json())["stages"][0]["chunks"][0]["end_unit"] == 17   # written in the v2 form


def test_uniform_plan_interleaved_and_sp():
    p = uniform_plan(load_model("gpt-1.3b"), num_stages=2, tp=2, dp=2, micro_batch_size=4, global_batch_size=64,
                     sequence_parallel=True, num_virtual_stages=3, distributed_optimizer=True)
    assert p.num_virtual_stages == 3 and [c.num_units for _, _, c in p.chunks_in_order()] == [8, 8, 8, 8, 8, 8]
    assert p.stages[1].chunks[0].start_unit == 8 and p.distributed_optimizer


def _chunk(s, j, key, value):
    return _set(("stages", s, "chunks", j, key), value)


BAD_V2 = [
    (_set(("stages", 0, "cp"), 4), "tp (2) * cp (4) * dp (1) must equal num_gpus (4)"),
    (_many(_set(("stages", 0, "cp"), 3), _set(("stages", 0, "num_gpus"), 6)), "2*cp (6) must divide seq_length"),
    (_many(_set(("stages", 0, "tp"), 1), _set(("stages", 0, "dp"), 2)), "sequence_parallel needs tp > 1"),
    (_set(("distributed_optimizer",), False), "overlap_param_gather needs distributed_optimizer"),
    (_set(("stages", 1, "sequence_parallel"), False), "tp_comm_overlap needs sequence_parallel"),
    (_set(("stages", 1, "chunks"), [{"start_unit": 3, "end_unit": 16, "recompute": ["none"] * 13}]),
     "stages[1] has 1 chunks but stages[0] has 2"),
    (_many(_chunk(1, 0, "start_unit", 4), _chunk(1, 0, "recompute", ["none"] * 4)),
     "stages[1].chunks[0].start_unit (4) leaves a gap"),
    (_many(_chunk(0, 1, "start_unit", 7), _chunk(0, 1, "recompute", ["none"] * 5)), "overlaps the previous chunk"),
    (_set(("global_batch_size",), 9), "must be a multiple of the 2 stages"),
    (_chunk(0, 0, "recompute", ["attn_dropout"] * 3), "unit 1 is an MLP unit"),
    (_set(("stages", 0, "cp"), "2"), "stages[0].cp"),                 # strict types: no string numbers
    (_set(("stages", 0, "sequence_parallel"), 1), "stages[0].sequence_parallel"),
    (_set(("micro_batch_size",), True), "micro_batch_size"),
    (_set(("tp_comm_overlap",), "yes"), "tp_comm_overlap"),
    (_set(("model", "seq_length"), 4098), "2*cp (4) must divide seq_length (4098)"),
]


@pytest.mark.parametrize("case", range(len(BAD_V2)))
def test_bad_v2_plan_gives_exit_2_and_one_line(case, tmp_path, capsys):
    mut, needle = BAD_V2[case]
    d = v2_plan()
    mut(d)
    validate_refuses(d, tmp_path, capsys, needle)


def test_v2_interleaving_rules_follow_megatron_core():
    """One stage cannot interleave; T5 cannot interleave (megatron-core refuses encoder-decoder models there)."""
    with pytest.raises(AcesoError, match="at least 2 pipeline stages"):
        parse_plan(uniform_plan(load_model("gpt-1.3b"), 2, 1, 1, 1, 8, num_virtual_stages=2).model_dump()
                   | {"stages": [{"num_gpus": 1, "tp": 1, "dp": 1, "chunks": [
                       {"start_unit": 0, "end_unit": 24, "recompute": ["none"] * 24},
                       {"start_unit": 24, "end_unit": 48, "recompute": ["none"] * 24}]}]})
    with pytest.raises(AcesoError, match="encoder-decoder"):
        t5 = load_model("t5-770m")
        parse_plan({"model": t5.model_dump(), "micro_batch_size": 1, "global_batch_size": 4, "stages": [
            {"num_gpus": 1, "tp": 1, "dp": 1, "chunks": [{"start_unit": a, "end_unit": b, "recompute": ["none"] * (b - a)}
                                                         for a, b in spans]}
            for spans in (((0, 30), (60, 100)), ((30, 60), (100, t5.num_units)))]})
    with pytest.raises(AcesoError, match="no context parallelism"):
        parse_plan(uniform_plan(load_model("t5-770m"), 1, 1, 1, 1, 4).model_dump()
                   | {"stages": [{"num_gpus": 2, "tp": 1, "cp": 2, "dp": 1, "start_unit": 0,
                                  "end_unit": load_model("t5-770m").num_units,
                                  "recompute": ["none"] * load_model("t5-770m").num_units}]})
