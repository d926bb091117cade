"""MoE / MLA / MTP both ways with Megatron-LM core_v0.16.1 and Megatron-Bridge v0.3.1 (issue 22 part 5).

References: the flag list of Megatron-LM core_v0.16.1's parser (search/megatron/data/flags_core_v0.16.1.txt), the
Bridge v0.3.1 field list (bridge_fields_v0.3.1.json), NVIDIA's published Megatron-Bridge configurations
(../shared/published/megatron-bridge-25.09-25.11.json: each row's tp/pp/ep/vp/mbs/gbs and our presets), and layer
placements computed by hand from megatron-core 0.16.1's rules (pipeline_parallel_layer_layout.py,
transformer_block.get_num_layers_to_build, multi_token_prediction.get_mtp_num_layers_to_build).
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from search.io.errors import AcesoError
from search.megatron import check_expressible, megatron_config
from search.megatron.bridge import overrides, recipe_for
from search.megatron.cmdline import megatron_flags
from search.megatron.importer import read_megatron
from search.megatron.layout import Split, distribution, format_layout, layout_chunk_layers, split_for
from search.megatron.moe_flags import layer_freq
from search.megatron.names import megatron_lm_args
from search.megatron.script import args_line
from search.spec.plan import ParallelPlan
from search.spec.presets import load_model
from tests.megatron_moe_plans import MOE_CASES, moe_case_config, moe_case_plan

PUBLISHED = Path(__file__).resolve().parents[3] / "shared" / "published" / "megatron-bridge-25.09-25.11.json"
BRIDGE = json.loads((Path(__file__).resolve().parents[2] / "search" / "megatron" / "data" /
                     "bridge_fields_v0.3.1.json").read_text())["fields"]
MLA_FIELDS = {"q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim",
              # MLATransformerConfig's YaRN (DeepSeek-V3's and Kimi-K2's rope_scaling)
              "rope_type", "rotary_scaling_factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
              "mscale_all_dim"}


def test_at_least_15_moe_plans_cover_the_forms():
    cases = [moe_case_config(n) for n in MOE_CASES]
    assert len(cases) >= 15
    assert {c.settings.moe.token_dispatcher for c in cases} == {"alltoall", "allgather", "flex"}
    assert {(c.ep, c.etp) for c in cases} >= {(8, 1), (4, 2), (2, None), (1, None)}
    assert any(c.model.mtp_num_layers for c in cases) and any(c.model.mla for c in cases)
    lines = [args_line(c) for c in cases]
    assert sum("--pipeline-model-parallel-layout" in x for x in lines) >= 2
    assert sum("--decoder-first-pipeline-num-layers" in x for x in lines) >= 2


@pytest.mark.parametrize("name", sorted(MOE_CASES))
def test_round_trip_export_import_gives_the_same_plan(name):
    plan = moe_case_plan(name)
    line = args_line(megatron_config(plan))
    imp = read_megatron(line, world_size=plan.world_size, cluster=plan.cluster)
    assert imp.plan.model_dump() == plan.model_dump()
    assert not imp.ignored                        # our own flags: nothing unknown


@pytest.mark.parametrize("name", sorted(MOE_CASES))
def test_every_exported_flag_is_a_megatron_lm_core_v0_16_1_flag(name):
    groups = megatron_lm_args(moe_case_config(name))
    flags = {a for g in groups.values() for a in g if a.startswith("--")}
    assert flags - megatron_flags() == set()


@pytest.mark.parametrize("name", sorted(MOE_CASES))
def test_every_bridge_field_exists_in_v0_3_1(name):
    c = moe_case_config(name)
    recipe, ov = overrides(c)
    unknown = set(ov["model"]) - set(BRIDGE["model"])
    # MLA's fields are MLATransformerConfig's (the deepseek recipe's MLAModelProvider; tests/runtime checks them)
    assert unknown <= (MLA_FIELDS if c.model.mla else set()), unknown
    assert recipe == ("deepseek_v3_pretrain_config" if c.model.mla else "gpt3_175b_pretrain_config"
                      if c.model.activation == "gelu" else "qwen3_30b_a3b_pretrain_config")
    assert set(ov.get("comm_overlap", {})) <= set(BRIDGE["comm_overlap"])
    m = ov["model"]
    assert m["num_moe_experts"] == c.model.moe.num_experts and m["expert_model_parallel_size"] == c.ep
    assert m["expert_tensor_parallel_size"] == (c.etp or c.tp) and m["mtp_num_layers"] == c.model.mtp_num_layers


def test_dense_bridge_export_is_unchanged():
    from tests.megatron_plans import case_config
    c = case_config("llama-pp2-first-cp2")
    assert recipe_for(c) == "llama3_8b_pretrain_config"
    assert not {k for k in overrides(c)[1]["model"] if "moe" in k or "mtp" in k or "expert" in k}


# ----- the expert folding ------------------------------------------------------------------------------------
def test_a_plan_with_two_expert_foldings_is_refused_with_the_one_line():
    plan = moe_case_plan("mixtral-tp2-ep4-etp2-allgather")
    data = plan.model_dump()
    data["stages"][1].update(ep=2, etp=2)
    msg = check_expressible(ParallelPlan.model_validate(data))
    assert msg == ("stages[1] has the expert shape ep 2 etp 2, stages[0] ep 4 etp 2: Megatron-LM has one expert "
                   "folding for all stages; run the plan on the aceso runtime, or search again with "
                   "--target megatron-lm (one folding)")
    data["stages"][1].update(ep=4, etp=None)        # None = tp = 2: the same folding, expressible
    assert check_expressible(ParallelPlan.model_validate(data)) is None


# ----- --moe-layer-freq ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("text,n,expect", [
    ("1", 4, {"moe_layer_freq": 1}),
    ("2", 4, {"moe_layer_freq": 2}),
    ("[0]*3+[1]*58", 61, {"moe_layer_freq": 1, "first_k_dense_layers": 3}),      # DeepSeek-V3
    ("([0]+[1]*23)", 24, {"moe_layer_freq": 1, "first_k_dense_layers": 1}),
    ("[1,0]*3", 6, {"moe_layer_freq": 2}),
    ("[0,0]+[1,0]*2", 6, {"moe_layer_freq": 2, "first_k_dense_layers": 2}),
    ("([1]*3+[0]*1)*3", 12, {"moe_layer_freq": [1, 1, 1, 0] * 3}),              # arguments.py's own example
])
def test_moe_layer_freq_is_read_as_megatron_lm_evaluates_it(text, n, expect):
    assert layer_freq(text, n) == expect


@pytest.mark.parametrize("text,needle", [("[0]*2+[1]*3", "has 5 entries but --num-layers is 4"),
                                         ("[__import__('os')]", "only digits"), ("[2]*4", "0s (dense) and 1s"),
                                         ("[1]*", "not a list expression"), ("two", "an integer or a list")])
def test_bad_moe_layer_freq(text, needle):
    with pytest.raises(AcesoError, match=re.escape(needle)):
        layer_freq(text, 4)


def test_exported_layer_pattern_is_the_run_length_expression():
    line = args_line(moe_case_config("dsv3-pp4-vpp4-layout-mtp-flex"))
    assert "--moe-layer-freq '[0]*3+[1]*58'" in line and "--mtp-num-layers 1" in line
    assert "--pipeline-model-parallel-layout 'Et*4|" + "t*4|" * 14 + "tmL'" in line
    # pp 16 without vpp: the same split is --decoder-last-pipeline-num-layers 1 (MTP on the last stage anyway)
    line = args_line(moe_case_config("dsv3-pp16-layout-mtp"))
    assert "--decoder-last-pipeline-num-layers 1" in line and "layout" not in line


# ----- layer placement (hand-computed from megatron-core 0.16.1's rules) -------------------------------------
@pytest.mark.parametrize("text,pp,mtp,chunks,vpp", [
    ("Et*4|(t*4|)*14tmL", 4, 1, (4,) * 15 + (1,), 4),       # Bridge's DeepSeek-V3 (4, 4) layout with MTP
    ("Et*4|(t*4|)*14tL", 4, 0, (4,) * 15 + (1,), 4),
    ("Ettt|(tt|)*29,t|L", 32, 0, (3,) + (2,) * 29 + (1, 0), 1),   # a loss-only last chunk (holds_only "loss")
    ("E|t*4|t*4|tmL", 2, 1, (0, 4, 4, 1), 2),                # an embedding-only first chunk
    ("Et*2||t*2|L", 2, 0, None, None),                      # a middle chunk with nothing: refused
    ("Et*2|t*2|mmL", 3, 2, (2, 2, 0), 1),                   # the last chunk holds the MTP block alone
    ("E,t,t|t,t,m,L", 2, 1, (2, 2), 1),                     # commas are cosmetic
])
def test_layout_placement(text, pp, mtp, chunks, vpp):
    if chunks is None:
        with pytest.raises(AcesoError, match="model chunk 1 holds nothing"):
            layout_chunk_layers(text, pp, mtp)
        return
    assert layout_chunk_layers(text, pp, mtp) == (chunks, vpp)
    assert layout_chunk_layers(format_layout(chunks, mtp), pp, mtp) == (chunks, vpp)   # what export writes


def test_format_layout_with_mtp():
    assert format_layout((4, 4, 1), 1) == "Et*4|t*4|tmL"
    assert format_layout((2, 2, 0), 2) == "Et*2|t*2|mmL"


@pytest.mark.parametrize("text,pp,mtp,needle", [
    ("Et*2|t*2L", 2, 1, "0 MTP layers (m) but --mtp-num-layers is 1"),
    ("Et*2|t*2mL", 2, 0, "1 MTP layers (m) but --mtp-num-layers is 0"),
    ("Et|mt|t|tL", 2, 1, "decoder layers (t) after an MTP layer"),
    ("Et|t|tm|L", 2, 1, "the MTP layers are in model chunk 2, not the last one (3)"),
    ("Ettt|(tt|)*29,m|L", 32, 1, "in model chunk 30, not the last one (31)"),   # megatron-core's docstring example
])
def test_layout_mtp_rules(text, pp, mtp, needle):
    with pytest.raises(AcesoError, match=re.escape(needle)):
        layout_chunk_layers(text, pp, mtp)


def test_uneven_first_last_and_embedding_loss_accounting():
    # get_num_layers_to_build: (61 - 5 - 8) / 6 middle ranks = 8; (94 + E + L) / 4 ranks / 12 chunks = 2 per chunk,
    # the first chunk gives one to the embedding and the last one to the loss
    assert distribution(61, 8, 1, first=5, last=8) == (5,) + (8,) * 7
    assert distribution(94, 4, 12, embedding_counts=True, loss_counts=True) == (1,) + (2,) * 46 + (1,)
    assert distribution(61, 4, 1, first=16, last=13) == (16, 16, 16, 13)       # Bridge's DeepSeek-V3 (4, 1) map
    # without a layout megatron-core builds MTP on the last chunk: even / first-last splits need no layout
    assert split_for((30, 31), 2, 1, mtp=1) == Split(1, first=30)
    assert split_for((4, 4), 2, 1, mtp=1) == Split(1)
    assert split_for((2, 2, 0), 3, 1, mtp=2).layout == "Et*2|t*2|mmL"


def test_mtp_unit_belongs_to_the_last_chunk():
    plan = moe_case_plan("dsv3-pp16-layout-mtp")
    assert plan.stages[-1].chunks[-1].end_unit == plan.model.num_units
    assert [sum(c.num_units for c in st.chunks) for st in plan.stages][:2] == \
        [plan.model.layer_starts[4], plan.model.layer_starts[8] - plan.model.layer_starts[4]]


# ----- NVIDIA's published Megatron-Bridge configurations ----------------------------------------------------
# FP8 / MXFP8 flags are the low-precision issue's (refused by the importer until it lands): stripped here, the rest
# of each command line is read as published. GPT-OSS needs sliding-window / GEGLU fields of its own (not a preset).
_FP8 = re.compile(r"--fp8-format \S+|--fp8-recipe \S+|--fp8-param-gather|--reuse-grad-buf-for-mxfp8-param-ag")
# the only difference between a published architecture and our preset: DeepSeek-V3's aux-loss coefficient (Bridge:
# 1e-4, the Megatron-LM DeepSeek example; our preset: 1e-3 as HF's aux_loss_alpha). A run setting, not architecture.
_DIFFERS = {"deepseek-v3": {"moe_aux_loss_coeff": (1e-4, 1e-3)}, "deepseek-v3-no-mtp": {"moe_aux_loss_coeff": (1e-4, 1e-3)}}
# numerics a row's args leave at megatron-core's defaults where the model's config.json states otherwise (the preset
# follows the config): DeepSeek-V3's and Kimi-K2's args give no --norm-epsilon (config: 1e-6); the 25.x DeepSeek-V3
# rows no YaRN flags
_UNSTATED = {"deepseek-v3": {"layernorm_epsilon", "rope_scaling"}, "deepseek-v3-no-mtp": {"layernorm_epsilon", "rope_scaling"},
             "kimi-k2": {"layernorm_epsilon", "rope_scaling"}}
# rows a plan cannot hold, with why
_REFUSED = {"ep > gpus per stage": "etp (1) x ep (64) must divide the stage's num_gpus (32)",
            "graph of a padded alltoall preprocess": "stack.cuda_graphs.scope moe_preprocess with the alltoall "
                                                     "dispatcher and a capacity factor"}


def _rows():
    if not PUBLISHED.is_file():
        return []
    rows = json.loads(PUBLISHED.read_text())["rows"]
    return [r for r in rows if r["moe"] and r["mlm_check"] == "ok" and not r["model"].startswith("gpt-oss")]


ROWS_RELEASE = "core_v0.16.1"        # the rows' args are core_v0.16.1 command lines (../shared/published/README.md)


@pytest.mark.skipif(not PUBLISHED.is_file(), reason="../shared/published (the shared reference data) is absent")
@pytest.mark.parametrize("row", _rows(), ids=lambda r: r["id"])
def test_published_moe_rows_import_with_their_shape_and_our_preset(row):
    args = _FP8.sub("", row["args"])
    if row["pp"] * row["ep"] > row["gpus"]:
        with pytest.raises(AcesoError, match=re.escape(_REFUSED["ep > gpus per stage"])):
            read_megatron(args, world_size=row["gpus"], version=ROWS_RELEASE)
        return
    if "--moe-pad-expert-input-to-capacity" in args and "moe_preprocess" in args and "alltoall" in args:
        # megatron-core 0.16.1's TransformerConfig refuses this command line (tests/runtime/test_stack_rules.py)
        with pytest.raises(AcesoError, match=re.escape(_REFUSED["graph of a padded alltoall preprocess"])):
            read_megatron(args, world_size=row["gpus"], version=ROWS_RELEASE)
        return
    imp = read_megatron(args, world_size=row["gpus"], version=ROWS_RELEASE)
    plan = imp.plan
    st = plan.stages[0]
    assert (st.tp, plan.num_stages, st.cp, plan.num_virtual_stages) == (row["tp"], row["pp"], row["cp"], row["vp"] or 1)
    assert all(s.ep == row["ep"] for s in plan.stages)
    assert (plan.micro_batch_per_rank(0), plan.global_batch_size) == (row["mbs"], row["gbs"])
    assert plan.moe.token_dispatcher == shlex.split(args)[shlex.split(args).index("--moe-token-dispatcher-type") + 1]
    name = plan.model.name
    assert name.startswith(row["model"].split("-token")[0].replace("-mtp0", "").replace("-mtp1", ""))
    assert bool(plan.model.mtp_num_layers) == bool(row["mtp_layers"])
    a, b = plan.model.model_dump(), load_model(name).model_dump()
    assert a.pop("make_vocab_size_divisible_by") == 128 * row["tp"]        # Megatron-LM pads to 128 x tp
    b.pop("make_vocab_size_divisible_by")
    moe_a, moe_b = a.pop("moe"), b.pop("moe")
    # the numerics: where the command line states the norm epsilon or YaRN it is the preset's (each model's HF
    # config.json, tests/unit/test_preset_hf_fields.py); where it leaves them out the row runs megatron-core's
    # defaults (1e-5, plain RoPE), named in _UNSTATED; the router's top-k scaling factor is always the preset's
    # (NVIDIA's run states the preset's HF routed_scaling_factor, 1.0 when absent)
    flags = shlex.split(args)
    run_factor = float(flags[flags.index("--moe-router-topk-scaling-factor") + 1]) \
        if "--moe-router-topk-scaling-factor" in flags else 1.0
    assert (b.get("megatron") or {}).get("moe_router_topk_scaling_factor", 1.0) == run_factor, name
    block_a, block_b = dict(a.pop("megatron") or {}), dict(b.pop("megatron") or {})
    eps_a, eps_b = block_a.pop("layernorm_epsilon", 1e-5), block_b.pop("layernorm_epsilon", 1e-5)
    rope_a, rope_b = a.pop("rope_scaling"), b.pop("rope_scaling")
    unstated = {"layernorm_epsilon": (eps_a, eps_b)} if "--norm-epsilon" not in flags and eps_a != eps_b else {}
    if "--rotary-scaling-factor" not in flags and rope_a != rope_b:
        unstated["rope_scaling"] = (rope_a, rope_b)
    assert (eps_a == eps_b or "layernorm_epsilon" in unstated) and (rope_a == rope_b or "rope_scaling" in unstated)
    assert set(unstated) <= _UNSTATED.get(name, set()), (name, unstated)
    assert block_a == block_b
    assert a == b
    diff = {k: (moe_a[k], moe_b[k]) for k in moe_a if moe_a[k] != moe_b[k]}
    if "--moe-router-force-load-balancing" in args:                      # benchmark routing: kept, as they say
        assert diff.pop("moe_router_force_load_balancing") == (True, False)
    diff.pop("moe_expert_capacity_factor", None) if "--moe-expert-capacity-factor" in args else None
    if "--moe-pad-expert-input-to-capacity" in args:                     # the token-drop rows pad, as they say
        assert diff.pop("moe_pad_expert_input_to_capacity") == (True, False)
    assert diff == _DIFFERS.get(name, {})


@pytest.mark.skipif(not PUBLISHED.is_file(), reason="../shared/published (the shared reference data) is absent")
def test_published_rows_cover_the_three_presets_and_mtp():
    names = set()
    for row in _rows():
        try:
            names.add(read_megatron(_FP8.sub("", row["args"]), world_size=row["gpus"],
                                    version=ROWS_RELEASE).plan.model.name)
        except AcesoError:
            pass
    assert names == {"qwen3-30b-a3b", "qwen3-235b-a22b", "deepseek-v3", "deepseek-v3-no-mtp"}


# ----- per-unit recompute of moe / mtp units (needs the moe / mtp units of ModelSpec.units) ---------------------
def _needs_moe_units(model):
    if not any(u.kind == "moe" for u in model.units):
        pytest.skip("ModelSpec.units has no moe units yet (the MoE cost model's unit list)")


@pytest.mark.parametrize("modules,attention,moe", [("core_attn", "selective", "none"), ("moe_act", "none", "selective"),
                                                   ("core_attn moe_act", "selective", "selective")])
def test_moe_act_is_selective_on_moe_units(modules, attention, moe):
    plan = moe_case_plan("tiny-list-shared-overlap")
    m = plan.model
    _needs_moe_units(m)
    line = args_line(megatron_config(plan)).replace("--recompute-modules core_attn", f"--recompute-modules {modules}")
    back = read_megatron(line, world_size=plan.world_size, cluster=plan.cluster).plan
    want = {"attention": attention, "moe": moe, "mlp": "none"}
    for _, _, ch in back.chunks_in_order():
        assert ch.recompute == [want[m.units[ch.start_unit + k].kind] for k in range(ch.num_units)]
    assert f"--recompute-modules {modules}" in args_line(megatron_config(back))        # and back again


def test_mtp_unit_choice_and_the_mtp_alone_chunk():
    plan = moe_case_plan("tiny-mla-mtp2-even-full")
    m = plan.model
    if not any(u.kind == "mtp" for u in m.units):
        pytest.skip("ModelSpec.units has no mtp unit yet (the MoE cost model's unit list)")
    assert plan.stages[-1].chunks[-1].recompute[-2:] == ["full", "full"]        # uniform: MTP recomputed
    line = args_line(megatron_config(plan)).replace("--recompute-method uniform", "--recompute-method block")
    assert read_megatron(line, world_size=plan.world_size).plan.stages[-1].chunks[-1].recompute[-2:] == \
        ["none", "none"]                                                         # block skips MTP (megatron-core)
    cfg = moe_case_config("tiny-mla-mtp2-even-full")
    alone = cfg.__class__(**{**cfg.__dict__, "chunk_layers": (2, 2, 0), "pp": 3, "dp": 2})
    line = args_line(alone)
    assert "--pipeline-model-parallel-layout 'Et*2|t*2|mmL'" in line
    back = read_megatron(line, world_size=alone.world_size)
    assert back.plan.stages[-1].chunks[0].num_units == 2 and back.config.chunk_layers == (2, 2, 0)
    assert args_line(megatron_config(back.plan)) == line


@pytest.mark.parametrize("name", ["qwen30-ep8", "dsv3-pp4-vpp4-layout-mtp-flex", "tiny-mla-mtp2-layout-selective"])
def test_cli_export_import_round_trip_prices_the_moe_plan(name, tmp_path, capsys):
    from search.cli import main
    plan = moe_case_plan(name)
    src, args, back, yaml = (tmp_path / x for x in ("plan.json", "args.txt", "back.json", "bridge.yaml"))
    src.write_text(plan.to_json())
    assert main(["export", str(src), "--to", "megatron-lm", "--args-only", "-o", str(args)]) == 0
    assert main(["import", str(args), "--from", "megatron-lm", "--cluster", plan.cluster.label, "-o", str(back)]) == 0
    assert "warning" not in capsys.readouterr().err
    got = ParallelPlan.model_validate_json(back.read_text())
    assert got.model_dump(exclude={"predicted"}) == plan.model_dump(exclude={"predicted"})
    assert got.predicted is not None and got.predicted.iteration_time_ms > 0       # priced by the MoE cost model
    assert main(["export", str(back), "--to", "megatron-bridge", "-o", str(yaml)]) == 0
    assert "num_moe_experts: " + str(plan.model.moe.num_experts) in yaml.read_text()


def test_flex_backend_is_read_written_and_checked_as_megatron_core_does():
    """``--moe-flex-dispatcher-backend`` is the plan's ``moe.flex_backend`` both ways (Megatron-LM and Bridge);
    with padded expert input megatron-core's TransformerConfig refuses deepep ("Flex token dispatcher with deepep
    backend does not support moe_pad_expert_input_to_capacity"), so the plan does, in one line."""
    plan = moe_case_plan("tiny-list-padded-flex-hybridep")
    line = args_line(megatron_config(plan))
    assert "--moe-token-dispatcher-type flex --moe-flex-dispatcher-backend hybridep" in line
    assert read_megatron(line, world_size=plan.world_size).plan.moe.flex_backend == "hybridep"
    assert overrides(megatron_config(plan))[1]["model"]["moe_flex_dispatcher_backend"] == "hybridep"
    deepep = line.replace("--moe-flex-dispatcher-backend hybridep", "--moe-flex-dispatcher-backend deepep")
    with pytest.raises(AcesoError, match="pads expert input only with the hybridep backend"):
        read_megatron(deepep, world_size=plan.world_size)
    alltoall = read_megatron(line.replace("--moe-token-dispatcher-type flex", "--moe-token-dispatcher-type alltoall"),
                             world_size=plan.world_size).plan
    assert alltoall.moe.flex_backend == "deepep"          # the backend means nothing without flex
    assert "--moe-flex-dispatcher-backend" not in args_line(megatron_config(alltoall))


def test_routing_is_learned_unless_the_command_line_forces_balance():
    """Issue 32: a preset plan's exported script trained with benchmark routing (--moe-router-force-load-balancing:
    random router scores) because the spec defaulted to it. Now the presets route as they learn; Megatron-LM's own
    flag list has the flag (so it is a real flag we leave out), and an imported command line that forces balance
    (the published rows) keeps it through export."""
    assert "--moe-router-force-load-balancing" in megatron_flags()
    plan = moe_case_plan("qwen30-ep8")
    assert not plan.model.moe.moe_router_force_load_balancing
    line = args_line(megatron_config(plan))
    assert "--moe-router-force-load-balancing" not in shlex.split(line)
    assert overrides(megatron_config(plan))[1]["model"]["moe_router_force_load_balancing"] is False
    forced = read_megatron(line + " --moe-router-force-load-balancing", world_size=plan.world_size)
    assert forced.plan.model.moe.moe_router_force_load_balancing
    assert "--moe-router-force-load-balancing" in shlex.split(args_line(megatron_config(forced.plan)))
