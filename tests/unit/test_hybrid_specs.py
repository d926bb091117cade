"""The hybrid architectures of ``model_specs/hybrid`` (Nemotron-3 and Nemotron-H), ``search.layers.hybrid`` and
``search.spec.hybrid_arch``: every
field sourced, the layer mix NVIDIA publishes, the parameter counts against the published totals (Nemotron-3
Super to the element against its released checkpoint), and megatron-core's pattern syntax."""

import pytest
from pydantic import ValidationError

from search.layers import hybrid
from search.layers.hybrid import HybridArch, load, parse_pattern, pipeline_refusal
from search.spec.hybrid_arch import counts

NAMES = ["nemotron-3-nano", "nemotron-3-super", "nemotron-3-ultra", "nemotron-h-56b", "nemotron-h-8b"]


def _fields(data: dict, prefix: str = "") -> list[str]:
    """The fields a record sets (dotted for the nested mamba / moe blocks)."""
    out = []
    for name, value in data.items():
        if name in ("name", "sources", "references", "published", "uncertain"):
            continue
        out += _fields(value, f"{name}.") if isinstance(value, dict) else [prefix + name]
    return out


def test_every_architecture_loads_and_every_field_has_a_source():
    assert hybrid.available() == NAMES
    for name in NAMES:
        a = load(name)
        missing = [f for f in _fields(a.model_dump(exclude_unset=True)) if f not in a.sources]
        assert not missing, (name, missing)


@pytest.mark.parametrize("name,mamba,moe,attention,mlp", [
    ("nemotron-3-nano", 23, 23, 6, 0),       # model card: 23 Mamba-2, 23 MoE, 6 attention
    ("nemotron-3-super", 40, 40, 8, 0),
    ("nemotron-3-ultra", 48, 48, 12, 0),
    ("nemotron-h-8b", 24, 0, 4, 24),         # Nemotron-H (arXiv 2504.03624): 52 layers, 4 attention
    ("nemotron-h-56b", 54, 0, 10, 54),       # 118 layers, 10 attention
])
def test_layer_mix(name, mamba, moe, attention, mlp):
    layers = load(name).hybrid_layer_pattern
    assert [layers.count(s) for s in "ME*-"] == [mamba, moe, attention, mlp]


def test_super_counts_its_released_checkpoint_to_the_element():
    """nvidia/NVIDIA-Nemotron-3-Super-120B-A12B-BF16 holds 123,611,033,088 elements (Megatron-Bridge's verification
    card): megatron-core's parameters of the main model and one MTP block plus 41 router bias buffers of 512."""
    a = load("nemotron-3-super")
    c = counts(a)
    assert c.total + a.published["hf_checkpoint_router_bias_elements"] == a.published["hf_checkpoint_elements"]
    assert c.mtp == 4096 * 3 + 2 * 4096 * 4096 + c.by_kind["attention"] // 8 + c.by_kind["moe"] // 40
    assert abs(c.active / a.published["active_params"] - 1) < 0.07       # 12.77B with embeddings vs "12B"


@pytest.mark.parametrize("name,rel", [("nemotron-3-nano", 0.001), ("nemotron-3-ultra", 0.002),
                                      ("nemotron-h-8b", 0.02), ("nemotron-h-56b", 0.01)])
def test_totals_against_published(name, rel):
    """The names' totals count the main model: Super's "120B" is its main 120.67B (123.6B with the MTP block its
    checkpoint stores), and Ultra's "550B" its main 549.3B (560.5B with its '*E' MTP block)."""
    a = load(name)
    c = counts(a)
    assert abs((c.total - c.mtp) / a.published["total_params"] - 1) < rel


def test_ultra_has_bridge_v060s_mtp():
    """Megatron-Bridge v0.6.0's Ultra recipes (recipes/nemotronh/h100/nemotron_3_ultra.py) set mtp_num_layers 2,
    mtp_use_repeated_layer True and mtp_loss_scaling_factor 0.3; the block is stored once, as Super's: one
    attention and one MoE layer of the main pattern, the enorm / hnorm / eh_proj fusion and a final norm."""
    a = load("nemotron-3-ultra")
    assert (a.mtp_num_layers, a.mtp_use_repeated_layer, a.mtp_loss_scaling_factor) == (2, True, 0.3)
    assert a.full_pattern.endswith("E/*E/*E")
    c = counts(a)
    h = 8192
    assert c.mtp == h * 3 + 2 * h * h + c.by_kind["attention"] // 12 + c.by_kind["moe"] // 48


def test_nano_active_as_its_report_counts():
    """3.2B active without the input embedding (a lookup), 3.6B with it."""
    a = load("nemotron-3-nano")
    c = counts(a)
    assert round((c.active - c.embedding) / 1e9, 1) == 3.2
    assert round(c.active / 1e9, 1) == 3.6


def test_pattern_syntax_as_megatron_core_documents_it():
    """The examples of megatron-core 0.19.2's ``parse_hybrid_pattern`` docstring."""
    assert parse_pattern("M*M*") == (("M*M*",), None, 0)
    assert parse_pattern("M*M*/MM/MM") == (("M*M*",), "MM", 2)
    assert parse_pattern("MMMM/*M/*M/*M") == (("MMMM",), "*M", 3)
    assert parse_pattern("M-M-|M-M*-/MM/MM") == (("M-M-", "M-M*-"), "MM", 2)
    with pytest.raises(ValueError, match="'X' is not a layer symbol"):
        parse_pattern("M*X")
    with pytest.raises(ValueError, match="every MTP depth"):
        parse_pattern("M*/MM/M*")
    with pytest.raises(ValueError, match="cannot be mixed"):
        parse_pattern("M*M+")


def test_pipeline_segments():
    cut = parse_pattern("M-M-|M-M*-|ME|ME")
    assert pipeline_refusal(cut, pp=2, vp=2) is None
    assert "4 pipeline segments" in pipeline_refusal(cut, pp=4, vp=2)
    even = parse_pattern("M*M*M*")
    assert pipeline_refusal(even, pp=3) is None
    assert "need '|' segments" in pipeline_refusal(even, pp=3, vp=2)
    assert "divide evenly" in pipeline_refusal(even, pp=4)


def test_architecture_rules():
    raw = load("nemotron-3-nano").model_dump()
    with pytest.raises(ValidationError, match="plan's"):
        HybridArch.model_validate({**raw, "hybrid_layer_pattern": "ME|ME"})
    with pytest.raises(ValidationError, match="exactly when the pattern has 'E'"):
        HybridArch.model_validate({**raw, "moe": None})
    with pytest.raises(ValidationError, match="not in references"):
        HybridArch.model_validate({**raw, "sources": {**raw["sources"], "hidden_size": "nowhere"}})
