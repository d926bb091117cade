"""Gated DeltaNet layers ('G', search/layers/gdn.py): FLOPs and memory by hand, the kind in a hybrid model and a
plan, the Megatron-LM export and import of its linear_* flags, and the runtime's one-line refusal of it under CP. megatron-core's
own layer (parameters, tp / cp asserts) is the reference in tests/runtime/test_gdn_layer.py, Megatron-LM's parsers
(core_v0.17.1 to core_v0.19.0) in tests/runtime/test_hybrid_pattern_oracle.py (case gdn-pp2-vpp2)."""

import pytest

from search import layers
from search.layers import gdn
from search.layers.gdn import GDNSpec
from search.megatron import NotExpressible
from search.megatron.hybrid_pattern import hybrid_form, write_script
from search.megatron.importer import read_megatron
from search.megatron.versions import release
from search.pricing.models import make_cost_model
from search.spec.cluster import parse_cluster
from search.spec.model import ModelSpec
from search.spec.plan import ParallelPlan, StageSpec
from search.spec.training import TrainingSpec
from search.targets.capabilities import model_refusal
from tests.hybrid_plans import GDN8, cut_plan

QWEN = GDNSpec()     # Qwen3-Next-80B-A3B's GDN (config.json: 16 key / 32 value heads of 128, conv 4), h 2048


def _model(pattern="G-*-", spec=QWEN, **kw):
    return ModelSpec(**{"name": "g", "family": "gpt", "num_layers": len(pattern.split("/")[0]), "hidden_size": 2048,
                        "num_attention_heads": 16, "ffn_hidden_size": 4096, "seq_length": 4096, "vocab_size": 32000,
                        "add_bias_linear": False, "normalization": "rmsnorm", "gdn": spec,
                        "hybrid_layer_pattern": pattern, **kw})


def test_flops_by_hand():
    """Projections and conv as Megatron-LM 0.19's gdn_layer_flops counts them (training.py: in_proj h -> 2 qk +
    2 v + 2 H_v, conv over 2 qk + v, out_proj v -> h); the rule by fla's chunk algorithm over chunks of 64."""
    s, h = 100, 2048                       # 2 chunks, the second padded
    f = gdn.forward_flops(QWEN, h, s)
    assert f.in_proj == 2 * s * h * (2 * 2048 + 2 * 4096 + 2 * 32)
    assert f.conv1d == 2 * s * 4 * (2 * 2048 + 4096)
    assert f.out_proj == 2 * s * 4096 * h
    per_chunk_head = 3 * 64 * 64 * 128 + 2 * 64 * 64 * 128 + 3 * 64 * 128 * 128 + 64 ** 3 / 3
    assert f.scan == pytest.approx(2 * 32 * 2 * per_chunk_head, rel=1e-12)
    # Megatron-LM's recurrent count for the rule: 4 H_v d_v^2 per token, below the chunk form's
    assert 2 * s * 32 * 4 * 128 ** 2 < f.scan
    m = _model()
    assert m.forward_flops_per_sample() > 0 and layers.get("gdn").flops(m, s) == f.total


def test_scan_matmuls_are_the_macs():
    macs = sum(b * x * y * z for b, x, y, z in gdn.scan_bmms(QWEN, 1, 1000, 1))
    assert macs == pytest.approx(gdn.scan_macs(QWEN, 1000), rel=1e-12)


def test_memory_by_hand():
    """Per token at tp 2 with SP, bf16: the norm input h / 2, in_proj's output, the conv output, q and k over 16
    value heads, g (fp32) and beta, the 64-wide inverse, the rule output + fp32 rstd, out_proj's input."""
    a = gdn.act_bytes(QWEN, 2048, 2, tp=2, sp=True)
    want = 2 * 1024 + 2 * 12352 / 2 + 2 * 8192 / 2 + 2 * 2 * 16 * 128 + 6 * 16 + 2 * 64 * 16 + (2 * 2048 + 4 * 16) \
        + 2 * 2048
    assert a.total == want
    assert gdn.scan_state_bytes(QWEN, 4096, 2, tp=2) == 64 * 16 * 128 * 128 * 2
    assert gdn.inference_state_bytes(QWEN, 2, tp=1) == 8192 * 4 * 2 + 32 * 128 * 128 * 4


def test_a_gdn_unit_is_priced_and_kept_as_its_formulas():
    m = _model()
    assert [u.kind for u in m.units] == ["gdn", "mlp", "attention", "mlp"] and layers.symbols(m) == "G-*-"
    cm = make_cost_model(m, parse_cluster("1x8-h100"), TrainingSpec(global_batch_size=8))
    t = cm.unit_table(1, 2)
    assert t.weight_params[0] == gdn.params(QWEN, 2048, 2).total == 2048 * 12352 // 2 + 4096 * 4 + 32 + 128 + \
        2048 * 2048 + 2048
    assert t.act_mb[0, 0] * 2**20 == pytest.approx(4096 * gdn.act_bytes(QWEN, 2048, 2, tp=2).total)
    assert t.act_mb[0, 2] * 2**20 == 2 * 4096 * 2048
    assert t.fwd_ms[0] > t.fwd_ms[1] > 0 and t.bwd_ms[0] > t.fwd_ms[0]
    assert m.unit_params("gdn") == gdn.params(QWEN, 2048).total


def test_launches_are_the_kinds():
    from search.costmodel.host import part_launches
    assert part_launches(_model(), "gdn", False, 0) == {"gdn": 23}


@pytest.mark.parametrize("fields, msg", [
    ({"gdn": None}, "gdn: give it exactly when hybrid_layer_pattern has 'G' layers (add it)"),
    ({"hybrid_layer_pattern": "M-*-"}, "mamba: give it"),
    ({"hybrid_layer_pattern": None}, "gdn: a GDN block needs hybrid_layer_pattern"),
    ({"hybrid_layer_pattern": "D-G-"}, "'D' (ds_attention) layers are not supported"),
])
def test_the_model_rules(fields, msg):
    with pytest.raises(ValueError, match=msg.replace("(", r"\(").replace(")", r"\)")):
        _model(**fields)


def test_tp_and_cp_must_split_the_heads():
    m = _model(spec=GDNSpec(linear_num_key_heads=2, linear_num_value_heads=4))
    with pytest.raises(ValueError, match=r"stages\[0\] \(tp 4, cp 1\): gdn.linear_num_key_heads \(2\) must be a "
                                         r"multiple of tensor_model_parallel_size x context_parallel_size \(4 x 1\)"):
        ParallelPlan(model=m, micro_batch_size=1, global_batch_size=4,
                     stages=[StageSpec(num_gpus=4, tp=4, dp=1, start_unit=0, end_unit=4, recompute=["none"] * 4)])
    assert layers.kind.shape_refusal(m, 2, 1) is None and layers.kind.shape_refusal(m, 1, 4) is not None


def test_export_writes_and_import_reads_the_linear_flags():
    plan = cut_plan(GDN8, [0, 3, 8], 2, tp=2)
    form = hybrid_form(plan, release("0.19"))
    text = write_script(plan, form, "p.json")
    assert "--linear-key-head-dim 64" in text and "--hybrid-layer-pattern 'G-G|*-G-G'" in text
    imp = read_megatron(text, version="0.19")
    assert imp.plan.model.gdn == GDN8.gdn and imp.plan.model.hybrid_layer_pattern == "G-G*-G-G"
    assert imp.plan.stages == plan.stages and imp.ignored == []


def test_megatron_lm_0_16_refuses_in_one_line():
    with pytest.raises(NotExpressible) as e:
        hybrid_form(cut_plan(GDN8, [0, 3, 8], 2), release("0.16"))
    assert "core_v0.16.1" in str(e.value) and "\n" not in str(e.value)


def test_the_runtime_builds_gdn_but_refuses_it_under_cp_in_one_line():
    """GDN layers run on the aceso runtime (fla, or on CPU patches/gdn_cpu.py: tests/distributed/
    test_hybrid_gdn_plans.py); context parallelism over them is refused in one line, before any process group."""
    from search.targets.capabilities import plan_refusal

    assert model_refusal("aceso", GDN8) is None and model_refusal("megatron-lm", GDN8) is None
    plan = cut_plan(GDN8, [0, 3, 8], 2)
    assert plan_refusal(plan, "aceso", "cpu") is None
    raw = plan.model_dump()
    raw["stages"][1].update(cp=2, num_gpus=2)
    why = plan_refusal(ParallelPlan.model_validate(raw), "aceso", "cuda")
    assert why.startswith("stages[1].cp (2): the aceso runtime does not run Gated DeltaNet") and "\n" not in why
