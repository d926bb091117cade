"""The layer-kind registry (search.layers): megatron-core's hybrid vocabulary, the model as a sequence of kinds, and
a new kind added in one place (registered here) counted, priced and planned end to end against hand computations."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from search import layers
from search.spec.cluster import parse_cluster
from search.costmodel import LEGACY_V1
from search.pricing import make_cost_model
from search.layers import mamba
from search.layers.hybrid import parse_pattern
from search.layers.mamba import Mamba2Spec
from search.layers.kind import LayerKind, Row, UnitCost
from search.spec.model import ModelSpec, Unit
from search.spec.plan import ParallelPlan, StageSpec, recompute_allowed
from search.spec.presets import load_model
from search.spec.training import TrainingSpec


def _megatron_source(*candidates: str) -> str | None:
    """The text of the first of megatron-core's modules ``candidates`` that the installed version has (read, not
    imported: this test runs without torch)."""
    spec = importlib.util.find_spec("megatron")
    roots = [Path(p) for p in (spec.submodule_search_locations or [])] if spec else []
    for rel in candidates:
        for root in roots:
            if (root / rel).is_file():
                return (root / rel).read_text()
    return None


MEGATRON_NAMES = {"ATTENTION": "attention", "MLP": "mlp", "MOE": "moe", "MLA": "MLA"}


def test_builtin_symbols_and_slots_are_megatron_cores():
    """Each built-in kind's symbol is the one megatron-core's ``Symbols`` gives its layer (0.19:
    models/hybrid; 0.16-0.18: ssm/mamba_hybrid_layer_allocation), its slot a ``HybridStackSubmodules`` field."""
    text = _megatron_source("core/models/hybrid/hybrid_layer_allocation.py",
                            "core/ssm/mamba_hybrid_layer_allocation.py")
    if text is None:
        pytest.skip("megatron-core is not installed: its Symbols cannot be read")
    symbols = dict(re.findall(r"^\s+([A-Z_]+) = [\"'](.)[\"']", text.split("class Symbols")[1], re.M))
    checked = 0
    for const, name in MEGATRON_NAMES.items():
        if const not in symbols:
            continue       # a layer this megatron-core version does not know (MLA before 0.19)
        kind = layers.by_symbol(symbols[const])
        assert kind.text == name or kind.name == name, (const, kind)
        checked += 1
    assert checked >= 3
    block = _megatron_source("core/models/hybrid/hybrid_block.py", "core/ssm/mamba_block.py")
    fields = set(re.findall(r"^\s+(\w+): (?:Union\[ModuleSpec, type\]|Optional\[ModuleSpec\])", block, re.M))
    for k in layers.kinds():
        if k.hybrid_slot is not None and (k.symbol is None or k.symbol in symbols.values()):
            assert k.hybrid_slot in fields | {"mtp_block_spec"}, k


@pytest.mark.parametrize("preset, pattern", [
    ("llama3-8b", "*-" * 32),
    ("mixtral-8x7b", "*E" * 32),
    ("deepseek-v3", "+-" * 3 + "+E" * 58 + "/+E"),      # first_k_dense_replace 3, one MTP depth
])
def test_model_as_hybrid_pattern(preset, pattern):
    """A GPT / MoE / MLA+MTP model's units are the layers of megatron-core's hybrid pattern, which its own syntax
    reads back (search.layers.hybrid.parse_pattern, transcribed from megatron-core)."""
    m = load_model(preset)
    assert layers.symbols(m) == pattern
    p = parse_pattern(pattern)
    assert len(p.layers) == sum(u.kind != "mtp" for u in m.units)
    assert p.mtp_depths == (m.mtp_num_layers or 0)


def test_t5_has_no_hybrid_pattern():
    with pytest.raises(ValueError, match="cross-attention has no hybrid layer symbol"):
        layers.symbols(load_model("t5-770m"))


def test_mla_is_a_variant_of_attention():
    """An MLA model's attention units keep their name; the registry prices, counts and offers recompute choices
    for them as MLA (mla_up_proj only there)."""
    m = load_model("deepseek-v3")
    assert layers.resolve(m, "attention").symbol == "+"
    assert "mla_up_proj" in recompute_allowed("attention", m)
    assert "mla_up_proj" not in recompute_allowed("attention", load_model("llama3-8b"))
    assert recompute_allowed("mtp", m) == ("none", "full")


def test_register_refuses_a_clash():
    with pytest.raises(ValueError, match="symbol '\\*' belongs to another kind"):
        layers.register(LayerKind(name="other", symbol="*", role="attention", params=len, flops=len, price=len))
    with pytest.raises(ValueError, match="register that kind first"):
        layers.register(LayerKind(name="x", symbol=None, role="mlp", params=len, flops=len, price=len,
                                  replaces="nothing", selects=lambda *a: True))


# ----- a new kind in one place ----------------------------------------------------------------------------------
H, S, V = 1024, 512, 1024


def _proj_params(m) -> int:            # one h x h linear, no bias, and its norm
    return m.hidden_size * m.hidden_size + m.hidden_size


def _proj_price(src, u, a) -> Row:
    m = src.model
    g = [(a.s * a.b, m.hidden_size / a.t, m.hidden_size)]
    fwd, bwd = src.kern.gemm(g), src.kern.gemm(g, backward=True)
    keep = src.dt * a.s * a.b * m.hidden_size            # its input
    return Row(UnitCost(fwd, bwd, 0.0, fwd, 0.0), (keep, keep, keep), _proj_params(m) / a.t)


PROJ = LayerKind(name="proj", symbol="P", role="mlp", params=_proj_params,
                 flops=lambda m, s, keys=None: 2.0 * s * m.hidden_size * m.hidden_size, price=_proj_price,
                 replaces="mlp", selects=lambda m, stack, layer: layer % 2 == 1)


@pytest.fixture
def proj_kind():
    layers.register(PROJ)
    yield PROJ
    layers.unregister(PROJ)


def test_a_new_kind_in_one_place(proj_kind):
    """Registered once: the model holds it where ``selects`` says, counts its parameters and FLOPs, writes its
    symbol, prices it with its own pricer (v1 roofline by hand) and plans a stage with it."""
    m = ModelSpec(name="p", family="gpt", num_layers=2, hidden_size=H, num_attention_heads=16, ffn_hidden_size=4096,
                  seq_length=S, vocab_size=V, params_dtype="fp16", add_bias_linear=False, normalization="rmsnorm")
    assert [u.kind for u in m.units] == ["attention", "mlp", "attention", "proj"]
    assert m.units[3] == Unit("decoder", 1, "proj")
    assert layers.symbols(m) == "*-*P"
    assert m.layer_starts == [0, 2, 4]
    att = H * 3 * H + H * H + H                              # QKV, projection, norm
    mlp = H * 4096 + 4096 * H + H
    assert m.num_parameters == m.embedding_params() + 2 * att + mlp + (H * H + H) + m.output_params()
    att_f = 2.0 * S * 4 * H * H + 4.0 * S * S * H
    mlp_f = 2.0 * S * 2 * H * 4096
    assert m.forward_flops_per_sample() == pytest.approx(2 * att_f + mlp_f + 2.0 * S * H * H + 2.0 * S * H * V)

    c = parse_cluster("1x1-v100")
    cm = make_cost_model(m, c, TrainingSpec(global_batch_size=4, precision="fp16"), settings=LEGACY_V1,
                         kernels="flat")
    t = cm.unit_table(1, 1)
    flops_rate = 125e12 * 0.65 / 1e3                          # V100 GEMM FLOP per ms at the v1 efficiency
    assert t.fwd_ms[3] == pytest.approx(2.0 * S * H * H / flops_rate + 0.005, rel=1e-12)
    assert t.bwd_ms[3] == pytest.approx(4.0 * S * H * H / flops_rate + 0.005, rel=1e-12)
    assert t.weight_params[3] == H * H + H
    assert t.act_mb[3, 0] == 2 * S * H / 2**20
    assert recompute_allowed("proj", m) == ("none", "selective", "full")
    plan = ParallelPlan(model=m, cluster=c, micro_batch_size=1, global_batch_size=4,
                        stages=[StageSpec(num_gpus=1, tp=1, dp=1, start_unit=0, end_unit=4, recompute=["none"] * 4)])
    cost = cm.evaluate(plan)
    assert cost.stages[0].fwd_ms == pytest.approx(sum(t.fwd_ms) + t.embed_fwd_ms + t.head_fwd_ms)


# ----- Mamba-2 (M): the recipe's proof --------------------------------------------------------------------------
def _hybrid(pattern="M-*-"):
    return ModelSpec(name="h", family="gpt", num_layers=len(pattern), hidden_size=H, num_attention_heads=16,
                      ffn_hidden_size=4096, seq_length=S, vocab_size=V, params_dtype="fp16", add_bias_linear=False,
                      normalization="rmsnorm", mamba=Mamba2Spec(mamba_state_dim=64, mamba_head_dim=64,
                                                                mamba_num_groups=8),
                      hybrid_layer_pattern=pattern)


def test_mamba_scan_matmuls_are_the_ssd_count():
    """The scan's chunk matmuls hold every multiply-add of ``scan_macs`` but the inter-chunk state passing."""
    spec, seq = _hybrid().mamba, 1000          # 8 chunks of 128, the last padded
    chunks, heads = 8, 2 * H // 64
    macs = sum(b * m * n * k for b, m, n, k in mamba.scan_bmms(spec, H, 1, seq, 1))
    assert macs == mamba.scan_macs(spec, H, seq) - heads * chunks * 64 * 64


def test_a_mamba_unit_priced_by_hand():
    """Layer ``M`` of ``M-*-`` on a V100 (fp16, b 1, s 512, tp 1) under the v1 roofline: in_proj (h -> 2 d_inner +
    2 g N + H = 5152) and out_proj (d_inner 2048 -> h) as one GEMM group, the SSD scan as its four chunk matmuls
    at the batched-GEMM efficiency, the pre-norm / residual and the mixer's element-wise passes memory-bound."""
    m = _hybrid()
    assert [u.kind for u in m.units] == ["mamba", "mlp", "attention", "mlp"]
    assert layers.symbols(m) == "M-*-" and m.layer_starts == [0, 1, 2, 3, 4]
    c = parse_cluster("1x1-v100")
    cm = make_cost_model(m, c, TrainingSpec(global_batch_size=4, precision="fp16"), settings=LEGACY_V1,
                         kernels="flat")
    t = cm.unit_table(1, 1)
    peak, hbm, launch = 125e12 / 1e3, 900e9 / 1e3, 0.005
    gemm = 2.0 * S * (H * 5152 + 2048 * H) / (peak * 0.65) + launch
    q, chunks, g, heads, n, p = 128, 4, 8, 32, 64, 64
    bmms = [(chunks * g, q, q, n), (chunks * heads, q, p, q), (chunks * heads, n, p, q), (chunks * heads, q, p, n)]
    scan = sum(2.0 * b * x * y * z / (peak * 0.28) + launch for b, x, y, z in bmms)
    scan_b = sum(4.0 * b * x * y * z / (peak * 0.28) + launch for b, x, y, z in bmms)
    ew = (2 * 2 + 3 * 2 + 1) * S * H                              # pre-norm + bias-dropout-add bytes
    conv_dim = 2048 + 2 * g * n
    mix = 2 * S * (2 * conv_dim + 5152 + 4 * 2048)                # conv in/out, scan in/out, gated norm
    ssd = mamba.SSD_KERNEL_TIME              # mamba_ssm's mixer kernels over the kernel model (fitted, bench)
    ssd_f = ssd * ((mix / (hbm * 0.8) + launch) + scan)
    fwd = gemm + (ew / (hbm * 0.8) + launch) + ssd_f
    assert t.fwd_ms[0] == pytest.approx(fwd, rel=1e-12)
    gemm_b = 2.0 * 2.0 * S * (H * 5152 + 2048 * H) / (peak * 0.65) + launch
    bwd = gemm_b + (1.5 * ew / (hbm * 0.8) + launch) + ssd * ((1.5 * mix / (hbm * 0.8) + launch) + scan_b) + ssd_f
    assert t.bwd_ms[0] == pytest.approx(bwd, rel=1e-12)
    # parameters: in_proj, conv1d (weight and bias), dt_bias / A_log / D, gated norm, out_proj, pre-norm
    assert t.weight_params[0] == H * 5152 + conv_dim * 5 + 3 * heads + 2048 + 2048 * H + H
    assert m.unit_params("mamba") == t.weight_params[0]
    # kept for backward: in_proj's input, zxbcdt, the scan output, the norm's input and fp32 rstd, out_proj's input,
    # the fp32 A and dt_bias per head, the pre-norm's input; full recompute: the layer input
    keep = S * 2 * (H + 5152 + 2048 + 2048 + 2048) + S * 4 * g + 3 * 4 * heads + 2 * S * H
    assert t.act_mb[0, 0] * 2**20 == pytest.approx(keep, rel=1e-12)
    assert t.act_mb[0, 2] * 2**20 == 2 * S * H
    assert recompute_allowed("mamba", m) == ("none", "full")
    plan = ParallelPlan(model=m, cluster=c, micro_batch_size=1, global_batch_size=4,
                        stages=[StageSpec(num_gpus=1, tp=1, dp=1, start_unit=0, end_unit=4,
                                          recompute=["full", "none", "none", "none"])])
    cost = cm.evaluate(plan)
    assert cost.stages[0].recompute_ms == pytest.approx(fwd)
    with pytest.raises(ValueError, match="recompute\\[0\\] is 'selective'"):
        ParallelPlan(model=m, cluster=c, micro_batch_size=1, global_batch_size=4,
                     stages=[StageSpec(num_gpus=1, tp=1, dp=1, start_unit=0, end_unit=4,
                                       recompute=["selective", "none", "none", "none"])])


def test_a_new_kinds_other_cost_terms_come_from_its_record():
    """Issue 35: what the host-launch, Muon and fine-grained-offload terms and the EP overlap read of a unit is its
    kind's record (``launches``, ``muon_shapes``, ``offload_inputs``, ``routed_experts``, ``ep_overlap_partner``),
    not a chain of kind names in each cost module: a kind registered in the test alone is counted by all four
    (before, each returned nothing for a kind it did not name). Hand-computed: one h x h/t shard, its input
    ``dt s b h``, three launches, and the unit after each attention unit paired for the EP overlap."""
    from dataclasses import replace

    from search.costmodel.host import part_launches
    from search.costmodel.optimizers import muon_matrices
    from search.costmodel.stack_cost import offload_input_bytes

    kind = replace(PROJ, routed_experts=True, launches=lambda m, q, n, s: {"mlp": 3.0 + q},
                   muon_shapes=lambda m, t, ep, etp: [(m.hidden_size / t, m.hidden_size, 1)],
                   offload_inputs=lambda m, mod, b, s, t, sp, dt, ep, etp: dt * s * b * m.hidden_size
                   if mod == "mlp_norm" else 0.0)
    layers.register(kind)
    try:
        m = ModelSpec(name="p", family="gpt", num_layers=2, hidden_size=H, num_attention_heads=16,
                      ffn_hidden_size=4096, seq_length=S, vocab_size=V, params_dtype="fp16", add_bias_linear=False,
                      normalization="rmsnorm")
        assert part_launches(m, "proj", True, 0) == {"mlp": 4.0}
        assert part_launches(m, "attention", False, 0) == {"attn": 7}        # the built-in kinds' own records
        assert muon_matrices(m, "proj", 2) == [(H / 2, H, 1)]
        assert offload_input_bytes(m, "proj", "mlp_norm", 2, S, 1, False, 2.0) == 2.0 * S * 2 * H
        assert offload_input_bytes(m, "proj", "core_attn", 2, S, 1, False, 2.0) == 0.0
        assert layers.ep_overlap_pairs(m) == (3,)        # unit 3 (proj) after unit 2 (attention)
    finally:
        layers.unregister(kind)
