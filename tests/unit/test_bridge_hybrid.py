"""A hybrid Mamba model's plan (Nemotron-H, Nemotron-3) as Megatron-Bridge v0.3.1 recipe overrides and back
(search/megatron/bridge_hybrid.py): every field is one of Bridge v0.3.1's NemotronHModelProvider / ConfigContainer
fields (search/megatron/data/bridge_fields_v0.3.1.json, read from Bridge's source), the values are the providers'
(hand-copied below from Bridge v0.3.1 models/nemotronh/nemotron_h_provider.py), the splits megatron-core 0.16.1's
MambaStack cannot place are refused in one line, and the YAML imports back as the plan."""

from __future__ import annotations

import json
import os

import pytest

from search.cli import main
from search.megatron import NotExpressible
from search.megatron.bridge import write_yaml
from search.megatron.bridge_hybrid import hybrid_config, overrides, read_overrides
from search.spec.presets import load_model
from tests.hybrid_plans import cut_plan

DATA = os.path.join(os.path.dirname(__file__), "..", "..", "search", "megatron", "data", "bridge_fields_v0.3.1.json")
REF = json.load(open(DATA))
# Bridge v0.3.1 NemotronHModelProvider8B: pattern, 4096 hidden, state 128, 128 heads; the base class: 8 groups,
# head dim 64
H8B = ("M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-", 128, 64, 8, 128)
# Nemotron3NanoProvider: pattern, state 128, head dim 64, (base) 8 groups, 64 heads
NANO = ("MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME", 128, 64, 8, 64)


def _selective(m):
    return lambda a, b: ["selective" if m.hybrid_layer_pattern[u] == "*" else "none" for u in range(a, b)]


def _plans():
    h8, nano = load_model("nemotron-h-8b"), load_model("nemotron-3-nano")
    return {"8b-even": cut_plan(h8, [0, 26, 52], 2, tp=2, dp=2, sp=True, gbs=32),
            "8b-first-last-selective": cut_plan(h8, [0, 20, 36, 52], 3, tp=2, rc=_selective(h8), gbs=12),
            "nano-even-tp2": cut_plan(nano, [0, 52], 1, tp=2, dp=4, sp=True, gbs=32),
            "nano-first": cut_plan(nano, [0, 10, 31, 52], 3, tp=2, dp=1, sp=True, gbs=12)}


@pytest.mark.parametrize("name", list(_plans()))
def test_every_field_is_a_nemotronh_recipe_field_with_the_providers_values(name):
    plan = _plans()[name]
    recipe, c, ov = overrides(plan)
    assert recipe in REF["fields"]["pretrain_recipes"]
    assert recipe == ("nemotronh_8b_pretrain_config" if name.startswith("8b") else "nemotron_3_nano_pretrain_config")
    for section, fields in ov.items():
        if "_target_" in fields:        # a config object (the recipe's name replaced)
            fields = {k: v for k, v in fields.items() if k not in ("_target_", "_call_")}
        known = REF["fields"]["hybrid_model" if section == "model" else section]
        assert not set(fields) - set(known) - set(REF["settable"].get(section, [])), section
    m = ov["model"]
    pattern, state, head_dim, groups, heads = H8B if name.startswith("8b") else NANO
    assert (m["hybrid_override_pattern"], m["mamba_state_dim"], m["mamba_head_dim"], m["mamba_num_groups"],
            m["mamba_num_heads"]) == (pattern, state, head_dim, groups, heads)
    assert m["num_layers"] == len(pattern) == 52
    assert "pipeline_model_parallel_layout" not in m and "moe_layer_freq" not in m and "mtp_num_layers" not in m
    # the recipes' CommOverlapConfig(tp_comm_overlap=True) is overridden with the plan's
    assert ov["comm_overlap"]["tp_comm_overlap"] is False


def test_first_and_last_stages_are_megatron_core_0_16_s_uneven_split():
    """MambaStack of 0.16.1: first / last stage counts and the rest evenly; 20 | 16 | 16 hybrid layers."""
    _, _, ov = overrides(_plans()["8b-first-last-selective"])
    m = ov["model"]
    assert (m["num_layers_in_first_pipeline_stage"], m["num_layers_in_last_pipeline_stage"]) == (20, None)
    assert m["recompute_granularity"] == "selective" and m["recompute_modules"] == ["core_attn"]
    _, _, ov = overrides(_plans()["nano-first"])
    assert (ov["model"]["num_layers_in_first_pipeline_stage"], ov["model"]["num_layers_in_last_pipeline_stage"]) \
        == (10, None)     # 10 | 21 | 21


def _refused(plan, tmp_path, capsys, *words):
    path = tmp_path / "plan.json"
    path.write_text(plan.to_json())
    out = tmp_path / "o.yaml"
    assert main(["export", str(path), "--to", "megatron-bridge", "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and not out.exists() and "Traceback" not in err
    for w in words:
        assert w in err, err


def test_what_megatron_core_0_16_cannot_place_is_refused_in_one_line(tmp_path, capsys):
    h8 = load_model("nemotron-h-8b")
    uneven = tmp_path / "uneven.json"          # v0.3.1 splits evenly: written for v0.6.0's '|' cuts, said so
    uneven.write_text(cut_plan(h8, [0, 10, 30, 40, 52], 4).to_json())
    assert main(["export", str(uneven), "--to", "megatron-bridge", "-o", str(tmp_path / "u.yaml")]) == 0
    assert "written for Megatron-Bridge v0.6.0" in capsys.readouterr().err
    assert "hybrid_layer_pattern" in (tmp_path / "u.yaml").read_text()
    _refused(cut_plan(h8, [0, 13, 26, 39, 52], 2), tmp_path, capsys, "virtual pipeline", "--hybrid-pattern")
    # MTP: v0.3.1's MambaModelProvider has none; written for v0.6.0's HybridModelProvider, the note says why
    d = h8.model_dump()
    mtp = type(h8).model_validate({**d, "name": "custom", "aceso_db_key": None, "nominal_params_b": None,
                                   "hybrid_layer_pattern": d["hybrid_layer_pattern"] + "/*-", "mtp_num_layers": 1})
    with pytest.raises(NotExpressible, match="mtp_num_layers: MambaModelProvider of v0.3.1 has no MTP"):
        hybrid_config(cut_plan(mtp, [0, 26, 53], 2))
    path = tmp_path / "mtp.json"
    path.write_text(cut_plan(mtp, [0, 26, 53], 2).to_json())
    assert main(["export", str(path), "--to", "megatron-bridge", "-o", str(tmp_path / "m.yaml")]) == 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "written for Megatron-Bridge v0.6.0" in err and "no MTP" in err, err
    assert "  mtp_hybrid_override_pattern: \"*-\"\n" in (tmp_path / "m.yaml").read_text()


@pytest.mark.parametrize("name", list(_plans()))
def test_the_written_yaml_imports_back_as_the_plan(name, tmp_path, capsys):
    plan = _plans()[name]
    path = tmp_path / "plan.json"
    path.write_text(plan.to_json())
    yaml, back = tmp_path / "o.yaml", tmp_path / "back.json"
    assert main(["export", str(path), "--to", "megatron-bridge", "-o", str(yaml)]) == 0
    assert main(["import", str(yaml), "--from", "megatron-bridge", "-o", str(back)]) == 0
    from search.spec.plan import load_plan
    got = load_plan(str(back))
    assert got.model == plan.model and got.stages == plan.stages
    assert (got.micro_batch_size, got.global_batch_size) == (plan.micro_batch_size, plan.global_batch_size)
    assert got.settings.framework == "megatron-bridge"
    _, _, ov = overrides(got)
    assert ov == overrides(plan)[2]


def test_a_field_aceso_does_not_write_back_is_refused(tmp_path, capsys):
    plan = _plans()["nano-even-tp2"]
    recipe, c, ov = overrides(plan)
    text = write_yaml(plan, c, "p.json", (recipe, ov)).replace("  mamba_num_groups: 8\n", "  mamba_num_groups: 8\n"
                                                               "  masked_softmax_fusion: false\n")
    (tmp_path / "o.yaml").write_text(text)
    out = tmp_path / "back.json"
    assert main(["import", str(tmp_path / "o.yaml"), "--from", "megatron-bridge", "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "model.masked_softmax_fusion" in err and not out.exists()
    with pytest.raises(NotExpressible, match="no torchrun line"):
        read_overrides("model:\n  hybrid_override_pattern: M-\n", "x.yaml")


def test_the_export_headers_name_the_hybrid_layer_mix():
    """Not 'GPT': Nemotron-3 Nano is 23 Mamba-2 + 23 MoE + 6 attention layers (NVIDIA's model card, issue 36);
    Nemotron-H 8B 24 Mamba-2 + 24 MLP + 4 attention (its provider's pattern above)."""
    from search.megatron.hybrid_pattern import hybrid_form, write_script
    for name, mix in (("nano-even-tp2", "hybrid 23 Mamba-2 + 23 MoE + 6 attention, 52 layers"),
                      ("8b-even", "hybrid 24 Mamba-2 + 24 MLP + 4 attention, 52 layers")):
        plan = _plans()[name]
        recipe, c, ov = overrides(plan)
        for text in (write_yaml(plan, c, "p.json", (recipe, ov)), write_script(plan, hybrid_form(plan), "p.json")):
            line = next(x for x in text.splitlines() if x.startswith("# model:"))
            assert mix in line and "GPT" not in line, line


def test_a_hybrid_models_moe_layers_are_its_patterns_e_layers():
    """megatron-core's moe_layer_freq of a hybrid model as the runtime and the rules get it: the pattern's 'E'
    layers (23 of Nano's 52), not every layer."""
    from search.spec.model_rules import moe_config
    nano = load_model("nemotron-3-nano")
    assert moe_config(nano)["moe_layer_freq"] == [int(c == "E") for c in NANO[0]]
    assert sum(moe_config(nano)["moe_layer_freq"]) == 23


# ----- Bridge v0.6.0: hybrid_layer_pattern with '|' cuts (HybridModelProvider -> megatron-core HybridModel) -------
def _cli_pipes(plan, tmp_path, *extra):
    path = tmp_path / "plan.json"
    path.write_text(plan.to_json())
    out = tmp_path / "o.yaml"
    rc = main(["export", str(path), "--to", "megatron-bridge", "--hybrid-pattern", "-o", str(out), *extra])
    return rc, out


def test_an_uneven_hybrid_split_exports_as_bridge_0_6_s_pipe_cuts_and_imports_back(tmp_path, capsys):
    """10 | 20 | 10 | 12 hybrid layers: v0.3.1 refuses it (above); v0.6.0's HybridModel gives pipeline rank r the
    r-th '|' segment (megatron-core 0.19 ``select_pipeline_segment``), so the pattern is the preset's, cut at the
    plan's stage bounds, and ``num_layers`` counts the layers without the pipes (``get_hybrid_total_layer_count``)."""
    nano = load_model("nemotron-3-nano")
    plan = cut_plan(nano, [0, 10, 30, 40, 52], 4, tp=2, sp=True, gbs=16)
    rc, yaml = _cli_pipes(plan, tmp_path)
    assert rc == 0, capsys.readouterr().err
    text = yaml.read_text()
    assert "Megatron-Bridge v0.6.0 overrides" in text
    p = NANO[0]
    want = "|".join([p[0:10], p[10:30], p[30:40], p[40:52]])
    assert f"  hybrid_layer_pattern: {json.dumps(want)}\n" in text
    ov = overrides(plan, pipes=True)[2]
    m = ov["model"]
    assert m["num_layers"] == 52 and "hybrid_override_pattern" not in m
    assert "num_layers_in_first_pipeline_stage" not in m and "num_layers_in_last_pipeline_stage" not in m
    # megatron-core 0.19's NullTokenizer counts its EOD token (0.16.1's adds one: V - 1 for v0.3.1)
    assert ov["tokenizer"]["vocab_size"] == nano.vocab_size
    assert ov["mixed_precision"]["bf16"] is True and ov["mixed_precision"]["grad_reduce_in_fp32"] is False
    back = tmp_path / "back.json"
    assert main(["import", str(yaml), "--from", "megatron-bridge", "-o", str(back)]) == 0
    from search.spec.plan import load_plan
    got = load_plan(str(back))
    assert got.model == plan.model and got.stages == plan.stages
    assert (got.settings.framework, got.settings.release) == ("megatron-bridge", "0.19")
    assert overrides(got, pipes=True)[2] == ov


def test_what_bridge_0_6_does_not_run_is_refused_naming_it(tmp_path, capsys):
    from search.targets.capabilities import plan_refusal
    h8 = load_model("nemotron-h-8b")
    vpp = cut_plan(h8, [0, 13, 26, 39, 52], 2)
    rc, out = _cli_pipes(vpp, tmp_path)
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "v0.6.0" in err and "virtual pipeline" in err and not out.exists()
    assert "v0.6.0" in plan_refusal(vpp, "megatron-bridge")
    uneven = cut_plan(h8, [0, 10, 30, 40, 52], 4)
    assert plan_refusal(uneven, "megatron-bridge") is None      # the capability row: v0.6.0 runs the cuts
    llama = load_model("llama3-8b")
    rc, out = _cli_pipes(cut_plan(llama, [0, llama.num_units], 1), tmp_path)   # no Mamba: not a Bridge form
    assert rc == 2 and "--hybrid-pattern" in capsys.readouterr().err and not out.exists()


# ----- Bridge v0.6.0: a hybrid model with MTP (Nemotron-3 Super) --------------------------------------------------
# Megatron-Bridge v0.6.0 (tag v0.6.0, commit 51885cf132b2814188b6855c25a8588254274c2a),
# src/megatron/bridge/models/hybrid/hybrid_provider.py, HybridModelProvider (lines 162-165):
#     # MTP
#     mtp_num_layers: int | None = 0
#     mtp_hybrid_override_pattern: str | None = None
#     keep_mtp_spec_in_bf16: bool = False
# (mtp_use_repeated_layer is megatron-core 0.19's TransformerConfig field), and its finalize (lines 196-209):
#     if self.hybrid_layer_pattern is not None and self.mtp_hybrid_override_pattern:
#         sep = Symbols.MTP_SEPARATOR
#         main_pattern = self.hybrid_layer_pattern.split(sep)[0]
#         if self.mtp_use_repeated_layer:
#             num_pattern_copies = max(1, self.mtp_num_layers or 0)
#         else:
#             num_pattern_copies = self.mtp_num_layers or 0
#         self.hybrid_layer_pattern = (
#             main_pattern + sep + sep.join([self.mtp_hybrid_override_pattern] * num_pattern_copies))
# then num_layers must equal get_hybrid_total_layer_count(pattern): the main pattern's symbols without '|'.
# Its Nemotron recipes set MTP so: recipes/nemotronh/h100/nemotron_3_nano.py, nemotron_3_5_lightning_pretrain_config
# (lines 256-269), the Nano recipe (the one aceso overrides) plus mtp_num_layers = 2, mtp_hybrid_override_pattern =
# "*E", mtp_use_repeated_layer = True.
PROVIDER_MTP_FIELDS = {"mtp_num_layers", "mtp_hybrid_override_pattern", "keep_mtp_spec_in_bf16",
                       "mtp_use_repeated_layer"}


def _bridge_finalize(model: dict) -> str:
    """HybridModelProvider.finalize's pattern, transcribed from the lines quoted above."""
    pattern = model["hybrid_layer_pattern"]
    if pattern is not None and model.get("mtp_hybrid_override_pattern"):
        main = pattern.split("/")[0]
        n = model.get("mtp_num_layers") or 0
        copies = max(1, n) if model.get("mtp_use_repeated_layer") else n
        pattern = main + "/" + "/".join([model["mtp_hybrid_override_pattern"]] * copies)
    return pattern


def _megatron_lm_pattern(plan) -> str:
    """The Megatron-LM export's --hybrid-layer-pattern of the plan (the reference MTP form)."""
    import shlex
    from search.megatron.hybrid_pattern import args_line, hybrid_form
    words = shlex.split(args_line(hybrid_form(plan)))
    return words[words.index("--hybrid-layer-pattern") + 1]


def _super(repeated: bool = True):
    sup = load_model("nemotron-3-super")
    return sup if repeated else sup.model_copy(update={"name": "custom", "aceso_db_key": None,
                                                       "mtp_use_repeated_layer": False})


@pytest.mark.parametrize("repeated", [True, False])
def test_an_mtp_hybrid_is_written_as_hybrid_model_providers_mtp_fields(repeated):
    """Nemotron-3 Super (88 layers, 2 MTP depths of '*E', one shared layer: its preset) cut 40 | 48 + MTP: Bridge
    v0.6.0's finalize of the written fields gives the Megatron-LM export's pattern, MTP part included, so Bridge
    builds the model aceso priced (its depths, their pattern, the shared layer or not; the MTP in the plan's
    precision)."""
    sup = _super(repeated)
    plan = cut_plan(sup, [0, 40, sup.num_units], 2, gbs=16)
    recipe, _, ov = overrides(plan, pipes=True)
    m = ov["model"]
    assert recipe == "nemotron_3_nano_pretrain_config"
    assert {k: m[k] for k in PROVIDER_MTP_FIELDS} == {"mtp_num_layers": 2, "mtp_hybrid_override_pattern": "*E",
                                                      "mtp_use_repeated_layer": repeated,
                                                      "keep_mtp_spec_in_bf16": False}
    want = _megatron_lm_pattern(plan)
    assert want.endswith("/*E/*E") and want.count("|") == 1
    assert _bridge_finalize(m) == want
    assert m["num_layers"] == len(want.split("/")[0].replace("|", "")) == 88
    assert "/" not in m["hybrid_layer_pattern"]


def test_an_mtp_hybrids_yaml_imports_back_as_the_plan(tmp_path, capsys):
    """The Super plan (mxfp8, as NVIDIA ran it) exported for v0.6.0 and read back: the same model (MTP depths,
    pattern, shared layer), stages and precision recipe, and the plan read back writes the same overrides."""
    from search.settings.precision import LowPrecision
    from search.spec.plan import load_plan
    sup = _super()
    plan = cut_plan(sup, [0, 40, sup.num_units], 2, gbs=16).model_copy(deep=True)
    plan.settings = plan.settings.model_copy(update={"low_precision": LowPrecision(recipe="mxfp8")})
    plan = type(plan).model_validate(plan.model_dump())
    path, yaml, back = tmp_path / "plan.json", tmp_path / "o.yaml", tmp_path / "back.json"
    path.write_text(plan.to_json())
    assert main(["export", str(path), "--to", "megatron-bridge", "-o", str(yaml)]) == 0
    assert "MTP" in capsys.readouterr().err
    assert main(["import", str(yaml), "--from", "megatron-bridge", "-o", str(back)]) == 0, capsys.readouterr().err
    got = load_plan(str(back))
    assert got.model == plan.model and got.stages == plan.stages
    assert got.model.mtp_num_layers == 2 and got.model.mtp_use_repeated_layer
    assert got.settings.low_precision == plan.settings.low_precision
    assert overrides(got, pipes=True)[2] == overrides(plan, pipes=True)[2]
    # a field aceso does not write back is refused: MTP kept in bf16 is not what aceso priced
    text = yaml.read_text().replace("keep_mtp_spec_in_bf16: false", "keep_mtp_spec_in_bf16: true")
    yaml.write_text(text)
    assert main(["import", str(yaml), "--from", "megatron-bridge", "-o", str(tmp_path / "b2.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "model.keep_mtp_spec_in_bf16" in err and not (tmp_path / "b2.json").exists()


def test_a_megatron_fsdp_hybrids_yaml_imports_back(tmp_path, capsys):
    """The export writes Megatron FSDP's `checkpoint.ckpt_format: fsdp_dtensor` (Megatron-LM asserts that format
    under FSDP); the import read no `checkpoint` section and refused its own YAML ("add --ckpt-format
    fsdp_dtensor"). Now the YAML reads back as the plan, FSDP included."""
    nano = load_model("nemotron-3-nano")
    plan = cut_plan(nano, [0, 52], 1, tp=1, dp=8, sp=False, gbs=32)
    data = plan.model_dump(exclude={"predicted"})
    data["settings"]["megatron_fsdp"] = {"data_parallel_sharding_strategy": "optim_grads_params"}
    plan = type(plan).model_validate(data)
    path, yaml, back = tmp_path / "plan.json", tmp_path / "o.yaml", tmp_path / "back.json"
    path.write_text(plan.to_json())
    assert main(["export", str(path), "--to", "megatron-bridge", "-o", str(yaml)]) == 0
    assert "ckpt_format: fsdp_dtensor" in yaml.read_text()
    assert main(["import", str(yaml), "--from", "megatron-bridge", "-o", str(back)]) == 0, capsys.readouterr().err
    from search.spec.plan import load_plan
    got = load_plan(str(back))
    assert got.model == plan.model and got.stages == plan.stages
    assert got.settings.megatron_fsdp == plan.settings.megatron_fsdp


def test_a_plan_megatron_lm_does_not_run_either_is_refused_in_its_words():
    """A Nemotron-H plan with virtual stages and a different dp per stage: Bridge's hybrid provider refuses the
    virtual stages, and its way out, ``--to megatron-lm --hybrid-pattern``, refuses the two dp sizes (the reference:
    the Megatron-LM export's own refusal, ``check_expressible``). The Bridge export names the one that no form runs.
    Before, it named the virtual stages and sent the user to an export that refused the plan again."""
    from search.megatron import check_expressible
    from search.spec.plan import ParallelPlan

    data = cut_plan(load_model("nemotron-h-8b"), [0, 14, 26, 40, 52], 2, dp=2, mbs=2, gbs=32).model_dump()
    data["stages"][1].update(dp=4, num_gpus=4)
    plan = ParallelPlan.model_validate(data)
    megatron_lm = check_expressible(plan)
    assert megatron_lm is not None and "data-parallel size" in megatron_lm
    for pipes in (False, True):
        with pytest.raises(NotExpressible) as e:
            hybrid_config(plan, pipes)
        assert str(e.value) == megatron_lm, str(e.value)
