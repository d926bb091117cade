"""GPT-OSS's layer fields (search.layers.layer_variants): parameter counts against OpenAI's published sizes and a layer
written out by hand, the windowed layers against megatron-core's rule, sliding-window FLOPs in ModelSpec and in the
analytic flash core by hand, the HF import, and the one-line refusals.

megatron-core's own GPTModel counts the same models, and builds the windowed layers, in
tests/runtime/test_moe_params.py."""

import json
from pathlib import Path

import pydantic
import pytest

from search.layers import layer_variants as lv
from search.cli.import_hf import hf_to_spec
from search.spec.cluster import parse_cluster
from search.pricing import make_cost_model
from search.costmodel.kernels import GPU_EFFICIENCY
from search.spec.model import ModelSpec
from search.layers.moe_params import counts, layer_mlp_params
from search.spec.presets import load_model
from search.spec.training import TrainingSpec
from tests.unit.test_moe import plain_rope

HF = json.loads((Path(__file__).parent / "data" / "hf_moe_configs.json").read_text())

# OpenAI, "gpt-oss-120b & gpt-oss-20b Model Card" (2025), table 1: total and active parameters in billions. Active
# counts the unembedding but not the embedding (a lookup), so the input embedding is subtracted from our active.
PUBLISHED = {"gpt-oss-120b": (116.83, 5.13), "gpt-oss-20b": (20.91, 3.61)}

DENSE = dict(name="w", family="llama", num_layers=4, hidden_size=1024, num_attention_heads=16, ffn_hidden_size=2048,
             seq_length=4096, vocab_size=1024, params_dtype="bf16", activation="swiglu", normalization="rmsnorm",
             position_embedding="rope", add_bias_linear=False)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_total_and_active(name):
    total, active = PUBLISHED[name]
    m = load_model(name)
    c = counts(m)
    assert c.total / 1e9 == pytest.approx(total, abs=0.006)
    assert (c.active - m.padded_vocab_size * m.hidden_size) / 1e9 == pytest.approx(active, abs=0.006)


def test_gpt_oss_layer_by_hand():
    """One GPT-OSS-120B layer: QKV and output projection with biases (head_dim 64, not 2880 / 64), the 64 softmax
    offsets, RMSNorm, router with bias, 128 quick-GEGLU experts with biases."""
    m = load_model("gpt-oss-120b")
    h, q, kv, heads, E, f = 2880, 64 * 64, 8 * 64, 64, 128, 2880
    attention = h * (q + 2 * kv) + (q + 2 * kv) + q * h + h + heads + h
    assert m.unit_params("attention") == attention
    expert = h * 2 * f + 2 * f + f * h + h
    total, active = layer_mlp_params(m, 0)
    assert total == h + E * h + E + E * expert and active == h + E * h + E + 4 * expert
    assert counts(m).total == 36 * (attention + total) + 2 * 201088 * h + h


def test_window_layers_follow_megatron_rule():
    """megatron-core's is_layer_window_attention, 1-based layer_number: N windows every layer but each N-th."""
    def pattern(**kw):
        m = ModelSpec(**{**DENSE, "num_layers": 6, "window_size": [127, 0], **kw})
        return [lv.is_window_layer(m, i) for i in range(6)]
    assert pattern() == [True] * 6
    assert pattern(window_attn_skip_freq=2) == [True, False] * 3
    assert pattern(window_attn_skip_freq=3) == [True, True, False] * 2
    assert pattern(window_attn_skip_freq=[0, 1, 1, 0, 0, 1]) == [False, True, True, False, False, True]
    assert [lv.is_window_layer(load_model("gpt-oss-20b"), i) for i in range(4)] == [True, False, True, False]


def test_window_keys():
    m = ModelSpec(**DENSE, window_size=[127, 0], window_attn_skip_freq=2)
    assert lv.window_keys(m, 0, 4096) == 128 and lv.window_keys(m, 1, 4096) == 4096
    assert lv.window_keys(m, 0, 100) == 100
    assert lv.window_keys(ModelSpec(**DENSE, window_size=[-1, 3]), 0, 4096) == 4096


def test_model_flops_use_the_window_by_hand():
    """Two of four layers windowed (128 keys): each scores s x 128 instead of s x s, 4 s k q FLOPs per sample."""
    full = ModelSpec(**DENSE)
    win = ModelSpec(**DENSE, window_size=[127, 0], window_attn_skip_freq=2)
    s, q = 4096, 1024
    assert full.forward_flops_per_sample() - win.forward_flops_per_sample() == 2 * 4.0 * s * (s - 128) * q
    assert win.num_parameters == full.num_parameters


def test_analytic_flash_core_uses_the_window_by_hand():
    """H100, flat kernels, bf16, b=1, s=4096: the windowed layer's flash core is 4 s 128 b q FLOPs, the full causal
    layer's half of 4 s^2 b q; everything else about the two attention units is the same."""
    m = ModelSpec(**DENSE, window_size=[127, 0], window_attn_skip_freq=2)
    c = parse_cluster("1x1-h100")
    t = make_cost_model(m, c, TrainingSpec(global_batch_size=4, precision="bf16"), kernels="flat").unit_table(1, 1)
    s, q, eff = 4096, 1024, GPU_EFFICIENCY["h100"]
    saved = 0.5 * 4 * s * s * q - 4 * s * 128 * q
    rate = c.gpu.peak_tflops_bf16 * 1e9                       # FLOP per ms
    assert t.fwd_ms[2] - t.fwd_ms[0] == pytest.approx(saved / (rate * eff.flash_fwd), rel=1e-9)
    assert t.bwd_ms[2] - t.bwd_ms[0] == pytest.approx(2.5 * saved / (rate * eff.flash_bwd), rel=1e-9)
    assert t.fwd_ms[4] == t.fwd_ms[0] and t.fwd_ms[6] == t.fwd_ms[2]        # layers 2, 3 as 0, 1
    assert list(t.act_mb[0]) == list(t.act_mb[2])                           # flash keeps no score matrix


def test_unfused_core_scores_everything():
    """megatron-core's local attention scores the whole s x s matrix and masks: no saving without flash."""
    m = ModelSpec(**DENSE, window_size=[127, 0], window_attn_skip_freq=2)
    t = make_cost_model(m, parse_cluster("1x1-h100"), TrainingSpec(global_batch_size=4, precision="bf16",
                                                                     attention="unfused")).unit_table(1, 1)
    assert t.fwd_ms[0] == t.fwd_ms[2] and list(t.act_mb[0]) == list(t.act_mb[2])


@pytest.mark.parametrize("name", ["gpt-oss-120b", "gpt-oss-20b"])
def test_hf_import_is_the_preset(name):
    cfg = plain_rope(HF[name])
    spec = hf_to_spec(cfg, source=name, seq_length=4096)
    preset = load_model(name)
    assert spec.model_dump(exclude={"name", "nominal_params_b"}) == \
        preset.model_dump(exclude={"name", "nominal_params_b"})
    assert spec.window_size == [127, 0] and spec.window_attn_skip_freq == 2   # HF window 128 keys, the query's own


def test_hf_layer_types():
    cfg = plain_rope(HF["gpt-oss-20b"])
    four = {**cfg, "num_hidden_layers": 4}
    assert hf_to_spec({**four, "layer_types": ["sliding_attention"] * 4}, "g").window_attn_skip_freq is None
    odd = ["full_attention", "sliding_attention", "sliding_attention", "full_attention"]
    assert hf_to_spec({**four, "layer_types": odd}, "g").window_attn_skip_freq == [0, 1, 1, 0]
    assert hf_to_spec({k: v for k, v in four.items() if k != "layer_types"}, "g").window_attn_skip_freq == 2


@pytest.mark.parametrize("extra, match", [
    ({"window_attn_skip_freq": 2}, "window_attn_skip_freq needs window_size"),
    ({"window_size": [127, 0], "window_attn_skip_freq": [1, 0]}, "lists 2 layers but num_layers is 4"),
    ({"window_size": [127, 0], "window_attn_skip_freq": 0}, "must be at least 1"),
    ({"window_size": [127]}, r"give \[left, right\]"),
    ({"window_size": [-1, 0]}, "is no window"),
    ({"activation_func_clamp_value": 7.0}, "activation quick_geglu only"),
    ({"activation": "gelu", "glu_linear_offset": 1.0}, "gated MLPs"),
    ({"softmax_type": "sink"}, "softmax_type"),
    ({"megatron": {"window_size": [127, 0]}}, "megatron.window_size: set by aceso, not by the megatron block; use "
                                              "window_size"),
])
def test_bad_fields_are_one_line(extra, match):
    with pytest.raises(pydantic.ValidationError, match=match):
        ModelSpec.model_validate({**DENSE, **extra})


def test_dense_specs_unchanged():
    m = load_model("llama3-8b")
    dumped = m.model_dump(exclude_none=True)
    assert not {"window_size", "window_attn_skip_freq", "softmax_type", "glu_linear_offset",
                "activation_func_clamp_value"} & set(dumped)
    assert m.unit_params("attention") == ModelSpec(**{**m.model_dump(), "softmax_type": "vanilla"}) \
        .unit_params("attention")


PUBLISHED_FILE = Path(__file__).resolve().parents[2].parent / "shared" / "published" / \
    "megatron-bridge-25.09-25.11.json"


@pytest.mark.skipif(not PUBLISHED_FILE.is_file(), reason="../shared/published is absent (shared reference data)")
def test_published_gpt_oss_flags_read_as_the_preset():
    """The GPT-OSS-120B flags of the published Megatron-Bridge rows (without --num-experts: MoE flags are read
    elsewhere) give the preset's layer fields; their window is Megatron-LM's example's 128,0 (129 keys) where the
    HF config's 128 keys are [127, 0] (model_specs/presets/SOURCES-moe.md)."""
    from search.megatron.cmdline import parse_flags
    from search.megatron.model_args import model_from_flags
    from search.megatron.versions import release

    flags = json.loads(PUBLISHED_FILE.read_text())["architectures"]["gpt-oss-120b"]["flags"]
    i = flags.index("--num-experts")
    f = parse_flags(flags[:i] + flags[i + 2:] + ["--seq-length", "4096", "--bf16", "--tokenizer-type",
                                                 "NullTokenizer", "--vocab-size", "201087"],
                    release("core_v0.16.1"))        # the rows' args are core_v0.16.1 lines (+ EOD: 201088)
    m, _ = model_from_flags(f, 1, False, [])
    preset = load_model("gpt-oss-120b")
    skip = {"name", "nominal_params_b", "moe", "window_size"}
    assert m.model_dump(exclude=skip) == preset.model_dump(exclude=skip)
    assert m.window_size == [128, 0] and preset.window_size == [127, 0]


@pytest.mark.parametrize("text, want", [("2", 2), ("[1,0]*2", [1, 0, 1, 0]), ("([1]*2+[0])*2", [1, 1, 0, 1, 1, 0])])
def test_skip_freq_flag_patterns(text, want):
    from search.megatron.layer_variant_flags import _pattern
    assert _pattern(text) == want


@pytest.mark.parametrize("text", ["[2,0]", "__import__('os')", "[1]*10**9", "[1]*100000000", "x"])
def test_skip_freq_flag_refused_in_one_line(text):
    from search.io.errors import AcesoError
    from search.megatron.layer_variant_flags import _pattern
    with pytest.raises(AcesoError, match="--window-attn-skip-freq"):
        _pattern(text)


def test_softmax_offset_keeps_cp_at_one():
    """transformer-engine runs a softmax offset under context parallelism only over a2a (not priced): the search
    space has cp 1 only, and a plan with cp 2 is refused by the one pre-flight in one line, for every target (for
    the aceso runtime too, which builds the offset: tests/runtime/test_gpt_oss_runtime.py)."""
    from search.io.errors import AcesoError
    from search.spec.plan import uniform_plan
    from search.planner.space import Space
    from search.targets.preflight import planner_checks

    m = ModelSpec(**{**DENSE, "seq_length": 32768}, softmax_type="learnable")
    c = parse_cluster("1x8-h100")
    training = TrainingSpec(global_batch_size=8, precision="bf16", context_parallel_sizes=[1, 2, 4])
    priced = frozenset({"context_parallel"})
    assert Space.of(m, c, training, priced=priced).cps == (1,)
    assert Space.of(m.model_copy(update={"softmax_type": None}), c, training, priced=priced).cps == (1, 2, 4)
    for target in ("megatron-lm", "aceso"):
        with pytest.raises(AcesoError, match=r"stages\[0\].cp \(2\): transformer-engine runs softmax_type learnable"):
            planner_checks(uniform_plan(m, 1, 1, 4, 4, 8, cluster=c, cp=2), "cuda", target)
    planner_checks(uniform_plan(m, 1, 2, 4, 4, 16, cluster=c), "cuda")    # cp 1: the runtime runs it
    planner_checks(uniform_plan(m.model_copy(update={"softmax_type": None}), 1, 1, 4, 4, 8, cluster=c, cp=2), "cuda")
