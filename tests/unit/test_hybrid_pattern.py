"""A GPT / MoE plan cut at any unit as a Megatron-LM hybrid-pattern run (search/megatron/hybrid_pattern.py): the
pattern a reader writes by hand, the flags, the releases and models that have no such run refused in one line
(exit 2, nothing written), Megatron-LM's recompute over hybrid layers, the import round trip, and the search's
``|``-pattern line (never slower than the Megatron-LM line it starts from, and a plan the export writes)."""

import shlex

import pytest

from search.cli import main
from search.megatron import NotExpressible
from search.megatron.hybrid_pattern import args_line, hybrid_form, write_script
from search.megatron.importer import read_megatron
from search.megatron.versions import release
from search.spec.presets import load_model
from tests.hybrid_plans import CASES, LLAMA4, cut_plan, first_full


def _flags(line: str) -> dict:
    words, out, key = shlex.split(line), {}, None
    for w in words:
        if w.startswith("--"):
            key = w
            out[key] = []
        else:
            out[key].append(w)
    return out


@pytest.mark.parametrize("name", CASES)
def test_the_pattern_is_the_plans_units_cut_where_its_chunks_are(name):
    plan, by_hand, since = CASES[name]
    form = hybrid_form(plan, release(since))
    assert form.pattern == by_hand
    f = _flags(args_line(form))
    assert f["--hybrid-layer-pattern"] == [by_hand]
    assert f["--num-layers"] == [str(len(by_hand.split("/")[0].replace("|", "")))]
    for gone in ("--pipeline-model-parallel-layout", "--num-virtual-stages-per-pipeline-rank",
                 "--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers", "--moe-layer-freq"):
        assert gone not in f
    assert f["--pipeline-model-parallel-size"] == [str(plan.num_stages)]


def test_entry_and_spec_per_release():
    plan = CASES["llama-pp3-mid-layer"][0]
    for version, script, spec in (("0.17", "pretrain_mamba.py", "megatron.core.models.mamba.mamba_layer_specs"),
                                  ("0.18", "pretrain_hybrid.py", "megatron.core.models.hybrid.hybrid_layer_specs"),
                                  ("0.19", "pretrain_hybrid.py", "megatron.core.models.hybrid.hybrid_layer_specs")):
        form = hybrid_form(plan, release(version))
        assert _flags(args_line(form))["--spec"][0] == spec
        assert f'"$MEGATRON_LM/{script}"' in write_script(plan, form, "p.json")


def test_bf16_layers_count_hybrid_layers():
    f = _flags(args_line(hybrid_form(CASES["llama-fp8-bf16-ends"][0])))
    assert f["--num-layers-at-start-in-bf16"] == ["2"] and f["--num-layers-at-end-in-bf16"] == ["2"]


def test_recompute_is_over_hybrid_layers():
    """block N checkpoints a chunk's first N hybrid layers (units), uniform 1 every one, selective by kind."""
    assert _flags(args_line(hybrid_form(CASES["llama-pp2-block3"][0])))["--recompute-num-layers"] == ["3"]
    assert _flags(args_line(hybrid_form(CASES["llama-pp3-full"][0])))["--recompute-method"] == ["uniform"]
    sel = _flags(args_line(hybrid_form(CASES["llama-pp2-vpp2-selective"][0])))
    assert sel["--recompute-granularity"] == ["selective"] and sel["--recompute-modules"] == ["core_attn"]
    # the first unit of one chunk and the first two of another: no one Megatron-LM setting
    mixed = cut_plan(LLAMA4, [0, 4, 8], 2, rc=lambda a, b: first_full(1 if a == 0 else 2)(a, b))
    with pytest.raises(NotExpressible, match="recompute"):
        hybrid_form(mixed)


@pytest.mark.parametrize("case, version, expect", [
    ("llama-pp3-mid-layer", "0.16", "core_v0.16.1 has no '|'"),
    ("llama-pp3-full", "0.17", "core_v0.17.1's MambaStack checkpoints no layers"),
])
def test_export_refuses_a_release_without_it(tmp_path, capsys, case, version, expect):
    path = tmp_path / "plan.json"
    path.write_text(CASES[case][0].to_json())
    out = tmp_path / "run.sh"
    assert main(["export", str(path), "--hybrid-pattern", "--megatron-version", version, "-o", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert expect in err and "\n" not in err and "Traceback" not in err
    assert not out.exists()


@pytest.mark.parametrize("model, expect", [
    (load_model("qwen3-30b-a3b", num_layers=4), "qk_layernorm"),
    (load_model("t5-770m", num_layers=4), "t5"),
])
def test_models_hybrid_model_builds_otherwise_are_refused(model, expect):
    starts = model.layer_starts
    plan = cut_plan(model, [0, starts[2], model.num_units], 2)
    with pytest.raises(NotExpressible, match=expect):
        hybrid_form(plan)


def test_one_stage_shape_still_required():
    plan = cut_plan(LLAMA4, [0, 3, 8], 2, tp=2)
    st = plan.stages[1].model_copy(update={"tp": 1, "dp": 2})
    with pytest.raises(NotExpressible, match=r"stages\[1\]\.tp"):
        hybrid_form(plan.model_copy(update={"stages": [plan.stages[0], st]}))


def test_gpt_export_of_a_mid_layer_cut_names_the_hybrid_form(tmp_path, capsys):
    path = tmp_path / "plan.json"
    path.write_text(CASES["llama-pp3-mid-layer"][0].to_json())
    assert main(["export", str(path), "-o", str(tmp_path / "run.sh")]) == 2
    err = capsys.readouterr().err
    assert "between its attention and mlp units" in err and "--hybrid-pattern" in err
    assert main(["export", str(path), "--hybrid-pattern", "-o", str(tmp_path / "run.sh")]) == 0
    assert "--hybrid-layer-pattern '*-*|-*|-*-'" in (tmp_path / "run.sh").read_text()
    # --to megatron-bridge: Bridge runs a GPT model's pattern in no form (--hybrid-pattern there is refused for a
    # model without Mamba layers), so the refusal names Megatron-LM's form, which then exports
    out = tmp_path / "o.yaml"
    assert main(["export", str(path), "--to", "megatron-bridge", "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert "or export it with --to megatron-lm --hybrid-pattern" in err and err.count("\n") == 1 and not out.exists()
    assert main(["export", str(path), "--to", "megatron-bridge", "--hybrid-pattern", "-o", str(out)]) == 2
    assert main(["export", str(path), "--to", "megatron-lm", "--hybrid-pattern", "-o", str(tmp_path / "b.sh")]) == 0


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("version", ["0.17", "0.18", "0.19"])
def test_import_round_trips(name, version):
    plan, _, since = CASES[name]
    if release(version).version < release(since).version:
        pytest.skip(f"{name} needs {since}")
    form = hybrid_form(plan, release(version))
    for text in (write_script(plan, form, "p.json"), args_line(form)):     # the script; the bare line
        imp = read_megatron(text, world_size=None if "torchrun" in text else plan.world_size, version=version)
        assert imp.plan.model == plan.model
        assert imp.plan.stages == plan.stages
        assert imp.ignored == []


def test_import_places_a_pipe_free_pattern_as_megatron_core_does():
    """No '|' and pp 2 with --decoder-first-pipeline-num-layers 3 (hybrid layers): 3 on rank 0, 5 on rank 1
    (select_pipeline_segment's uneven branch, worked by hand)."""
    line = ("torchrun --nproc-per-node 2 pretrain_hybrid.py --hybrid-layer-pattern '*-*-*-*-' --spec m s "
            "--hidden-size 64 --num-attention-heads 4 --seq-length 128 --max-position-embeddings 128 "
            "--pipeline-model-parallel-size 2 --decoder-first-pipeline-num-layers 3 --micro-batch-size 1 "
            "--tokenizer-type NullTokenizer --vocab-size 1000")
    imp = read_megatron(line, version="0.19")
    assert [(c.start_unit, c.end_unit) for s in imp.plan.stages for c in s.chunks] == [(0, 3), (3, 8)]


@pytest.mark.parametrize("pattern, pp, expect", [
    ("D-D-", 1, "not a GPT model's layers"),     # DeepSeek sparse attention: no layer kind
    ("M*-M*-", 1, r"mamba: heads \(2\) must be a multiple of mamba_num_groups \(8\)"),   # --mamba-* defaults
    ("*-|*-|*-", 2, "not a multiple of --pipeline-model-parallel-size"),
    ("*-*E", 1, "'E' layers go with --num-experts"),
])
def test_import_refuses_what_it_cannot_read(pattern, pp, expect):
    line = (f"torchrun --nproc-per-node {pp} pretrain_hybrid.py --hybrid-layer-pattern '{pattern}' --spec m s "
            f"--hidden-size 64 --num-attention-heads 4 --seq-length 128 --max-position-embeddings 128 "
            f"--pipeline-model-parallel-size {pp} --micro-batch-size 1 --tokenizer-type NullTokenizer "
            "--vocab-size 1000")
    with pytest.raises(Exception, match=expect) as e:
        read_megatron(line, version="0.19")
    assert "\n" not in str(e.value)

