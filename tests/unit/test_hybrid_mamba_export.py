"""A hybrid Mamba model's plan (Nemotron-H, Nemotron-3) written as a Megatron-LM hybrid-pattern run
(search/megatron/hybrid_pattern.py): the Mamba-2 flags megatron-core's MambaMixer reads, the '|' cuts that carry
VPP and uneven stages, what no flag sets refused in one line, the plain (pretrain_gpt.py) export and the Megatron-LM
target pointing to --hybrid-pattern, and the import of the written script giving back the preset and the plan.
Megatron-LM's own parser and TransformerConfig read the same lines in tests/runtime/test_hybrid_pattern_oracle.py."""

import pytest

from search.cli import main
from search.megatron import NotExpressible, check_expressible, megatron_config
from search.megatron.hybrid_pattern import args_line, hybrid_form, write_script
from search.megatron.importer import read_megatron
from search.megatron.versions import release
from search.spec.presets import load_model
from tests.hybrid_plans import MAMBA8, cut_plan
from tests.unit.test_hybrid_pattern import _flags


def _nano_plan():
    """Nemotron-3 Nano (52 layers, 'MEMEM*E...') on 2 stages x 2 virtual stages with uneven cuts, tp 2 with SP."""
    return cut_plan(load_model("nemotron-3-nano"), [0, 7, 20, 33, 52], 2, tp=2, dp=2, sp=True, gbs=32)


def test_the_mamba_flags_are_the_mixers_shape():
    """Nemotron-H 8B: 128 heads of 64 (HF mamba_num_heads / mamba_head_dim), 8 groups, state 128 (its config);
    a mixer without mamba_num_heads gets MambaMixer's expand x hidden / head_dim written out: 2 x 4096 / 64 = 128."""
    f = _flags(args_line(hybrid_form(cut_plan(load_model("nemotron-h-8b"), [0, 3, 52], 2))))
    assert (f["--mamba-state-dim"], f["--mamba-head-dim"], f["--mamba-num-groups"], f["--mamba-num-heads"]) == \
        (["128"], ["64"], ["8"], ["128"])
    assert f["--squared-relu"] == [] and f["--position-embedding-type"] == ["none"]
    assert f["--hybrid-layer-pattern"][0].startswith("M-M|-M-M*-")
    assert "--disable-mamba-mem-eff-path" not in f and "--swiglu" not in f
    m = MAMBA8.model_copy(update={"mamba": MAMBA8.mamba.model_copy(update={"mamba_num_heads": None,
                                                                            "use_mamba_mem_eff_path": False})})
    f = _flags(args_line(hybrid_form(cut_plan(m, [0, 4, 8], 2))))
    assert f["--mamba-num-heads"] == [str(2 * 4096 // 64)] and f["--disable-mamba-mem-eff-path"] == []


def test_moe_hybrid_with_vpp_and_uneven_cuts():
    """The '|' segments are the plan's chunks in model order (segment vp * pp + rank), MoE flags as GPT's."""
    plan = _nano_plan()
    m = plan.model.hybrid_layer_pattern
    f = _flags(args_line(hybrid_form(plan)))
    assert f["--hybrid-layer-pattern"] == ["|".join((m[0:7], m[7:20], m[20:33], m[33:52]))]
    assert f["--num-layers"] == ["52"] and f["--pipeline-model-parallel-size"] == ["2"]
    assert f["--num-experts"] == ["128"] and f["--moe-router-topk"] == ["6"] and "--moe-layer-freq" not in f
    assert f["--mamba-num-heads"] == ["64"] and f["--sequence-parallel"] == []


@pytest.mark.parametrize("field, value", [("d_conv", 3), ("chunk_size", 256)])
def test_a_mixer_setting_without_a_flag_is_refused(field, value):
    m = MAMBA8.model_copy(update={"mamba": MAMBA8.mamba.model_copy(update={field: value})})
    with pytest.raises(NotExpressible) as e:
        hybrid_form(cut_plan(m, [0, 4, 8], 2))
    msg = str(e.value)
    assert msg.startswith(f"model.mamba.{field} {value}: Megatron-LM has no flag") and "\n" not in msg


def test_the_plain_export_and_target_point_to_the_hybrid_form(tmp_path, capsys):
    """pretrain_gpt.py flags would build the model without its Mamba layers: the plain Megatron-LM export writes
    the hybrid form, as --hybrid-pattern does; the Bridge export, whose recipe cannot cut this plan, is refused
    naming it (exit 2, one line, nothing written); the Megatron-LM target's check is the hybrid form's (VPP and
    uneven cuts run with '|' segments)."""
    plan = _nano_plan()
    path = tmp_path / "plan.json"
    path.write_text(plan.to_json())
    out = tmp_path / "megatron-bridge.out"
    assert main(["export", str(path), "--to", "megatron-bridge", "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert "--hybrid-pattern" in err and err.count("\n") == 1 and not out.exists()
    out, plain = tmp_path / "run.sh", tmp_path / "plain.sh"
    assert main(["export", str(path), "--hybrid-pattern", "-o", str(out)]) == 0
    assert main(["export", str(path), "-o", str(plain)]) == 0
    text = out.read_text()
    assert '"$MEGATRON_LM/pretrain_hybrid.py"' in text and "--mamba-num-heads 64" in text
    assert plain.read_text() == text
    assert check_expressible(plan) is None
    with pytest.raises(NotExpressible, match="export the plan with --hybrid-pattern"):
        megatron_config(plan)
    other = cut_plan(plan.model, [0, 7, 20, 33, 52], 2, tp=2, dp=2, sp=True, gbs=32,
                     rc=lambda a, b: ["full"] + ["none"] * (b - a - 1) if a == 7 else ["none"] * (b - a))
    assert "recompute" in check_expressible(other)      # the hybrid form's own refusal


@pytest.mark.parametrize("name", ["nemotron-h-8b", "nemotron-3-nano"])
@pytest.mark.parametrize("version", ["0.17", "0.18", "0.19"])
def test_the_written_script_imports_as_the_preset_and_the_plan(name, version):
    m = load_model(name)
    plan = cut_plan(m, [0, 5, 30, 52], 3, tp=2, sp=m.moe is not None, gbs=12)
    form = hybrid_form(plan, release(version))
    text = write_script(plan, form, "p.json")
    imp = read_megatron(text, version=version)
    assert imp.plan.model == m and imp.plan.model.name == name
    assert imp.plan.stages == plan.stages and imp.plan.global_batch_size == plan.global_batch_size
    assert imp.ignored == []
    assert args_line(hybrid_form(imp.plan, release(version))) == args_line(form)


@pytest.mark.parametrize("name", ["nemotron-3-super", "nemotron-3-ultra"])
@pytest.mark.parametrize("version", ["0.17", "0.19"])
def test_latent_moe_and_the_shared_mtp_layer_round_trip(name, version):
    """--moe-latent-size and (Super) --mtp-use-repeated-layer with the pattern's '/*E' depths are written and read
    back as the preset (each release's parser reads them in tests/runtime/test_hybrid_pattern_oracle.py)."""
    m = load_model(name)
    plan = cut_plan(m, [0, 5, 30, m.num_units], 3, tp=2, sp=True, gbs=12)
    form = hybrid_form(plan, release(version))
    f = _flags(args_line(form))
    assert f["--moe-latent-size"] == [str(m.moe.moe_latent_size)]
    assert ("--mtp-use-repeated-layer" in f) == m.mtp_use_repeated_layer
    imp = read_megatron(write_script(plan, form, "p.json"), version=version)
    assert imp.plan.model == m and imp.plan.stages == plan.stages and imp.ignored == []


def test_the_shared_mtp_layer_is_refused_for_a_release_without_it():
    """core_v0.16.1's parser has no --mtp-use-repeated-layer (0.17 added it): one line naming the flag and the
    releases that have it."""
    from search.io.errors import AcesoError
    from search.megatron.script import arg_groups
    m = load_model("deepseek-v3").model_copy(update={"num_layers": 8, "mtp_use_repeated_layer": True,
                                                     "mtp_num_layers": 2})
    plan = cut_plan(m, [0, m.num_units], 1, sp=False, gbs=8)
    with pytest.raises(AcesoError) as e:
        arg_groups(megatron_config(plan), release("0.16"))
    msg = str(e.value)
    assert msg.startswith("--mtp-use-repeated-layer: not a flag of") and "core_v0.17.1" in msg and "\n" not in msg
    assert arg_groups(megatron_config(plan), release("0.17"))
