"""A checkpoint of another MoE / MLA / MTP shape is refused by ``model_mismatch`` in one line naming the field (the
expert count, an expert width, the layer pattern, MLA's ranks, the MTP depth, a shared MTP layer), before any tensor is read; what
does not shape a parameter (the router's top-k, the aux-loss coefficient) is no mismatch."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from aceso_megatron.training.checkpoint import model_mismatch
from search.layers.moe_spec import MLASpec, MoESpec
from search.spec.rope_scaling import RopeScaling
from tests.tiny_models import HYBRID, HYBRID_GDN, LLAMA

MOE = LLAMA.model_copy(update={"name": "m", "moe": MoESpec(num_experts=4, moe_router_topk=2,
                                                             moe_ffn_hidden_size=32)})


def _mismatch(saved, planned):
    return model_mismatch(saved.model_dump(), SimpleNamespace(plan=SimpleNamespace(model=planned)), None)


def _moe(**kw):
    return MOE.model_copy(update={"moe": MOE.moe.model_copy(update=kw)})


@pytest.mark.parametrize("planned, field", [
    (_moe(num_experts=8), "moe.num_experts is 4"),
    (_moe(moe_ffn_hidden_size=64), "moe.moe_ffn_hidden_size is 32"),
    (_moe(first_k_dense_layers=1), "moe.first_k_dense_layers is 0"),
    (LLAMA, "moe is True"),
    (MOE.model_copy(update={"mtp_num_layers": 1}), "mtp_num_layers is 0"),
])
def test_another_expert_shape_is_refused_naming_the_field(planned, field):
    msg = _mismatch(MOE, planned)
    assert msg is not None and field in msg and "\n" not in msg, msg


def test_an_mla_plan_is_refused_on_a_checkpoint_without_mla():
    mha = MOE.model_copy(update={"num_query_groups": None})     # MLA has no query groups (search.spec.model_rules)
    planned = mha.model_copy(update={"mla": MLASpec(kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=4,
                                                    v_head_dim=8)})
    msg = _mismatch(mha, planned)
    assert msg is not None and "mla is False" in msg and "\n" not in msg, msg


def test_router_settings_are_no_mismatch():
    assert _mismatch(MOE, _moe(moe_router_topk=1, moe_aux_loss_coeff=0.01)) is None
    assert _mismatch(MOE, MOE) is None


def test_a_shared_mtp_layer_and_one_per_depth_are_refused_as_each_other():
    """Two MTP depths of one shared layer (``mtp.layers.0`` only) and of two layers hold other parameters: either
    checkpoint is refused for the other's plan, naming ``mtp_use_repeated_layer``."""
    per_depth = MOE.model_copy(update={"mtp_num_layers": 2})
    shared = per_depth.model_copy(update={"mtp_use_repeated_layer": True})
    for saved, planned, was in ((per_depth, shared, False), (shared, per_depth, True)):
        msg = _mismatch(saved, planned)
        assert msg is not None and f"mtp_use_repeated_layer is {was}" in msg and "\n" not in msg, msg
    assert _mismatch(shared, shared) is None


def test_a_yarn_checkpoint_and_a_plain_rope_plan_are_refused_as_each_other():
    """Weights trained under YaRN's frequencies (``rope_scaling``) are another function under plain RoPE's (and under
    another factor): either way round the resume is refused in one line naming ``rope_scaling``."""
    yarn = LLAMA.model_copy(update={"rope_scaling": RopeScaling(type="yarn", factor=4.0)})
    for saved, planned, was in ((yarn, LLAMA, "{'type': 'yarn', 'factor': 4.0}"), (LLAMA, yarn, "None")):
        msg = _mismatch(saved, planned)
        assert msg is not None and f"rope_scaling is {was}" in msg and "\n" not in msg, msg
    other = LLAMA.model_copy(update={"rope_scaling": RopeScaling(type="yarn", factor=8.0)})
    assert "rope_scaling is" in (_mismatch(yarn, other) or "")
    assert _mismatch(yarn, yarn) is None


@pytest.mark.parametrize("field, saved_value, planned_value", [("rotary_base", 10000.0, 500000.0),
                                                               ("rotary_percent", 1.0, 0.5)])
def test_another_rotary_base_or_fraction_is_refused_naming_the_field(field, saved_value, planned_value):
    """megatron-core's RotaryEmbedding rotates ``rotary_percent`` of each head at frequencies ``rotary_base**(-2i/d)``:
    weights trained under one are another function under the other, and no parameter shape tells them apart (the
    resume loaded them silently). Either way round the resume is refused in one line naming the field."""
    a, b = (LLAMA.model_copy(update={field: v}) for v in (saved_value, planned_value))
    for saved, planned, was in ((a, b, saved_value), (b, a, planned_value)):
        msg = _mismatch(saved, planned)
        assert msg is not None and f"{field} is {was!r} in the checkpoint" in msg and "\n" not in msg, msg
    assert _mismatch(a, a) is None


def test_rope_fields_of_a_learned_position_model_are_no_mismatch():
    """A learned-position model rotates nothing: its (unused) rotary_base is no mismatch."""
    learned = LLAMA.model_copy(update={"position_embedding": "learned"})
    assert _mismatch(learned, learned.model_copy(update={"rotary_base": 500000.0})) is None


@pytest.mark.parametrize("update, field", [
    ({"megatron": {"add_qkv_bias": True}}, "megatron.add_qkv_bias is False"),
    ({"megatron": {"qk_layernorm": True}}, "megatron.qk_layernorm is False"),
])
def test_parameters_the_megatron_block_adds_are_compared(update, field):
    """megatron-core builds q/k/v biases (``add_qkv_bias``) and Q/K norms (``qk_layernorm``) from these entries:
    a checkpoint without them resumed under a plan with them (or the other way round: the saved biases / norms
    silently dropped) is refused in one line; an entry that adds no parameter (the norm epsilon) is no mismatch."""
    msg = _mismatch(LLAMA, LLAMA.model_copy(update=update))
    assert msg is not None and field in msg and "\n" not in msg, msg
    assert _mismatch(LLAMA, LLAMA.model_copy(update={"megatron": {"layernorm_epsilon": 1e-6}})) is None


def test_another_hybrid_layer_pattern_is_refused():
    """The pattern decides which layer (Mamba-2, attention, MoE, MLP) holds which parameters."""
    from tests.tiny_models import HYBRID
    other = HYBRID.model_copy(update={"hybrid_layer_pattern": "M*EE-M"})
    msg = _mismatch(HYBRID, other)
    assert msg is not None and "hybrid_layer_pattern is 'M*EM-E'" in msg and "\n" not in msg, msg


GEGLU = LLAMA.model_copy(update={"activation": "quick_geglu"})


@pytest.mark.parametrize("base, update, field", [
    (LLAMA, {"softmax_type": "learnable"}, "softmax_type is None"),
    (LLAMA, {"window_size": [127, 0]}, "window_size is None"),
    (LLAMA.model_copy(update={"window_size": [127, 0]}), {"window_attn_skip_freq": 2}, "window_attn_skip_freq is None"),
    (LLAMA, {"activation": "quick_geglu"}, "activation is 'swiglu'"),
    (GEGLU, {"glu_linear_offset": 1.0}, "glu_linear_offset is None"),
    (GEGLU, {"activation_func_clamp_value": 7.0}, "activation_func_clamp_value is None"),
])
def test_gpt_oss_layer_fields_are_compared(base, update, field):
    """GPT-OSS's layer fields, which the runtime builds (its learnable softmax offset is a parameter per head; a
    window, its period, an offset or a clamp makes the same weights another function): a checkpoint without them
    resumed under a plan with them is refused in one line naming the field, and the other way round."""
    other = base.model_copy(update=update)
    msg = _mismatch(base, other)
    assert msg is not None and field in msg and "\n" not in msg, msg
    assert _mismatch(other, base) is not None and _mismatch(other, other) is None


def test_a_learnable_and_an_off_by_one_softmax_are_refused_as_each_other():
    a, b = (LLAMA.model_copy(update={"softmax_type": t}) for t in ("learnable", "off-by-one"))
    msg = _mismatch(a, b)
    assert msg is not None and "softmax_type is 'learnable' in the checkpoint" in msg, msg


def _mamba(**kw):
    return HYBRID.model_copy(update={"mamba": HYBRID.mamba.model_copy(update=kw)})


def _gdn(**kw):
    return HYBRID_GDN.model_copy(update={"gdn": HYBRID_GDN.gdn.model_copy(update=kw)})


@pytest.mark.parametrize("planned, field", [
    (_mamba(mamba_num_groups=4), "mamba.groups is 2"),
    (_mamba(mamba_state_dim=16), "mamba.state is 8"),
    (_mamba(mamba_head_dim=16), "mamba.heads is 8"),        # 2 x 32 / 8 heads derived in the checkpoint, 4 planned
    (_mamba(expand=4), "mamba.heads is 8"),
    (_mamba(d_conv=2), "mamba.d_conv is 4"),
])
def test_another_mamba_shape_is_refused_naming_the_field(planned, field):
    """A Mamba-2 checkpoint of other heads (written or derived: ``expand x hidden / head_dim``), groups, state or conv
    width holds other ``in_proj`` / ``conv1d`` / ``A_log`` shapes: refused in one line naming the field."""
    msg = _mismatch(HYBRID, planned)
    assert msg is not None and field in msg and "\n" not in msg, msg


def test_mamba_heads_written_out_or_derived_are_the_same_model():
    """``mamba_num_heads`` None derives ``expand x hidden / head_dim`` = 2 x 32 / 8 = 8 heads (MambaMixer.__init__):
    the same heads written out is the same model; the scan's chunk length is no parameter."""
    assert _mismatch(HYBRID, _mamba(mamba_num_heads=8)) is None
    assert _mismatch(HYBRID, _mamba(chunk_size=16)) is None


@pytest.mark.parametrize("kw, field", [({"linear_num_value_heads": 2 * HYBRID_GDN.gdn.linear_num_value_heads},
                                        "gdn.linear_num_value_heads"),
                                       ({"linear_key_head_dim": 4}, "gdn.linear_key_head_dim"),
                                       ({"linear_conv_kernel_dim": 2}, "gdn.linear_conv_kernel_dim")])
def test_another_gdn_shape_is_refused_naming_the_field(kw, field):
    msg = _mismatch(HYBRID_GDN, _gdn(**kw))
    assert msg is not None and field in msg and "\n" not in msg, msg
    assert _mismatch(HYBRID_GDN, HYBRID_GDN) is None
