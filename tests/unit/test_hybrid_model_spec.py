"""Hybrid models as ``ModelSpec``: ``hybrid_layer_pattern`` and the ``mamba`` block, checked by the rules
megatron-core 0.19 / Megatron-LM apply (training/arguments.py ``validate_args``: --num-layers is the main pattern's
length, --mtp-num-layers its '/' depths; ``MambaMixer``: whole heads and groups per TP rank; ``MambaContextParallel``:
whole heads per CP rank), and plans of models without them digested as before the fields existed."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from search import layers
from search.spec.cluster import parse_cluster
from search.layers.mamba import Mamba2Spec
from search.spec.model import ModelSpec
from search.spec.plan import uniform_plan
from search.spec.presets import load_model

MAMBA = {"mamba_state_dim": 64, "mamba_head_dim": 64, "mamba_num_groups": 8}       # H = 2 x 1024 / 64 = 32 heads
MOE = {"num_experts": 8, "moe_router_topk": 2, "moe_ffn_hidden_size": 512}


def _model(pattern="MEM*E", **kw):
    main = pattern.split("/")[0]
    base = dict(name="h", family="gpt", num_layers=len(main), hidden_size=1024, num_attention_heads=16,
                ffn_hidden_size=4096, seq_length=1024, vocab_size=32000, params_dtype="bf16", add_bias_linear=False,
                normalization="rmsnorm", position_embedding="rope", hybrid_layer_pattern=pattern,
                mamba=Mamba2Spec(**MAMBA) if "M" in pattern else None, moe=MOE if "E" in pattern else None)
    return ModelSpec(**{**base, **kw})


def test_one_unit_per_symbol_and_mtp_depths_after_the_decoder():
    m = _model("MEM*E/*E/*E", mtp_num_layers=2)
    assert [u.kind for u in m.units] == ["mamba", "moe", "mamba", "attention", "moe", "mtp", "mtp"]
    assert m.layer_starts == [0, 1, 2, 3, 4, 7]          # the MTP depths ride with the last layer
    assert layers.symbols(m) == "MEM*E/*E/*E"            # written back as megatron-core's unified pattern
    # an MTP depth: enorm, hnorm (h each), eh_proj 2h -> h, its attention and MoE layer, its final norm (h)
    h = 1024
    mtp = 3 * h + 2 * h * h + m.unit_params("attention") + m.unit_params("moe")
    assert m.unit_params("mtp") == mtp
    body = 2 * m.unit_params("mamba") + 2 * m.unit_params("moe") + m.unit_params("attention")
    assert m.num_parameters == m.embedding_params() + body + 2 * mtp + m.output_params()


@pytest.mark.parametrize("kw, match", [
    (dict(num_layers=4), r"num_layers \(4\) must equal the layers of hybrid_layer_pattern \(5"),
    (dict(hybrid_layer_pattern="ME|M*E"), r"'\|' stage cuts are the plan's"),
    (dict(hybrid_layer_pattern="MEM*E/*E", mtp_num_layers=2), r"mtp_num_layers \(2\) must equal the MTP depths"),
    (dict(mtp_num_layers=1), r"mtp_num_layers \(1\) must equal the MTP depths of hybrid_layer_pattern \(0"),
    (dict(hybrid_layer_pattern="MEM*E/M*", mtp_num_layers=1), r"MTP depth is priced as one attention and one MLP"),
    (dict(mamba=None), r"mamba: give it exactly when hybrid_layer_pattern has 'M'"),
    (dict(moe=None), r"moe: give it exactly when hybrid_layer_pattern has 'E'"),
    (dict(hybrid_layer_pattern="DED-E"), r"'D' \(ds_attention\) layers are not supported by aceso yet"),
    (dict(hybrid_layer_pattern="MEMXE"), r"'X' is not a layer symbol"),
    (dict(hybrid_layer_pattern=None), r"mamba: a Mamba-2 block needs hybrid_layer_pattern"),
    (dict(moe={**MOE, "moe_layer_freq": 2}), r"the pattern's 'E' says which layers are MoE"),
    (dict(mamba=Mamba2Spec(**{**MAMBA, "mamba_head_dim": 48})), r"expand x hidden_size \(2048\) must be a multiple"),
])
def test_refused_as_megatron_refuses(kw, match):
    with pytest.raises(ValidationError, match=match) as e:
        _model(**kw)
    assert len(e.value.errors()) == 1 and "\n" not in e.value.errors()[0]["msg"]


def test_spec_file_refusal_is_one_line(tmp_path):
    """A spec file with a wrong layer count: one line naming both fields (the CLI prints it and exits 2)."""
    import json
    from search.io.errors import AcesoError

    spec = _model().model_dump(mode="json")
    path = tmp_path / "h.json"
    path.write_text(json.dumps({**spec, "num_layers": 7}))
    with pytest.raises(AcesoError) as e:
        load_model(str(path))
    assert "\n" not in str(e.value) and "num_layers (7)" in str(e.value) and "hybrid_layer_pattern" in str(e.value)


@pytest.mark.parametrize("tp, cp, match", [
    (16, 1, r"mamba_num_groups \(8\) must be a multiple of tensor_model_parallel_size \(16\)"),
    (8, 8, r"mamba heads per TP rank \(4\) must be a multiple of context_parallel_size \(8\)"),
])
def test_plan_stage_obeys_mamba_tp_and_cp(tp, cp, match):
    """megatron-core's MambaMixer gives each TP rank whole heads and groups (32 heads, 8 groups here); its CP
    all-to-all whole heads per CP rank. Attention (16 heads) and the MLP would take tp 16."""
    m = _model("M-*-")
    with pytest.raises(ValidationError, match=match):
        uniform_plan(m, 1, tp, 1, 1, 8, cluster=parse_cluster(f"{tp * cp // 8}x8-h100"), cp=cp)
    uniform_plan(m, 1, 8, 1, 1, 8, cluster=parse_cluster("1x8-h100"))      # tp 8: 4 heads and 1 group per rank


@pytest.mark.parametrize("name, tp, stages, digest", [
    # digests computed by main at 8e7e4d3 (plan schema v4, whose settings record changed every digest), before
    # ModelSpec had the hybrid fields
    ("gpt-1.3b", 2, 2, "f6a03e89783d3d71"),
    ("llama3-8b", 4, 2, "9c9e285ef8d57103"),
    ("deepseek-v3", 4, 4, "b6f5e4ba3a69fab6"),
    ("qwen3-30b-a3b", 2, 1, "37dd4b6178e6d01a"),
])
def test_existing_plans_keep_their_digest(name, tp, stages, digest):
    m = load_model(name)
    if m.moe is not None and m.moe.moe_router_load_balancing_type != "aux_loss":    # the preset's later seq_aux_loss:
        # a model at the default type (aux_loss) dumps without the field, so it keeps its digest
        m = m.model_copy(update={"moe": m.moe.model_copy(update={"moe_router_load_balancing_type": "aux_loss"})})
    later = ("moe_router_topk_scaling_factor", "layernorm_epsilon")    # the preset's later routed_scaling_factor
    if set(later) & set(m.megatron or {}):                              # and its config's rms_norm_eps
        block = {k: v for k, v in m.megatron.items() if k not in later}
        m = m.model_copy(update={"megatron": block or None})
    m = m.model_copy(update={"rope_scaling": None})                     # the preset's later YaRN (DeepSeek-V3)
    assert "hybrid_layer_pattern" not in m.model_dump() and "mamba" not in m.model_dump()
    p = uniform_plan(m, stages, tp, 1, 1, 8, cluster=parse_cluster(f"1x{tp * stages}-h100"),
                     sequence_parallel=m.moe is not None)
    assert p.digest() == digest


# ----- presets (model_specs/presets/nemotron-*.json, made from model_specs/hybrid/*.json) -------------------------
PRESETS = ("nemotron-3-nano", "nemotron-3-super", "nemotron-3-ultra", "nemotron-h-8b", "nemotron-h-56b")


@pytest.mark.parametrize("name", PRESETS)
def test_preset_is_its_sourced_architecture(name):
    """The preset is the arch record (each field's source there) as a ModelSpec, and counts what the record's own
    module-by-module count (search.spec.hybrid_arch.counts, checked against the published sizes) counts."""
    from model_specs import preset_data
    from search.layers import hybrid
    from search.spec.hybrid_arch import counts, model_spec_data

    arch = hybrid.load(name)
    assert preset_data(name) == json.loads(json.dumps(model_spec_data(arch)))
    m = load_model(name)
    assert layers.symbols(m) == arch.full_pattern and m.num_layers == len(arch.hybrid_layer_pattern)
    assert m.num_parameters == counts(arch).total


def test_search_space_offers_the_tp_mamba_splits():
    """Attention (16 heads, 16 groups) and the MLP split over tp 8; Mamba's 2 groups only over tp 1 and 2."""
    from search.planner.space import Space
    from search.spec.training import TrainingSpec

    m = _model("M-*-", mamba=Mamba2Spec(**{**MAMBA, "mamba_num_groups": 2}))
    space = Space.of(m, parse_cluster("1x8-h100"), TrainingSpec(global_batch_size=8))
    assert sorted(space.tps) == [1, 2]
    assert set(space.cps) == {1}


def test_search_plans_nemotron_h_with_cuts_at_any_layer():
    """A 2-stage search on Nemotron-H 8B: every stage's tp splits Mamba's 128 heads and 8 groups, and the cut can
    fall at any layer of the pattern (here not at a multiple of the 2-unit attention + MLP layer)."""
    from search.pricing import make_cost_model
    from search.layers.mamba import tp_refusal
    from search.planner.aceso import SearchOptions, search
    from search.planner.space import Space
    from search.spec.training import TrainingSpec

    m, cl = load_model("nemotron-h-8b"), parse_cluster("1x8-h100")
    tr = TrainingSpec(global_batch_size=64)
    space = Space.of(m, cl, tr)
    cm = make_cost_model(m, cl, tr)
    res = search(cm, 64, space, SearchOptions(budget_evals=200, stage_counts=[2], polish_top=1))
    e = res.plans[0]
    assert e.fits
    for shape in e.state.shapes:
        assert tp_refusal(m.mamba, m.hidden_size, shape.tp) is None
    # a cut after unit 3 (M-M | -M...) is a plan megatron-core's '|' pattern can run: it validates and prices
    from search.spec.plan import ChunkSpec, ParallelPlan, StageSpec

    stages = [StageSpec(num_gpus=4, tp=1, dp=4, chunks=[ChunkSpec(start_unit=a, end_unit=b, recompute=[rc] * (b - a))])
              for a, b, rc in ((0, 3, "none"), (3, 52, "full"))]
    cost = cm.evaluate(ParallelPlan(model=m, cluster=cl, micro_batch_size=4, global_batch_size=64, stages=stages))
    assert cost.stages[0].fwd_ms < cost.stages[1].fwd_ms


def test_export_writes_a_mamba_model_as_its_hybrid_pattern_run(tmp_path, capsys):
    """A hybrid plan has one Megatron-LM form, pretrain_hybrid.py with its layer pattern: the plain export writes
    it (pretrain_gpt.py flags would build a GPT model without the Mamba layers), identical to --hybrid-pattern's;
    the Aceso reference's config has no Mamba op and refuses in one line."""
    from search.cli import main

    m = load_model("nemotron-h-8b")
    plan = tmp_path / "plan.json"
    plan.write_text(uniform_plan(m, 1, 1, 8, 8, 64, cluster=parse_cluster("1x8-h100")).to_json())
    out, flagged = tmp_path / "megatron-lm.sh", tmp_path / "flagged.sh"
    assert main(["export", str(plan), "--to", "megatron-lm", "-o", str(out)]) == 0
    assert main(["export", str(plan), "--to", "megatron-lm", "--hybrid-pattern", "-o", str(flagged)]) == 0
    text = out.read_text()
    assert "pretrain_hybrid.py" in text and "pretrain_gpt.py" not in text
    assert m.hybrid_layer_pattern in text
    assert text == flagged.read_text()
    legacy = tmp_path / "legacy.json"
    assert main(["export", str(plan), "--to", "aceso-legacy", "-o", str(legacy)]) == 2
    err = capsys.readouterr().err
    assert "has Mamba-2 layers (hybrid_layer_pattern)" in err and err.count("\n") == 1
    assert not legacy.exists()
    # Megatron-Bridge builds it from its Nemotron-H recipe (tests/unit/test_bridge_hybrid.py)
    out = tmp_path / "megatron-bridge.out"
    assert main(["export", str(plan), "--to", "megatron-bridge", "-o", str(out)]) == 0
    assert "nemotronh_8b_pretrain_config" in out.read_text()
