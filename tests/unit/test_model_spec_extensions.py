"""Model specs extended in megatron-core's format, torch-free: the ``layer_spec`` and ``megatron`` fields, strict
JSON/YAML spec files, ``aceso models --show``, what the analytic model says it ignores, the profile fingerprint,
and a planner that never imports the provider."""

from __future__ import annotations

import json

import pytest
import yaml

import model_specs
from search.spec import megatron_fields
from search.cli import main
from search.spec.cluster import parse_cluster
from search.pricing import make_cost_model
from search.costmodel.profiledb import ProfileDBWriter
from search.io.errors import AcesoError
from search.spec.model import ModelSpec
from search.spec.plan import ParallelPlan, StageSpec
from search.spec.presets import load_model
from search.spec.training import TrainingSpec
from tests.tiny_models import GPT, T5
from tests.unit.test_torch_free import run_blocked

QK = {"layer_spec": "tests.custom_specs:qk_norm_squared_relu",
      "megatron": {"qk_layernorm": True, "layernorm_epsilon": 1e-6, "softmax_scale": 0.25}}
HAVE_MCORE = megatron_fields.transformer_config_fields() is not None


def spec_error(**update) -> str:
    with pytest.raises(ValueError) as e:
        GPT.model_copy(update=update)
    return str(e.value)


# ----- fields --------------------------------------------------------------------------------------------------
def test_extension_fields_are_data():
    m = GPT.model_copy(update=QK)
    assert m.layer_spec_path("decoder") == "tests.custom_specs:qk_norm_squared_relu"
    assert m.megatron == QK["megatron"]
    assert GPT.layer_spec is None and GPT.megatron is None
    assert GPT.model_copy(update={"megatron": {}}).megatron is None    # an empty block is no block
    t5 = T5.model_copy(update={"layer_spec": {"encoder": "a.b:enc", "decoder": "a.b:dec"}})
    assert (t5.layer_spec_path("encoder"), t5.layer_spec_path("decoder")) == ("a.b:enc", "a.b:dec")


@pytest.mark.parametrize("update, message", [
    ({"layer_spec": "my_pkg.specs"}, "'my_pkg.specs' is not an import path; write 'package.module:function'"),
    ({"layer_spec": "my pkg:f"}, "is not an import path"),
    ({"layer_spec": {"encoder": "a:b", "decoder": "a:c"}}, "gpt models take one 'package.module:function'"),
    ({"rotary_percent": 0.5}, "rotary_percent (0.5) is for position_embedding rope"),
    ({"megatron": {"hidden_size": 64}}, "megatron.hidden_size: set by aceso, not by the megatron block; use "
                                        "hidden_size"),
    ({"megatron": {"tensor_model_parallel_size": 2}}, "use the plan's stages[].tp"),
    ({"megatron": {"sequence_parallel": True}}, "use the plan's stages[].sequence_parallel"),
    ({"megatron": {"recompute_granularity": "full"}}, "use the plan's per-unit recompute"),
    ({"megatron": {"activation_func": "relu"}}, "or an MLP with its own activation in your layer_spec"),
    ({"megatron": {"num_moe_experts": 8}}, "megatron.num_moe_experts: set by aceso, not by the megatron block; use "
                                           "moe.num_experts"),
    ({"megatron": {"expert_model_parallel_size": 2}}, "megatron.expert_model_parallel_size: set by aceso, not by "
                                                      "the megatron block; use the plan's stages[].ep"),
    ({"megatron": {"rotary_percent": 0.5}}, "a GPTModel argument, not a TransformerConfig field; set the spec's "
                                            "rotary_percent field instead"),
])
def test_bad_extension_fields_are_one_line_naming_the_fix(update, message):
    assert message in spec_error(**update)


def test_t5_needs_both_providers():
    with pytest.raises(ValueError, match="t5 models need two layer specs"):
        T5.model_copy(update={"layer_spec": "a.b:f"})
    with pytest.raises(ValueError, match="give both encoder and decoder"):
        T5.model_copy(update={"layer_spec": {"encoder": "a.b:f"}})


@pytest.mark.skipif(not HAVE_MCORE, reason="megatron-core's source is not installed")
def test_unknown_megatron_field_has_a_did_you_mean():
    assert ("megatron.qk_layernorms: not a megatron-core TransformerConfig field; did you mean qk_layernorm?"
            in spec_error(megatron={"qk_layernorms": True}))
    names = megatron_fields.transformer_config_fields()
    assert {"qk_layernorm", "window_size", "softmax_scale", "init_method_std", "tensor_model_parallel_size"} <= names
    # the table names real fields (an upgrade renaming one shows), but for those of older supported releases only
    assert set(megatron_fields.CONTROLLED) - megatron_fields.OLDER_RELEASES_ONLY <= names
    assert megatron_fields.OLDER_RELEASES_ONLY <= set(megatron_fields.CONTROLLED)


def test_without_megatron_core_the_block_is_kept_unchecked(monkeypatch):
    monkeypatch.setattr(megatron_fields, "transformer_config_fields", lambda: None)
    assert GPT.model_copy(update={"megatron": {"qk_layernorms": True}}).megatron == {"qk_layernorms": True}
    assert "set by aceso" in spec_error(megatron={"num_layers": 3})   # our own fields are refused regardless


# ----- spec files --------------------------------------------------------------------------------------------------
def write(tmp_path, name: str, text: str) -> str:
    (tmp_path / name).write_text(text)
    return str(tmp_path / name)


def test_yaml_spec_file_reads_floats_as_json_does(tmp_path):
    data = {**json.loads(json.dumps(GPT.model_dump(exclude_unset=True))), **QK}
    text = yaml.safe_dump({k: v for k, v in data.items() if k != "megatron"}, sort_keys=False)
    text += "megatron:\n  qk_layernorm: true\n  layernorm_epsilon: 1e-6\n  softmax_scale: .25\n  init_method_std: 2\n"
    m = load_model(write(tmp_path, "m.yaml", text))
    assert m.megatron == {"qk_layernorm": True, "layernorm_epsilon": 1e-6, "softmax_scale": 0.25, "init_method_std": 2}
    assert isinstance(m.megatron["layernorm_epsilon"], float) and isinstance(m.megatron["init_method_std"], int)
    assert yaml.safe_load("a: 1e-6")["a"] == "1e-6"   # what PyYAML's own loader would have passed on


@pytest.mark.parametrize("name, text, message", [
    ("d.yaml", "name: a\nname: b\n", "key 'name' appears twice; keep one"),
    ("d.json", '{"name": "a", "family": "gpt", "name": "b"}', "key 'name' appears twice; keep one"),
    ("u.yaml", "family: gpt\nnum_layer: 2\n", "num_layer: unknown field; did you mean num_layers?"),
    ("v.yaml", "family: gpt\nzzz: 2\n", "zzz: unknown field; remove it"),
])
def test_spec_files_are_strict(tmp_path, name, text, message):
    with pytest.raises(AcesoError, match=message):
        load_model(write(tmp_path, name, text))


@pytest.mark.parametrize("name", model_specs.preset_names())
def test_show_prints_every_preset_as_a_spec_file_that_loads_back(tmp_path, capsys, name):
    assert main(["models", "--show", name]) == 0
    text = capsys.readouterr().out
    assert load_model(write(tmp_path, "m.yaml", text)) == load_model(name)
    assert "# Model width h." in text and "# layer_spec: " in text
    assert "# megatron:" in text or "\nmegatron:\n  qk_layernorm: true" in text or \
        "\nmegatron:\n  layernorm_epsilon: 1.0e-0" in text or "\nmegatron:\n  moe_router_topk_scaling_factor: " \
        in text or "\nmegatron:\n  init_method_std: " in text or "\nmegatron:\n  add_qkv_bias: true" in text
    # the MoE presets set q/k norms, Nemotron-H its eps, Qwen2-57B its q/k/v biases, Nemotron-3 its top-k scaling,
    # 56B its init std
    assert main(["models", "--show", name, "--json", "-o", str(tmp_path / "m.json")]) == 0
    assert load_model(str(tmp_path / "m.json")) == load_model(name)


def test_show_of_a_custom_spec_keeps_its_extensions(tmp_path, capsys):
    path = write(tmp_path, "qk.json", json.dumps({**GPT.model_dump(exclude_unset=True), **QK}))
    assert main(["models", "--show", path]) == 0
    text = capsys.readouterr().out
    assert "layer_spec: 'tests.custom_specs:qk_norm_squared_relu'" in text and "  layernorm_epsilon: 1.0e-06" in text
    assert load_model(write(tmp_path, "back.yaml", text)) == load_model(path)
    assert main(["models", "--show", "t5-770m"]) == 0
    assert "# layer_spec: {encoder: my_pkg.specs:encoder_spec, decoder:" in capsys.readouterr().out


# ----- costs ---------------------------------------------------------------------------------------------------
def one_stage_plan(model: ModelSpec) -> ParallelPlan:
    n = model.num_units
    return ParallelPlan(model=model, micro_batch_size=2, global_batch_size=4, stages=[
        StageSpec(num_gpus=1, tp=1, dp=1, start_unit=0, end_unit=n, recompute=["none"] * n)])


def test_analytic_model_names_what_it_ignores_and_prices_the_rest():
    cluster, training = parse_cluster("1x1-h100"), TrainingSpec(global_batch_size=4, precision="fp32")
    stock = make_cost_model(GPT, cluster, training).evaluate(one_stage_plan(GPT))
    assert stock.warnings == []
    quiet = GPT.model_copy(update={"megatron": {"layernorm_epsilon": 1e-6, "init_method_std": 0.01}})
    same = make_cost_model(quiet, cluster, training).evaluate(one_stage_plan(quiet))
    assert same.warnings == [] and same.iteration_ms == stock.iteration_ms   # no-cost fields: priced exactly
    custom = GPT.model_copy(update=QK)
    cost = make_cost_model(custom, cluster, training).evaluate(one_stage_plan(custom))
    (note,) = cost.warnings
    assert "not layer_spec tests.custom_specs:qk_norm_squared_relu" in note
    assert "qk_layernorm" not in note and "softmax_scale" not in note    # qk_layernorm is priced
    assert "aceso profile --model SPEC" in note
    # it prices the stock layer's time with the Q/K norms' kernels (tests/unit/test_qk_norm_cost.py); its memory
    # counts the Q/K norms' parameters, which megatron-core allocates (tests/runtime/test_param_counts.py), and their
    # optimizer step
    assert cost.iteration_ms > stock.iteration_ms
    extra = custom.qk_norm_params() * custom.num_layers
    assert (cost.stages[0].memory_breakdown["params"] - stock.stages[0].memory_breakdown["params"]) * 2**20 == \
        pytest.approx(extra * 4)


def write_db(path, model: ModelSpec):
    w = ProfileDBWriter(model, gpu="cpu", dtype="fp32", hardware={})
    for kind in ("attention", "mlp"):
        w.add_unit("decoder", kind, model.seq_length, 1, 1, fwd_us=10.0, bwd_us=20.0, recompute_us=(0, 1, 10),
                   act_bytes=(1e5, 5e4, 1e4), weight_bytes=1e4)
    w.add_part("embedding", model.seq_length, 1, 1, fwd_us=1, bwd_us=2, act_bytes=1e3, weight_bytes=1e4)
    w.add_part("head", model.seq_length, 1, 1, fwd_us=1, bwd_us=2, act_bytes=1e3, weight_bytes=1e3)
    return w.save(path)


def test_profile_of_one_spec_does_not_price_another(tmp_path):
    cluster, training = parse_cluster("1x1-cpu"), TrainingSpec(global_batch_size=4, precision="fp32")
    custom = GPT.model_copy(update=QK)
    write_db(tmp_path / "custom.json", custom)
    make_cost_model(custom, cluster, training, "profile", db=tmp_path / "custom.json")
    others = {"the stock layer": GPT, "another provider": custom.model_copy(update={"layer_spec": "tests.x:y"}),
              "another block": custom.model_copy(update={"megatron": {"qk_layernorm": True}})}
    for what, model in others.items():
        with pytest.raises(AcesoError, match="profiled for another model"):
            make_cost_model(model, cluster, training, "profile", db=tmp_path / "custom.json")
    stock_db = json.loads(write_db(tmp_path / "stock.json", GPT).read_text())
    for k in ("layer_spec", "megatron"):   # a database written before the fields existed
        stock_db["model"].pop(k)
    (tmp_path / "old.json").write_text(json.dumps(stock_db))
    make_cost_model(GPT, cluster, training, "profile", db=tmp_path / "old.json")
    with pytest.raises(AcesoError, match="layer_spec None vs 'tests.custom_specs:qk_norm_squared_relu'"):
        make_cost_model(custom, cluster, training, "profile", db=tmp_path / "old.json")


# ----- the planner never imports the provider ----------------------------------------------------------------------
def test_plan_carries_the_extensions(tmp_path):
    plan = one_stage_plan(GPT.model_copy(update=QK))
    back = ParallelPlan.model_validate(json.loads(plan.to_json()))
    assert back.model.layer_spec == QK["layer_spec"] and back.model.megatron == QK["megatron"]


def test_planner_runs_a_custom_spec_with_torch_blocked(tmp_path):
    spec = tmp_path / "qk.yaml"
    spec.write_text(yaml.safe_dump({**GPT.model_dump(exclude_unset=True), **QK}))
    r = run_blocked(f"""
        import sys
        from search.cli import main
        assert main(['search', '--model', {str(spec)!r}, '--cluster', '1x2-cpu', '--global-batch-size', '4',
                     '--precision', 'fp32', '--budget-evals', '50', '-o', {str(tmp_path / 'plan.json')!r}]) == 0
        assert main(['explain', {str(tmp_path / 'plan.json')!r}]) == 0
        assert 'tests.custom_specs' not in sys.modules and 'torch' not in sys.modules
    """)
    assert r.returncode == 0, r.stderr
    assert "note: analytic cost model: prices the stock megatron-core layer" in r.stderr + r.stdout
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["model"]["layer_spec"] == QK["layer_spec"] and plan["model"]["megatron"] == QK["megatron"]
