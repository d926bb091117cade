"""Parameters per rank: the planner's count equals what megatron-core 0.16.1 allocates for that rank.

Each configuration builds every pipeline rank's model chunks with megatron-core's own ``GPTModel`` / ``T5Model`` on
the meta device (``aceso_megatron.testing.meta_params``: the exported layout, ``vp_stage`` per chunk, groups that
only report their size). The parameters it allocates are summed per rank and compared with the cost model's
per-stage ``params`` (``CostModel.stage_cost``, memory breakdown / weight bytes), on 24 configurations: TP 1-8, PP 1-4, VPP 2-3, uneven layouts, CP, DP, the distributed optimizer on and off
(which must not change the count), tied and untied embeddings, GQA, explicit kv_channels, QK norms, SwiGLU, biases on
and off (and the QKV bias alone), learned and rotary positions, a padded vocabulary and T5.
"""

from __future__ import annotations

import warnings

import pytest

from search.spec.cluster import parse_cluster
from search.pricing import make_cost_model
from search.costmodel.memory import MB
from search.costmodel.types import Features
from search.spec.model import ModelSpec
from search.spec.training import TrainingSpec

warnings.filterwarnings("ignore", message=".*Transformer Engine.*")
pytest.importorskip("megatron.core")

from aceso_megatron.testing.meta_params import megatron_core_params, world_of_one  # noqa: E402


def _gpt(**kw) -> ModelSpec:
    base = dict(name="gpt", family="gpt", num_layers=8, hidden_size=256, num_attention_heads=8, ffn_hidden_size=1024,
                seq_length=512, vocab_size=1000, params_dtype="bf16")
    return ModelSpec(**{**base, **kw})


def _llama(**kw) -> ModelSpec:
    base = dict(name="llama", family="llama", num_layers=8, hidden_size=256, num_attention_heads=8,
                num_query_groups=2, ffn_hidden_size=704, seq_length=512, vocab_size=1000, activation="swiglu",
                normalization="rmsnorm", position_embedding="rope", tied_embeddings=False, add_bias_linear=False,
                params_dtype="bf16")
    return ModelSpec(**{**base, **kw})


T5 = ModelSpec(name="t5", family="t5", num_layers=4, num_decoder_layers=4, hidden_size=256, num_attention_heads=8,
               ffn_hidden_size=1024, seq_length=512, decoder_seq_length=128, vocab_size=1000, params_dtype="bf16")

# name -> (model, tp, pp, layers per model chunk in model order (None: even, one chunk per rank), cp, dp, dist-opt)
CONFIGS = {
    "gpt-tp1": (_gpt(), 1, 1, None, 1, 1, False),
    "gpt-tp2": (_gpt(), 2, 1, None, 1, 1, False),
    "gpt-tp4-dp2-distopt": (_gpt(), 4, 1, None, 1, 2, True),
    "gpt-tp8-pp2-tied": (_gpt(), 8, 2, None, 1, 1, False),
    "gpt-tp2-pp4": (_gpt(), 2, 4, None, 1, 1, True),
    "gpt-pp2-uneven": (_gpt(), 2, 2, (3, 5), 1, 2, False),
    "gpt-pp4-uneven": (_gpt(), 1, 4, (1, 3, 3, 1), 1, 1, False),
    "gpt-pp2-vpp2": (_gpt(), 2, 2, (2, 2, 2, 2), 1, 1, True),
    "gpt-pp2-vpp3-uneven": (_gpt(num_layers=9), 4, 2, (1, 2, 1, 2, 2, 1), 1, 1, False),
    "gpt-untied-pp2": (_gpt(tied_embeddings=False), 4, 2, None, 1, 1, False),
    "gpt-nobias": (_gpt(add_bias_linear=False), 4, 1, None, 1, 1, False),
    "gpt-qk-norm": (_gpt(megatron={"qk_layernorm": True}), 4, 2, None, 1, 1, False),
    "gpt-kv-channels": (_gpt(kv_channels=64), 2, 1, None, 1, 1, False),
    "gpt-padded-vocab-tp8": (_gpt(vocab_size=50257, make_vocab_size_divisible_by=1024), 8, 1, None, 1, 1, False),
    "gpt-swiglu-bias-rope": (_gpt(activation="swiglu", position_embedding="rope"), 2, 2, None, 1, 1, False),
    "gpt-cp2-dp2-distopt": (_gpt(), 2, 2, None, 2, 2, True),
    "llama-tp1": (_llama(), 1, 1, None, 1, 1, False),
    "llama-gqa-tp2": (_llama(), 2, 1, None, 1, 4, True),
    "llama-tp4-pp4": (_llama(), 4, 4, None, 1, 1, False),
    "llama-tied-pp2": (_llama(tied_embeddings=True), 2, 2, None, 1, 1, False),
    "llama-cp2-vpp2": (_llama(), 2, 2, (2, 2, 2, 2), 2, 1, True),
    "llama-qk-norm-tp2": (_llama(megatron={"qk_layernorm": True}), 2, 1, None, 1, 1, False),
    "llama-qkv-bias-tp2-pp2": (_llama(megatron={"add_qkv_bias": True}), 2, 2, None, 1, 1, False),   # Qwen2, GLM-4.5
    "t5-tp1": (T5, 1, 1, None, 1, 1, False),
    "t5-tp2": (T5, 2, 1, None, 1, 2, True),
}


@pytest.fixture(scope="module", autouse=True)
def one_rank():
    with world_of_one():
        yield


def planner_params(model: ModelSpec, tp: int, pp: int, layers, cp: int, dp: int, dist: bool) -> list[float]:
    """The cost model's parameters per rank of each stage (its memory breakdown's weight MB / weight bytes)."""
    chunks = tuple(layers) if layers else (model.num_layers // pp,) * pp
    vpp = len(chunks) // pp
    n = tp * cp * dp
    cm = make_cost_model(model, parse_cluster(f"{max(1, pp * n // 8)}x{min(8, pp * n)}-h100"),
                         TrainingSpec(global_batch_size=8 * dp, micro_batch_sizes=[dp], precision="bf16"))
    starts, bounds = model.layer_starts, [0]
    for c in chunks:
        bounds.append(bounds[-1] + c)
    spans = [(starts[bounds[k]], starts[bounds[k + 1]]) for k in range(len(chunks))]
    if model.is_t5:         # one stage: the encoder and decoder units
        spans = [(0, model.num_units)]
    out = []
    for s in range(pp):
        mine = tuple(spans[j * pp + s] for j in range(vpp))
        units = sum(e - a for a, e in mine)
        cost = cm.stage_cost(s, pp, s * n, mine[0][0], mine[0][1], tp, dp, [0] * units, dp, cp=cp,
                             spans=mine if vpp > 1 else None, features=Features(distributed_optimizer=dist))
        out.append(cost.memory_breakdown["params"] * MB / 2.0)
    return out


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_planner_params_per_rank_equal_megatron_core_allocation(name):
    model, tp, pp, layers, cp, dp, dist = CONFIGS[name]
    want = list(megatron_core_params(model, tp, pp, layers).values())
    got = planner_params(model, tp, pp, layers, cp, dp, dist)
    assert got == pytest.approx(want, rel=1e-12, abs=0.5), name


def test_configurations_cover_the_brief():
    """At least 20 configurations, and each axis the planner distinguishes is exercised."""
    cfgs = CONFIGS.values()
    assert len(CONFIGS) >= 20
    assert {tp for _, tp, *_ in cfgs} >= {1, 2, 4, 8} and {pp for _, _, pp, *_ in cfgs} >= {1, 2, 4}
    assert any(c[3] and len(c[3]) > c[2] for c in cfgs) and any(c[3] and len(set(c[3])) > 1 for c in cfgs)
    assert {c[6] for c in cfgs} == {True, False} and any(c[4] > 1 for c in cfgs) and any(c[5] > 1 for c in cfgs)
    models = [c[0] for c in cfgs]
    assert {m.tied_embeddings for m in models} == {True, False} and any(m.is_t5 for m in models)
    assert any(m.groups < m.num_attention_heads for m in models) and any(m.qk_norm_params() for m in models)
