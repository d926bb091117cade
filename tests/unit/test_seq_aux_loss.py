"""The router's load-balancing type (``MoESpec.moe_router_load_balancing_type``): DeepSeek-V3's and Nemotron-3's
``seq_aux_loss`` was read as ``aux_loss``; now it is a model field, read from Megatron-LM's flag, Hugging Face's
``seq_aux`` and the presets, written back by the exports and the runtime config, and priced.

References: NVIDIA's published DeepSeek-V3 command line (../shared/published/megatron-bridge-26.02-26.04.json:
``--moe-router-load-balancing-type seq_aux_loss --moe-aux-loss-coeff 1e-4``), Megatron-Bridge's
``DeepSeekModelProvider`` (``moe_router_load_balancing_type: str = "seq_aux_loss"``), DeepSeek-V3's config.json
(``"seq_aux": true``, tests/unit/data/hf/deepseek-v3/config.json), megatron-core 0.16.1's router.py
(``_apply_seq_aux_loss``: the two reshapes are views, the all-reduce is the aux loss's own, and one division by the
micro-batch size more) and the launch count of ``search/costmodel/host.py``'s docstring, by hand."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from search.cli.import_hf import hf_to_spec
from search.io.errors import AcesoError
from search.layers.moe import moe_launches
from search.megatron import megatron_config
from search.megatron.importer import read_megatron
from search.megatron.moe_flags import moe_bridge_fields
from search.megatron.script import args_line
from search.settings.moe_plan import MoEPlanSettings
from search.spec.model import ModelSpec
from search.spec.model_rules import moe_config
from search.spec.presets import load_model
from tests.megatron_moe_plans import moe_case_plan

PUBLISHED = Path(__file__).resolve().parents[3] / "shared" / "published" / "megatron-bridge-26.02-26.04.json"
HF_DSV3 = Path(__file__).parent / "data" / "hf" / "deepseek-v3" / "config.json"
_TINY = dict(name="custom", family="llama", num_layers=4, hidden_size=256, num_attention_heads=8, ffn_hidden_size=512,
             seq_length=256, vocab_size=1000, activation="swiglu", normalization="rmsnorm", position_embedding="rope",
             tied_embeddings=False, add_bias_linear=False, params_dtype="bf16")


def _moe(**kw) -> ModelSpec:
    return ModelSpec(**_TINY, moe={"num_experts": 8, "moe_router_topk": 2, "moe_ffn_hidden_size": 128, **kw})


def _flag(line: str, name: str) -> list[str]:
    words = shlex.split(line)
    i = words.index(name)
    out = []
    for w in words[i + 1:]:
        if w.startswith("--"):
            break
        out.append(w)
    return out


def _published_dsv3() -> dict:
    rows = json.loads(PUBLISHED.read_text())["rows"]
    return next(r for r in rows if r["model"].startswith("deepseek-v3") and "seq_aux_loss" in r["args"])


# ----- the presets and Hugging Face -------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["deepseek-v3", "deepseek-v3-no-mtp", "nemotron-3-nano", "nemotron-3-super",
                                  "nemotron-3-ultra"])
def test_presets_of_seq_aux_loss_recipes_say_so(name):
    """Megatron-Bridge's DeepSeek providers and the Nemotron-3 arch records (model_specs/hybrid/*.json) train with
    seq_aux_loss; the runtime config carries it."""
    m = load_model(name)
    assert m.moe.moe_router_load_balancing_type == "seq_aux_loss"
    assert moe_config(m)["moe_router_load_balancing_type"] == "seq_aux_loss"


def test_hf_seq_aux_is_the_sequence_wise_loss():
    cfg = json.loads(HF_DSV3.read_text())
    assert cfg["seq_aux"] is True
    assert hf_to_spec(cfg, source="dsv3").moe.moe_router_load_balancing_type == "seq_aux_loss"
    batch = hf_to_spec({**cfg, "seq_aux": False}, source="dsv3").moe
    assert batch.moe_router_load_balancing_type == "aux_loss" and batch.moe_aux_loss_coeff == cfg["aux_loss_alpha"]


# ----- coefficient 0 is none, as before ---------------------------------------------------------------------------
@pytest.mark.parametrize("lb, coeff, runs", [("aux_loss", 0.0, "none"), ("seq_aux_loss", 0.0, "none"),
                                             ("aux_loss", 0.01, "aux_loss"), ("seq_aux_loss", 0.01, "seq_aux_loss"),
                                             ("global_aux_loss", 0.01, "global_aux_loss"), ("none", 0.01, "none"),
                                             ("sinkhorn", 0.0, "sinkhorn")])
def test_the_type_megatron_core_runs(lb, coeff, runs):
    """megatron-core computes an aux loss only for a type with a coefficient above 0 (router.get_aux_loss_coeff)."""
    m = _moe(moe_router_load_balancing_type=lb, moe_aux_loss_coeff=coeff)
    assert m.moe.lb_type == runs == moe_config(m)["moe_router_load_balancing_type"]


def test_a_default_type_dumps_as_before_and_sinkhorn_refuses_a_coefficient():
    assert "moe_router_load_balancing_type" not in _moe(moe_aux_loss_coeff=0.01).moe.model_dump()
    with pytest.raises(ValueError, match="sinkhorn takes no aux loss"):
        _moe(moe_router_load_balancing_type="sinkhorn", moe_aux_loss_coeff=0.01)


def test_sinkhorn_with_a_capacity_names_the_spec_field():
    """megatron-core's TransformerConfig refuses a capacity factor with sinkhorn (transformer_config.py:1105-1128);
    the spec now says the type, so the refusal names its field."""
    with pytest.raises(ValueError, match=r"not moe\.moe_router_load_balancing_type sinkhorn"):
        _moe(moe_router_load_balancing_type="sinkhorn", moe_expert_capacity_factor=1.0)


# ----- Megatron-LM both ways --------------------------------------------------------------------------------------
@pytest.mark.skipif(not PUBLISHED.is_file(), reason="../shared/published (the shared reference data) is absent")
def test_the_published_deepseek_line_keeps_its_seq_aux_loss():
    row = _published_dsv3()
    imp = read_megatron(row["args"], world_size=row["gpus"], version="core_v0.16.1")
    moe = imp.plan.model.moe
    assert (moe.moe_router_load_balancing_type, moe.moe_aux_loss_coeff) == ("seq_aux_loss", 1e-4)
    assert not [n for n in imp.notes if "load-balancing" in n]          # nothing approximated
    line = args_line(megatron_config(imp.plan))
    assert _flag(line, "--moe-router-load-balancing-type") == ["seq_aux_loss"]
    assert float(_flag(line, "--moe-aux-loss-coeff")[0]) == 1e-4


@pytest.mark.skipif(not PUBLISHED.is_file(), reason="../shared/published (the shared reference data) is absent")
def test_the_type_is_the_runs_not_the_architectures():
    """The same line with aux_loss is still DeepSeek-V3's architecture (the preset's name), run with aux_loss: the
    type is a run setting, as the coefficient (search/megatron/model_args.py ``_MOE_RUN``)."""
    row = _published_dsv3()
    imp = read_megatron(row["args"].replace("seq_aux_loss", "aux_loss"), world_size=row["gpus"],
                        version="core_v0.16.1")
    assert imp.plan.model.name.startswith("deepseek-v3")
    assert imp.plan.model.moe.moe_router_load_balancing_type == "aux_loss"


@pytest.mark.parametrize("types, coeffs, want", [
    (["seq_aux_loss"], ["1e-3"], ("seq_aux_loss", 1e-3)),
    (["global_aux_loss"], ["1e-3"], ("global_aux_loss", 1e-3)),
    (["none"], None, ("aux_loss", 0.0)),                         # no aux loss: the default type at 0 (runs as none)
    (["seq_aux_loss"], ["0"], ("aux_loss", 0.0)),
    (["aux_loss", "seq_aux_loss"], ["0", "1e-3"], ("seq_aux_loss", 1e-3)),       # one type with a coefficient
    (["aux_loss", "seq_aux_loss"], ["1e-3", "1e-3"], ("aux_loss", 2e-3)),        # two: one aux_loss, a note
    (["sinkhorn"], None, ("sinkhorn", 0.0)),
])
def test_import_reads_the_type(types, coeffs, want):
    line = ("--num-layers 4 --hidden-size 256 --num-attention-heads 8 --seq-length 256 --max-position-embeddings 256 "
            "--micro-batch-size 1 --global-batch-size 8 --num-experts 8 --moe-router-topk 2 --bf16 --vocab-size 1024 "
            f"--moe-router-load-balancing-type {' '.join(types)}"
            + (f" --moe-aux-loss-coeff {' '.join(coeffs)}" if coeffs else ""))
    imp = read_megatron(line, world_size=8)
    moe = imp.plan.model.moe
    assert (moe.moe_router_load_balancing_type, moe.moe_aux_loss_coeff) == pytest.approx(want)
    assert any("one aux_loss" in n for n in imp.notes) == (len([c for c in coeffs or [] if float(c)]) > 1)
    # the export writes what runs, and reads back as the same plan
    again = read_megatron(args_line(megatron_config(imp.plan)), world_size=8)
    assert again.plan.model_dump() == imp.plan.model_dump()


def test_sinkhorn_with_a_coefficient_is_refused_with_one_line():
    line = ("--num-layers 4 --hidden-size 256 --num-attention-heads 8 --seq-length 256 --max-position-embeddings 256 "
            "--micro-batch-size 1 --global-batch-size 8 --num-experts 8 --moe-router-topk 2 --vocab-size 1024 "
            "--moe-router-load-balancing-type sinkhorn --moe-aux-loss-coeff 0.01")
    with pytest.raises(AcesoError, match="sinkhorn with --moe-aux-loss-coeff"):
        read_megatron(line, world_size=8)


def test_bridge_export_writes_the_type():
    plan = moe_case_plan("dsv3-pp16-layout-mtp")             # the deepseek-v3 preset: seq_aux_loss
    fields = moe_bridge_fields(megatron_config(plan))
    assert (fields["moe_router_load_balancing_type"], fields["moe_aux_loss_coeff"]) == ("seq_aux_loss", 1e-3)


# ----- the price --------------------------------------------------------------------------------------------------
def test_seq_aux_loss_adds_one_forward_launch_per_moe_layer():
    """DeepSeek-V3's router by hand (host.py): gating GEMM 1, score / top-k / scatter / scaling 7 + group-limited 4
    + expert bias 2, the aux loss 11, seq_aux_loss's division by the micro-batch size 1, the expert-bias token count
    1, the shared expert 5: 32 (31 as aux_loss); fused (moe_router_fusion): 1 + 4 + 1 + 1 + 5 = 12."""
    m = load_model("deepseek-v3")
    aux = m.model_copy(update={"moe": m.moe.model_copy(update={"moe_router_load_balancing_type": "aux_loss"})})
    assert moe_launches(m, False, 32)["moe_router"] == 32
    assert moe_launches(aux, False, 32)["moe_router"] == 31
    fused = MoEPlanSettings(router_fusion=True)
    assert moe_launches(m, False, 32, fused)["moe_router"] == 12
    assert moe_launches(aux, False, 32, fused)["moe_router"] == 11
    rest = {k: v for k, v in moe_launches(m, False, 32).items() if k != "moe_router"}
    assert rest == {k: v for k, v in moe_launches(aux, False, 32).items() if k != "moe_router"}
    off = _moe(moe_router_load_balancing_type="seq_aux_loss")          # coefficient 0: no aux loss at all
    assert moe_launches(off, False, 8)["moe_router"] == 1 + 7 + 1
