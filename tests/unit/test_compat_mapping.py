"""Plan <-> reference config mapping (search/compat/mapping.py): op counts, flags, round trips, import rules.

Expected op lists are written out by hand from SPEC §2 (GPT layer = 13 ops, T5 encoder 13, decoder 21).
"""

from __future__ import annotations

import numpy as np
import pytest

from search.compat import load_ref_config, parse_ref_config
from search.compat.mapping import plan_to_ref, ref_to_plan
from search.io.errors import AcesoError
from search.spec.plan import ParallelPlan, StageSpec, recompute_allowed
from search.spec.presets import load_model


def _plan(model, stages, mbs=2, gbs=16):
    return ParallelPlan(model=model, micro_batch_size=mbs, global_batch_size=gbs,
                        stages=[StageSpec(num_gpus=t * d, tp=t, dp=d, start_unit=a, end_unit=b, recompute=rc)
                                for (a, b, t, d, rc) in stages])


def test_export_gpt_hand_written_plan():
    model = load_model("gpt-1.3b", num_layers=2)      # 4 units, 2*13+3 = 29 ops
    plan = _plan(model, [(0, 3, 2, 1, ["selective", "full", "none"]), (3, 4, 1, 2, ["full"])])
    ref = plan_to_ref(plan)
    assert ref.num_ops == [1 + 13 + 8, 5 + 2]
    assert ref.raw["num_stages"] == 2 and ref.raw["num_gpus"] == [2, 2]
    emb, attn_sel, mlp_full, attn_none = [0], [0, 0, 1, 1, 1, 1, 0, 0], [1] * 5, [0] * 8
    assert ref.recompute == [emb + attn_sel + mlp_full + attn_none, mlp_full + [0, 0]]
    assert ref.tp == [[2] * 22, [1] * 7] and ref.dp == [[1] * 22, [2] * 7]
    assert ref.algo == [[0] * 22, [0] * 7]
    assert (ref.model_name, ref.model_size, ref.num_layers) == ("gpt", "1_3B", 2)
    assert ref.raw["checkpoint_activations"] == [True, True]


def test_export_gpt_selective_mlp_flags_gemm1_and_gelu():
    model = load_model("gpt-1.3b", num_layers=1)
    ref = plan_to_ref(_plan(model, [(0, 2, 1, 1, ["none", "selective"])]))
    assert ref.recompute == [[0] + [0] * 8 + [0, 1, 1, 0, 0] + [0, 0]]


def test_export_t5_glue_ops_and_cross_attention():
    model = load_model("t5-770m", num_layers=1)       # units: enc attn, enc mlp, dec attn, dec cross, dec mlp
    plan = _plan(model, [(0, 2, 1, 1, ["none", "none"]), (2, 5, 1, 1, ["none", "selective", "full"])])
    ref = plan_to_ref(plan)
    assert ref.num_ops == [1 + 13 + 1, 1 + 21 + 2]    # enc-final-layernorm closes the encoder stage
    cross_sel = [0, 0, 1, 1, 1, 1, 0, 0]
    assert ref.recompute[1] == [0] + [0] * 8 + cross_sel + [1] * 5 + [0, 0]
    assert ref.raw["encoder_seq_length"] == 2048 and ref.raw["decoder_seq_length"] == 512


def _random_plan(model, rng, num_stages):
    cuts = sorted(rng.choice(np.arange(1, model.num_units), num_stages - 1, replace=False).tolist())
    bounds = [0] + cuts + [model.num_units]
    stages = []
    for a, b in zip(bounds, bounds[1:]):
        tp, dp = [(1, 1), (2, 1), (1, 2), (2, 2), (4, 1)][rng.integers(5)]
        stages.append((a, b, tp, dp, [rng.choice(recompute_allowed(u.kind)) for u in model.units[a:b]]))
    return _plan(model, stages, mbs=4, gbs=64)


@pytest.mark.parametrize("preset,layers", [("gpt-1.3b", 24), ("gpt-1.3b", 3), ("t5-770m", 24), ("t5-770m", 2)])
def test_round_trip_plan_export_import(preset, layers):
    model = load_model(preset, num_layers=layers if layers != 24 else None)
    rng = np.random.default_rng(layers)
    for _ in range(10):
        plan = _random_plan(model, rng, int(rng.integers(1, min(5, model.num_units) + 1)))
        ref = plan_to_ref(plan)
        back, notes = ref_to_plan(parse_ref_config(ref.raw))
        assert notes == []
        assert back == plan


def test_import_mid_unit_boundary_errors_then_snaps(reference_db):
    cfg = load_ref_config(reference_db / "configs" / "gpt_1_3B_4gpus_reference_search.json")
    with pytest.raises(AcesoError, match=r"stage 0 ends inside unit 11 .*--snap"):
        ref_to_plan(cfg)
    plan, notes = ref_to_plan(cfg, snap=True)
    # op starts 78, 159, 242; unit starts 1 + 13*l + 8*h: 78 -> 79 (unit 12), 159 -> 157 (unit 24; 157 is 2
    # away, 162 is 3), 242 -> 243 (unit 37)
    assert [(s.start_unit, s.end_unit) for s in plan.stages] == [(0, 12), (12, 24), (24, 37), (37, 48)]
    assert any("moved from op 78 to op 79" in n for n in notes)


def test_import_megatron_grid_configs_need_no_snap(reference_db):
    for name, cuts in (("gpt_1_3B_4gpus_megatron_grid_best", [0, 12, 24, 36, 48]),
                       ("t5_770M_4gpus_megatron_grid_best", [0, 24, 48, 84, 120])):
        plan, notes = ref_to_plan(load_ref_config(reference_db / "configs" / f"{name}.json"))
        assert [s.start_unit for s in plan.stages] + [plan.stages[-1].end_unit] == cuts
        assert all(rc == "full" for s in plan.stages for rc in s.recompute)   # Megatron full recompute
        assert notes == []


def test_import_t5_glue_on_either_side_is_a_unit_boundary():
    model = load_model("t5-770m", num_layers=1)
    raw = plan_to_ref(_plan(model, [(0, 2, 1, 1, ["none"] * 2), (2, 5, 1, 1, ["none"] * 3)])).raw
    for shift in (-1, 1):   # enc-final-layernorm to the decoder stage / decoder-embedding to the encoder stage
        moved = dict(raw, num_ops_in_each_stage=[15 + shift, 24 - shift])
        for key in ("model_parallel_size_of_each_op", "data_parallel_size_of_each_op", "recompute_ops",
                    "algo_of_each_op"):
            moved[key] = [[raw[key][0][0]] * (15 + shift), [raw[key][1][0]] * (24 - shift)]
        plan, notes = ref_to_plan(parse_ref_config(moved))
        assert [(s.start_unit, s.end_unit) for s in plan.stages] == [(0, 2), (2, 5)] and notes == []


def test_import_recompute_covering_rule():
    model = load_model("gpt-1.3b", num_layers=1)
    raw = plan_to_ref(_plan(model, [(0, 2, 1, 1, ["none", "none"])])).raw
    cases = {  # op offsets flagged inside the attention unit (ops 1-8) / MLP unit (ops 9-13) -> expected
        (3, 4): ("selective", "none"),          # score, softmax: inside the attention core
        (10, 11): ("none", "selective"),        # MLP-GEMM-1 + gelu: exactly MLP selective
        (11, 12): ("none", "full"),             # gelu + GEMM-2: not covered by selective
        (11,): ("none", "selective"),           # gelu alone: covered by selective
        (1,): ("full", "none"),                 # a layernorm
    }
    for ops, want in cases.items():
        flags = [0] * 16
        for k in ops:
            flags[k] = 1
        plan, notes = ref_to_plan(parse_ref_config(dict(raw, recompute_ops=[flags])))
        assert tuple(plan.stages[0].recompute) == want, ops
        assert bool(notes) == (ops in ((3, 4), (11, 12), (11,), (1,)))


def test_import_rejects_mixed_tp_algo1_and_unknown_model(reference_db):
    model = load_model("gpt-1.3b", num_layers=1)
    raw = plan_to_ref(_plan(model, [(0, 2, 2, 1, ["none", "none"])])).raw
    with pytest.raises(AcesoError, match="stage 0 mixes tp"):
        ref_to_plan(parse_ref_config(dict(raw, model_parallel_size_of_each_op=[[2] * 8 + [1] * 8],
                                          data_parallel_size_of_each_op=[[1] * 8 + [2] * 8])))
    with pytest.raises(AcesoError, match="algo 1"):
        ref_to_plan(parse_ref_config(dict(raw, algo_of_each_op=[[0] * 5 + [1] + [0] * 10])))
    with pytest.raises(AcesoError, match="no preset has this aceso_db_key"):
        ref_to_plan(parse_ref_config(dict(raw, model_size="7B")))
    with pytest.raises(AcesoError, match="hidden_size"):
        ref_to_plan(parse_ref_config(dict(raw, hidden_size=4096)))
    with pytest.raises(AcesoError, match="stage 0 op 0: tp"):
        parse_ref_config(dict(raw, num_gpus=[4]))


def test_export_needs_an_aceso_model():
    llama = load_model("llama3-8b", num_layers=1)
    with pytest.raises(AcesoError, match="no aceso_db_key"):
        plan_to_ref(_plan(llama, [(0, 2, 1, 1, ["none", "none"])]))
    t5 = load_model("t5-770m", num_layers=1).model_copy(update={"num_decoder_layers": 2})
    with pytest.raises(AcesoError, match="one num_layers"):
        plan_to_ref(_plan(t5, [(0, t5.num_units, 1, 1, ["none"] * t5.num_units)]))
