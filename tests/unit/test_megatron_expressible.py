"""``check_expressible``: plans Megatron-LM (core_v0.16.1) runs exactly pass, every other kind is refused with one
line naming the stage and field. The expected verdicts follow megatron-core's recompute and layout semantics
(``TransformerBlock._checkpointed_forward``: block N = the first N layers of every model chunk)."""

import pytest

from search.megatron import check_expressible, megatron_config
from search.megatron.build import plan_from_config
from search.megatron.config import MegatronConfig, Recompute
from search.spec.plan import ParallelPlan, uniform_plan
from search.spec.presets import load_model
from tests.megatron_plans import config_fields

GPT = load_model("gpt-1.3b", num_layers=8)
T5 = load_model("t5-770m", num_layers=2)
FULL1, SEL = Recompute("full", "uniform", 1), Recompute("selective", modules=("core_attn",))


def cfg(model=GPT, chunk_layers=(4, 4), pp=2, vpp=1, tp=2, dp=2, rc=Recompute(), **kw) -> MegatronConfig:
    return MegatronConfig(model=model, tp=tp, pp=pp, cp=1, dp=dp, vpp=vpp, sequence_parallel=kw.pop("sp", False),
                          chunk_layers=chunk_layers, recompute=rc, micro_batch_size=kw.pop("mbs", 2),
                          global_batch_size=kw.pop("gbs", 64), **config_fields(kw))


def edited(plan: ParallelPlan, fn) -> ParallelPlan:
    d = plan.model_dump()
    fn(d)
    return ParallelPlan.model_validate(d)


@pytest.mark.parametrize("c", [
    cfg(), cfg(rc=FULL1), cfg(rc=SEL), cfg(chunk_layers=(3, 5), rc=Recompute("full", "block", 2)),
    cfg(chunk_layers=(1, 2, 3, 2), vpp=2, rc=Recompute("full", "block", 2), sp=True),
    cfg(chunk_layers=(2, 1, 1, 1, 2, 1), pp=3, vpp=2, tp=1, dp=2, gbs=48, distributed_optimizer=True,
        overlap_grad_reduce=True, overlap_param_gather=True),
    cfg(model=T5, chunk_layers=(4,), pp=1, tp=4, dp=2, rc=Recompute("full", "block", 1)),
    cfg(model=T5, chunk_layers=(4,), pp=1, tp=2, dp=4, rc=SEL, sp=True),
])
def test_megatron_configs_are_expressible_and_come_back(c):
    plan = plan_from_config(c)
    assert check_expressible(plan) is None
    assert megatron_config(plan) == c


def test_block_count_larger_than_a_chunk_recomputes_that_whole_chunk():
    # block 2 on chunks of 1 and 3 layers: the 1-layer chunk is fully recomputed, the other its first 2
    plan = plan_from_config(cfg(chunk_layers=(1, 3, 2, 2), vpp=2, rc=Recompute("full", "block", 2)))
    assert plan.stages[0].chunks[0].recompute == ["full", "full"]
    assert plan.stages[1].chunks[0].recompute == ["full"] * 4 + ["none"] * 2
    assert megatron_config(plan).recompute == Recompute("full", "block", 2)


def test_t5_block_recompute_counts_encoder_and_decoder_blocks_separately():
    plan = plan_from_config(cfg(model=T5, chunk_layers=(4,), pp=1, tp=1, dp=4, rc=Recompute("full", "block", 1)))
    # units: encoder layers (2 units each), then decoder layers (3 units each)
    assert plan.stages[0].recompute == ["full"] * 2 + ["none"] * 2 + ["full"] * 3 + ["none"] * 3


def test_selective_is_the_attention_core_only():
    plan = plan_from_config(cfg(model=T5, chunk_layers=(4,), pp=1, tp=1, dp=4, rc=SEL))
    kinds = [u.kind for u in T5.units]
    assert plan.stages[0].recompute == ["none" if k == "mlp" else "selective" for k in kinds]


def _set_rc(stage, rc):
    def fn(d):
        d["stages"][stage]["chunks"][0]["recompute"] = rc
    return fn


def _move_boundary(d):
    d["stages"][0]["chunks"][0]["end_unit"] = 7
    d["stages"][0]["chunks"][0]["recompute"] = ["none"] * 7
    d["stages"][1]["chunks"][0]["start_unit"] = 7
    d["stages"][1]["chunks"][0]["recompute"] = ["none"] * 9


def _reshape(stage, **kw):
    def fn(d):
        d["stages"][stage].update(kw)
    return fn


BASE = plan_from_config(cfg())
BAD = {
    "tp differs": (edited(BASE, _reshape(1, tp=1, dp=4)), "stages[1].tp (1) differs from stages[0].tp (2)"),
    "dp differs": (edited(BASE, _reshape(1, tp=4, dp=1)), "stages[1].tp (4)"),
    "sp differs": (edited(BASE, _reshape(1, sequence_parallel=True)), "stages[1].sequence_parallel"),
    "cut inside a layer": (edited(BASE, _move_boundary), "stages[1].start_unit (7) cuts layer 3 between its "
                           "attention and mlp units"),
    "attn_dropout": (edited(BASE, _set_rc(0, ["attn_dropout", "none"] * 4)), "stages[0].recompute[0] is attn_dropout"),
    "selective MLP": (edited(BASE, _set_rc(0, ["selective"] * 8)), "stages[0].recompute[1] is selective on an MLP"),
    "mixed layer": (edited(BASE, _set_rc(0, ["full", "none"] * 4)), "stages[0].recompute[0:2] (full, none) mixes"),
    "selective next to none": (edited(BASE, _set_rc(1, ["selective", "none"] * 2 + ["none"] * 4)),
                               "has layers with none recompute"),
    "full not leading": (edited(BASE, _set_rc(0, ["none"] * 2 + ["full"] * 2 + ["none"] * 4)),
                         "stages[0].recompute: its fully recomputed layers are not the leading ones"),
    "block counts differ": (edited(BASE, lambda d: (_set_rc(0, ["full"] * 2 + ["none"] * 6)(d),
                                                    _set_rc(1, ["full"] * 4 + ["none"] * 4)(d))),
                            "stages[1] recomputes its first 2 layers fully but stages[0] its first 1 of 4"),
    "param gather alone": (edited(BASE, lambda d: d["settings"].update(distributed_optimizer=True, overlap_param_gather=True)),
                           "overlap_param_gather is on but overlap_grad_reduce is off"),
    "t5 pipeline": (uniform_plan(T5, 2, 1, 2, 2, 8), "stages: 2 pipeline stages, but Megatron-LM's pretrain_t5.py"),
    "t5 depths": (uniform_plan(T5.model_copy(update={"num_decoder_layers": 1}), 1, 1, 2, 2, 8),
                  "model.num_decoder_layers (1) differs from num_layers (2)"),
    "rope base": (uniform_plan(load_model("llama3-8b", num_layers=2).model_copy(update={"rotary_base": 1e4 + 0.5}),
                               1, 1, 2, 2, 8), "model.rotary_base (10000.5) is not an integer"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_inexpressible_plans_are_refused_with_one_line(name):
    plan, needle = BAD[name]
    msg = check_expressible(plan)
    assert msg is not None and "\n" not in msg and needle in msg, msg
    assert msg.endswith("search with --target megatron-lm, or run the plan as it is with aceso train")


def _megatron_padded(vocab: int, divisor: int, tp: int) -> int:
    """megatron/training/tokenizer/tokenizer.py::_vocab_size_with_padding."""
    multiple = divisor * tp
    return -(-vocab // multiple) * multiple


@pytest.mark.parametrize("vocab,tp", [(50001, 4), (50257, 8), (50304, 3), (51200, 1)])
def test_exported_vocab_divisor_pads_as_the_plan_does(vocab, tp):
    model = load_model("gpt-1.3b", num_layers=3).model_copy(update={"num_attention_heads": 24, "hidden_size": 2304,
                                                                    "ffn_hidden_size": 9216, "vocab_size": vocab})
    plan = uniform_plan(model, 1, tp, 1, 1, 8)
    c = megatron_config(plan)
    assert _megatron_padded(vocab, c.vocab_divisor, tp) == model.padded_vocab_size


def test_vocab_padding_not_a_multiple_of_tp_is_refused():
    model = load_model("gpt-1.3b", num_layers=3).model_copy(update={"num_attention_heads": 24, "hidden_size": 2304,
                                                                    "ffn_hidden_size": 9216, "vocab_size": 50001})
    plan = uniform_plan(model, 1, 3, 1, 1, 8)      # padded 50048 is not a multiple of tp 3, nor is 128
    msg = check_expressible(plan)
    assert msg and msg.startswith("model.make_vocab_size_divisible_by (128)")


def test_interleaved_chunk_cut_names_the_chunk():
    plan = plan_from_config(cfg(chunk_layers=(2, 2, 2, 2), vpp=2))
    d = plan.model_dump()
    d["stages"][1]["chunks"][0]["end_unit"] = 9           # model chunk 1 ends inside layer 4, chunk 2 starts there
    d["stages"][1]["chunks"][0]["recompute"] = ["none"] * 5
    d["stages"][0]["chunks"][1]["start_unit"] = 9
    d["stages"][0]["chunks"][1]["recompute"] = ["none"] * 3
    msg = check_expressible(ParallelPlan.model_validate(d))
    assert msg and msg.startswith("stages[0].chunks[1].start_unit (9) cuts layer 4 between its attention and mlp")


@pytest.mark.parametrize("name", sorted(BAD))
def test_export_cli_refuses_each_kind_with_exit_2_one_line_and_writes_nothing(name, tmp_path, capsys):
    from search.cli import main
    plan, needle = BAD[name]
    src, out = tmp_path / "plan.json", tmp_path / "run.sh"
    src.write_text(plan.to_json())
    assert main(["export", str(src), "--to", "megatron-lm", "-o", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err and "--target megatron-lm" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]
