"""Every built-in preset loads; parameter counts match the nominal sizes; overrides and spec files work."""

import json

import pytest

import model_specs
from search.io.errors import AcesoError
from search.spec.model import ModelSpec
from search.spec.presets import load_model

# The Aceso preset called "6B" (h 1024, ffn 32768, 64 heads x 128) has 5.67B parameters by its own settings:
# the name rounds up. Every other preset is within 5% of its name.
TOLERANCE = {"t5-6b": 0.06}


@pytest.mark.parametrize("name", model_specs.preset_names())
def test_preset_loads_and_matches_nominal_size(name):
    m = load_model(name)
    assert m.name == name
    if m.nominal_params_b is not None:
        rel = m.num_parameters / (m.nominal_params_b * 1e9) - 1
        assert abs(rel) <= TOLERANCE.get(name, 0.05), f"{name}: {m.num_parameters / 1e9:.3f}B"


def test_gpt_parameter_count_by_hand():
    # GPT-1.3B: 24 layers of 12h^2 + 13h (+ 2 norms of 2h), embedding (V + s) h, final norm 2h
    m = load_model("gpt-1.3b")
    h, L, V, s = 2048, 24, 51200, 2048
    per_layer = 12 * h * h + 13 * h
    assert m.num_parameters == L * per_layer + (V + s) * h + 2 * h


def test_llama_gqa_parameter_count_by_hand():
    m = load_model("llama3-8b")
    h, L, V, ffn, kv = 4096, 32, 128256, 14336, 8 * 128
    per_layer = h * (h + 2 * kv) + h * h + 3 * h * ffn + 2 * h
    assert m.num_parameters == L * per_layer + 2 * V * h + h
    assert m.groups == 8 and m.head_dim == 128


def test_units_gpt_and_t5():
    g = load_model("gpt-350m")
    assert g.num_units == 48 and g.units[0].kind == "attention" and g.units[1].kind == "mlp"
    t = load_model("t5-770m")
    assert t.num_units == 24 * 2 + 24 * 3 and t.num_encoder_units == 48
    assert [u.kind for u in t.units[48:51]] == ["attention", "cross_attention", "mlp"]
    assert t.units[47].stack == "encoder" and t.units[48].stack == "decoder"


def test_num_layers_override():
    assert load_model("gpt-scale-layer", num_layers=1024).num_units == 2048
    t = load_model("t5-770m", num_layers=2)
    assert t.num_layers == t.num_decoder_layers == 2


def test_db_keys():
    assert load_model("gpt-1.3b").aceso_db_key == "gpt_1_3B"
    assert load_model("t5-770m").aceso_db_key == "t5_770M"
    assert load_model("gpt-scale-layer").aceso_db_key == "gpt_scale-layer"


def test_user_spec_file_json_and_yaml(tmp_path):
    data = model_specs.preset_data("gpt-350m") | {"name": "mine", "num_layers": 4}
    (tmp_path / "m.json").write_text(json.dumps(data))
    assert load_model(str(tmp_path / "m.json")).num_layers == 4
    yaml = pytest.importorskip("yaml")
    (tmp_path / "m.yaml").write_text(yaml.safe_dump(data))
    assert load_model(str(tmp_path / "m.yaml")) == load_model(str(tmp_path / "m.json"))


def test_unknown_model_names_the_choices():
    with pytest.raises(AcesoError, match="gpt-1.3b"):
        load_model("gpt-1.4b")


def test_flops_per_token_matches_6n_rule():
    # For GPT-175B the attention term is small: 6 * params per token within 10%
    m = load_model("gpt-175b")
    assert m.flops_per_token == pytest.approx(6 * m.num_parameters, rel=0.10)
    assert isinstance(m, ModelSpec)


def test_model_copy_recomputes_units_and_validates():
    t5 = load_model("t5-770m")
    assert t5.num_units == 120  # caches the unit list
    small = t5.model_copy(update={"num_layers": 2, "num_decoder_layers": 2})
    assert small.num_units == 2 * 2 + 2 * 3
    with pytest.raises(ValueError, match="num_query_groups"):
        t5.model_copy(update={"num_query_groups": 5})


def test_models_prints_every_name_whole_in_an_80_column_pipe(monkeypatch, capsys):
    """Issue 32: in a pipe (80 columns) `aceso models` cut names to "llama3…", which stood for two models. Every
    preset is one line that starts with its whole name, and nothing is cut."""
    import model_specs
    from search.cli import main

    monkeypatch.setenv("COLUMNS", "80")
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    names = model_specs.preset_names()
    firsts = [line.split()[0] for line in out.splitlines() if line.strip() and line.split()[0] in names]
    assert sorted(firsts) == sorted(names) and "…" not in out
    assert main(["clusters"]) == 0                  # the same table: every column whole, the rack presets listed
    out = capsys.readouterr().out
    assert "…" not in out and "intra_node_gbps" in out and "gb200-nvl72" in out
