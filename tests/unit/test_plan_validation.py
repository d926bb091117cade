"""Plans and specs: round trip, and bad input -> exit 2 with one line naming the field (no traceback)."""

import json

import pytest

from search.cli import main
from search.cluster import parse_cluster
from search.errors import AcesoError
from search.plan import ParallelPlan, even_split, load_plan, parse_plan, plan_json_schema, uniform_plan
from search.presets import load_model
from tests.conftest import ROOT


def good_plan() -> dict:
    """GPT-350M on 1x8: 3 heterogeneous stages (2 GPUs tp2, 4 GPUs dp4, 2 GPUs tp1 dp2), cut mid-layer."""
    m = load_model("gpt-350m")
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
    (_set(("stages", 0, "recompute", 3), "partial"), "stages[0].recompute[3]"),
    (_set(("stages",), []), "stages"),
    (_set(("micro_batch_size",), 0), "micro_batch_size"),
    (_set(("micro_batch_size",), 2), "dp (4) must divide micro_batch_size"),
    (_set(("global_batch_size",), 66), "global_batch_size (66)"),
    (_set(("global_batch_size",), -1), "global_batch_size"),
    (_set(("schema_version",), 2), "schema_version"),
    (_set(("extra_field",), 1), "extra_field"),
    (_set(("stages", 0, "pp"), 2), "stages[0].pp"),
    (_del(("stages", 0, "tp")), "stages[0].tp"),
    (_del(("micro_batch_size",)), "micro_batch_size"),
    (_del(("model",)), "model"),
    (_set(("stages", 0, "num_gpus"), 0), "stages[0].num_gpus"),
    (_set(("stages", 0, "start_unit"), -1), "stages[0].start_unit"),
    (_set(("stages", 0, "tp"), "two"), "stages[0].tp"),
    (_set(("model", "num_attention_heads"), 3), "model"),                           # 1024 % 3 != 0
    (_set(("model", "family"), "bert"), "model.family"),
    (_set(("model", "num_query_groups"), 5), "num_query_groups"),
    (_set(("model", "num_decoder_layers"), 4), "t5 only"),
    (_set(("model", "hidden_size"), 0), "model.hidden_size"),
    (_set(("model", "activation"), "relu"), "model.activation"),
    (_set(("model", "num_layers"), 12), "end_unit (48) must be 24"),               # plan no longer covers model
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
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(mutate(mut)))
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert needle in err, err


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
    for text, needle in [("8-h100", "NODESxGPUS"), ("1x8-b300", "unknown gpu"), ("0x8-h100", "at least 1")]:
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
    assert committed == plan_json_schema(), "docs/plan.schema.json is stale: run `python -m search.plan`"
    assert ParallelPlan.model_json_schema()["additionalProperties"] is False
