"""Model chunks without a transformer layer: model chunk 0 holding only the embedding, the last holding only the
loss (``holds_only``), as megatron-core 0.16.1's ``--pipeline-model-parallel-layout`` allows (``E|...``, ``...|L``).

Schema (explicit marker, checked position, older plans unchanged), Megatron-LM layout import / export both ways,
the one split rule (``distribution``) where the embedding / loss takes a chunk's only layer, and the cost model:
such a chunk costs its embedding / logits + loss, and a layout moving the embedding / loss into chunks of their own
does the same total work as one that keeps them with layers.
"""

from __future__ import annotations

import json

import pytest

from search.cli import main
from search.spec.cluster import parse_cluster
from search.pricing import make_cost_model
from search.io.errors import AcesoError
from search.megatron import megatron_config
from search.megatron.importer import read_megatron
from search.megatron.layout import distribution, format_layout, layout_chunk_layers, split_for
from search.megatron.names import megatron_lm_args
from search.spec.plan import parse_plan, uniform_plan
from search.spec.presets import load_model
from search.spec.training import TrainingSpec
from tests.unit.test_plan_validation import validate_refuses

# 24 layers, 48 units; bf16: the runtime trains no fp16 on H100s (runtime_rules.fp16_on_gpu)
MODEL = load_model("gpt-350m").model_copy(update={"params_dtype": "bf16"})
N = MODEL.num_units


def chunk(a, b, only=None):
    d = {"start_unit": a, "end_unit": b, "recompute": ["none"] * (b - a)}
    return {**d, "holds_only": only} if only else d


def raw(*stages, model=MODEL, gbs=64):
    return {"model": model.model_dump(), "cluster": parse_cluster("1x8-h100").model_dump(), "micro_batch_size": 8,
            "global_batch_size": gbs, "stages": [{"num_gpus": 4, "tp": 1, "dp": 4, "chunks": list(c)}
                                                 for c in stages]}


def e_t_t_l():
    """pp 2 x vp 2, 'E|t*12|t*12|L': stage 0 holds model chunks 0 (embedding) and 2, stage 1 chunks 1 and 3 (loss)."""
    return raw([chunk(0, 0, "embedding"), chunk(24, N)], [chunk(0, 24), chunk(N, N, "loss")])


def test_end_only_chunks_parse_and_round_trip(tmp_path):
    p = parse_plan(e_t_t_l())
    order = [ch for _, _, ch in p.chunks_in_order()]
    assert [(c.num_units, c.holds_only) for c in order] == [(0, "embedding"), (24, None), (24, None), (0, "loss")]
    written = json.loads(p.to_json())
    assert written["stages"][0]["chunks"][0]["holds_only"] == "embedding"
    assert "holds_only" not in written["stages"][0]["chunks"][1]          # a chunk with units: as before
    path = tmp_path / "p.json"
    path.write_text(p.to_json())
    assert main(["validate", str(path)]) == 0


def test_plans_without_the_marker_are_written_as_before():
    p = uniform_plan(MODEL, num_stages=2, tp=1, dp=4, micro_batch_size=8, global_batch_size=64, num_virtual_stages=2)
    assert "holds_only" not in p.to_json()


def _set_chunk(s, j, **kw):
    def f(d):
        d["stages"][s]["chunks"][j].update(kw)
    return f


def _drop_marker(s, j):
    def f(d):
        d["stages"][s]["chunks"][j].pop("holds_only")
    return f


BAD = [
    (_drop_marker(0, 0), "span [0, 0) is empty; end_unit must exceed start_unit"),
    (_set_chunk(0, 0, holds_only="loss"), "this is model chunk 0, but only model chunk 3 can hold only the loss"),
    (_set_chunk(1, 1, holds_only="embedding"), "only model chunk 0 can hold only the embedding"),
    (_set_chunk(1, 0, holds_only="loss"), "holds_only is 'loss' but the span [0, 24) holds units"),
    (_set_chunk(0, 0, holds_only="head"), "stages[0].chunks[0].holds_only"),
    (_set_chunk(0, 1, start_unit=24, end_unit=24, recompute=[], holds_only="loss"), "model chunk 2"),
]


@pytest.mark.parametrize("case", range(len(BAD)))
def test_bad_end_only_chunks_exit_2_with_one_line(case, tmp_path, capsys):
    mut, needle = BAD[case]
    d = e_t_t_l()
    mut(d)
    validate_refuses(d, tmp_path, capsys, needle)


def test_t5_refuses_a_unit_less_chunk():
    t5 = load_model("t5-6b")
    n = t5.num_units
    with pytest.raises(AcesoError, match="does not support encoder-decoder"):
        parse_plan(raw([chunk(0, 0, "embedding")], [chunk(0, n)], model=t5))


def test_a_loss_only_chunk_after_the_mtp_block_is_refused(tmp_path, capsys):
    """The MTP block runs with the loss (megatron-core's standalone MTP, '...|m|L', is not a plan)."""
    m = load_model("deepseek-v3").model_copy(update={"num_layers": 4})
    n = m.num_units
    d = raw([chunk(0, n)], [chunk(n, n, "loss")], model=m)
    d.pop("cluster")
    validate_refuses(d, tmp_path, capsys, "standalone MTP")


def test_mtp_units_split_from_the_last_chunk_are_refused(tmp_path, capsys):
    """megatron-core builds the whole MTP block on the last model chunk: a cut between the MTP units is refused in
    one line; the MTP units in the last chunk (with or without the last layer) validate."""
    m = load_model("deepseek-v3").model_copy(update={"num_layers": 4, "mtp_num_layers": 2})
    n = m.num_units
    assert [u.kind for u in m.units[-2:]] == ["mtp", "mtp"]
    for cut in (n - 4, n - 2):          # the last layer and the MTP block, or the MTP block alone ('...|mmL')
        parse_plan({**raw([chunk(0, cut)], [chunk(cut, n)], model=m), "cluster": None})
    d = raw([chunk(0, n - 1)], [chunk(n - 1, n)], model=m)
    d.pop("cluster")
    validate_refuses(d, tmp_path, capsys, "whole MTP block on the last model chunk")


# ----- Megatron-LM layouts ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("text,pp,chunks,vpp", [
    ("E|t*12|t*12|L", 2, (0, 12, 12, 0), 2),
    ("E|t*24L", 2, (0, 24), 1),
    ("Et*24|L", 2, (24, 0), 1),
    ("Et|(tt|)*11t|L", 2, (1,) + (2,) * 11 + (1, 0), 7),   # Bridge's DeepSeek form: 1 + 22 + 1 = 24 layers
])
def test_layouts_with_end_only_chunks_read_and_write_back(text, pp, chunks, vpp):
    assert layout_chunk_layers(text, pp) == (chunks, vpp)
    assert split_for(chunks, pp, vpp).layout == format_layout(chunks)
    assert layout_chunk_layers(format_layout(chunks), pp) == (chunks, vpp)


@pytest.mark.parametrize("text,needle", [
    ("Et*12||t*12|L", "model chunk 1 holds nothing"),
    ("EL", "the only model chunk holds no transformer layer"),
])
def test_empty_middle_or_only_chunk_refused(text, needle):
    with pytest.raises(AcesoError, match=needle):
        layout_chunk_layers(text, 1 if "|" not in text else 2)


def test_embedding_and_loss_split_may_leave_an_end_chunk_only_the_embedding_or_loss():
    # (3 layers + embedding + loss) / pp 5 = 1 each: megatron-core's get_num_layers_to_build gives chunk 0 and the
    # last 1 - 1 = 0 layers (it asserts only < 0)
    assert distribution(3, 5, embedding_counts=True, loss_counts=True) == (0, 1, 1, 1, 0)
    assert distribution(4, 5, embedding_counts=True) == (0, 1, 1, 1, 1)
    assert distribution(2, 2, first=2, last=0) == (2, 0)            # --decoder-last-pipeline-num-layers 0
    with pytest.raises(AcesoError, match="model chunk 1 would hold nothing"):
        distribution(2, 2, 2, first=2, last=0)      # vpp 2: rank 0's chunks 1 + 1, rank 1's 0 + 0: (1, 0, 1, 0)


BASE = ("--num-layers 4 --hidden-size 256 --num-attention-heads 8 --seq-length 128 --max-position-embeddings 128 "
        "--micro-batch-size 1 --global-batch-size 8 --tokenizer-type NullTokenizer --vocab-size 999 ")


@pytest.mark.parametrize("layout,pp,only", [
    ("E|t*2|t*2|L", 2, ("embedding", None, None, "loss")),
    ("Et*2|t*2|L", 3, (None, None, "loss")),
    ("E|t*4L", 2, ("embedding", None)),
])
def test_import_export_round_trip(layout, pp, only):
    imp = read_megatron(BASE + f"--pipeline-model-parallel-size {pp} --pipeline-model-parallel-layout '{layout}'",
                        world_size=pp)
    plan = imp.plan
    assert tuple(ch.holds_only for _, _, ch in plan.chunks_in_order()) == only
    args = megatron_lm_args(megatron_config(plan))
    flat = [a for v in args.values() for a in v] if isinstance(args, dict) else list(args)
    assert flat[flat.index("--pipeline-model-parallel-layout") + 1] == layout
    again = read_megatron(BASE + f"--pipeline-model-parallel-size {pp} --pipeline-model-parallel-layout "
                          f"'{format_layout(megatron_config(plan).chunk_layers)}'", world_size=pp).plan
    assert again == plan


# ----- cost model --------------------------------------------------------------------------------------------------
def _cm():
    return make_cost_model(MODEL, parse_cluster("1x8-h100"), TrainingSpec(global_batch_size=64,
                                                                          micro_batch_sizes=[8]))


def test_an_end_only_chunk_costs_its_embedding_or_head():
    cm = _cm()
    p = parse_plan(e_t_t_l())
    s0, s1 = cm.stage_costs(p)
    t = cm.unit_table(8 / 4, 1)
    # chunk_parts: (fwd, fwd p2p, recompute, bwd, bwd p2p) per chunk
    assert s0.chunk_parts[0][0] == pytest.approx(t.embed_fwd_ms) and s0.chunk_parts[0][3] == pytest.approx(
        t.embed_bwd_ms)
    assert s1.chunk_parts[1][0] == pytest.approx(t.head_fwd_ms) and s1.chunk_parts[1][3] == pytest.approx(
        t.head_bwd_ms)
    assert t.embed_fwd_ms > 0 and t.head_fwd_ms > 0


def test_moving_embedding_and_loss_to_chunks_of_their_own_keeps_the_total_work():
    """'E|t*12|t*12|L' and 'Et*12|t*12L'-like (the same 24-unit spans with the embedding and head inside) do the
    same forward / backward work and hold the same parameters; only where it runs differs."""
    cm = _cm()
    own = cm.stage_costs(parse_plan(e_t_t_l()))
    kept = cm.stage_costs(parse_plan(raw([chunk(0, 24)], [chunk(24, N)])))
    assert sum(s.fwd_ms for s in own) == pytest.approx(sum(s.fwd_ms for s in kept))
    assert sum(s.bwd_ms for s in own) == pytest.approx(sum(s.bwd_ms for s in kept))
    params = [sum(s.memory_breakdown["params"] for s in c) for c in (own, kept)]
    assert params[0] == pytest.approx(params[1])
