"""GPT-OSS's layer in the runtime: attention sinks (``softmax_type`` learnable: one offset logit per head; off-by-one:
a zero one) and the clamped quick GEGLU with its linear offset (``quick_gelu(min(x W, c)) * (clamp(x V, -c, c) + 1)``),
with GPT-OSS's biases and sliding window on every other layer. A one-stage plan trains exactly as stock megatron-core's
single-process ``GPTModel`` built from the same ``TransformerConfig`` fields (loss and every gradient, the offsets'
included); the config fields are Megatron-LM's for the exported flags (tests/runtime/test_megatron_lm_oracle.py's
``layer_variants``: ``--softmax-type``, ``--quick-geglu``, ``--glu-linear-offset``, ``--activation-func-clamp-value``),
and the activation is the formula above, written out here. The same comparison fails with each feature off in the
runtime (controls). Multi-stage plans and a TP-resharded checkpoint: tests/distributed/test_gpt_oss_plans.py.

The tiny model clamps at 0.1, below the spread of its fc1 outputs (about 0.16 at init std 0.02, hidden 64), so the
clamp bites on both halves.
"""

import dataclasses

import pytest
import torch

from search.spec.model import ModelSpec
from tests.runtime.test_yarn_runtime import _plan, mismatches, runtime_against_stock
from tests.tiny_models import LLAMA

OSS = ModelSpec.model_validate({**LLAMA.model_dump(), "name": "tiny-gpt-oss", "hidden_size": 64,
                                "ffn_hidden_size": 96, "add_bias_linear": True, "activation": "quick_geglu",
                                "glu_linear_offset": 1.0, "activation_func_clamp_value": 0.1,
                                "softmax_type": "learnable", "window_size": [3, 0], "window_attn_skip_freq": 2})
OFF_BY_ONE = OSS.model_copy(update={"name": "tiny-gpt-oss-off-by-one", "softmax_type": "off-by-one"})
# routed experts with quick GEGLU and biases, as GPT-OSS's (their fc2 bias out of place: patches/expert_bias_out_of_place)
OSS_MOE = ModelSpec.model_validate({**OSS.model_dump(), "name": "tiny-gpt-oss-moe",
                                    "moe": {"num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 32}})


@pytest.fixture(scope="module")
def single_process():
    from aceso_megatron.testing import free_port
    from aceso_megatron.testing.reference import init_single_process

    init_single_process(free_port())


OFFSET = "decoder.layers.{}.self_attention.core_attention.softmax_offset"


@pytest.mark.parametrize("model", [OSS, OFF_BY_ONE, OSS_MOE], ids=lambda m: m.name)
def test_gpt_oss_layer_trains_as_stock_megatron_core(single_process, model):
    rt, ref, loss, want = runtime_against_stock(model, model)
    assert not mismatches(rt, ref, loss, want)
    grads = rt.full_grads()
    offsets = [k for k in grads if k.endswith(".softmax_offset")]
    if model.softmax_type == "learnable":   # one learnable logit per head and layer, trained
        assert offsets == [OFFSET.format(i) for i in range(model.num_layers)]
        assert all(grads[k].shape == (model.num_attention_heads,) and grads[k].abs().min() > 0 for k in offsets)
    else:                                   # off-by-one: a constant zero logit, no parameter
        assert not offsets


def test_the_mlp_is_clamped_quick_geglu(single_process):
    """The runtime's dense MLP computes ``quick_gelu(min(g, c)) * (clamp(u, -c, c) + offset)`` of fc1's halves
    ``[g; u]`` (megatron-core's ``MLP``, written out: quick_gelu(x) = x sigmoid(1.702 x)), and the clamp is active."""
    from megatron.core.transformer.mlp import MLP

    from aceso_megatron.training.engine import build_runtime

    rt = build_runtime(_plan(OSS), 0, 1, seed=7)
    mlp = next(m for m in rt.stage_module.modules() if isinstance(m, MLP))   # unit 1's (recompute none)
    x = torch.randn(5, 2, OSS.hidden_size)
    h, _ = mlp.linear_fc1(x)
    g, u = h.chunk(2, dim=-1)
    c, off = OSS.activation_func_clamp_value, OSS.glu_linear_offset
    g, u_c = g.clamp(max=c), u.clamp(-c, c)
    want, _ = mlp.linear_fc2(g * torch.sigmoid(1.702 * g) * (u_c + off))
    got, _ = mlp(x)
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-7)
    assert (u.abs() > c).float().mean() > 0.1            # the clamp bites


@pytest.mark.parametrize("off", [{"softmax_type": None}, {"activation_func_clamp_value": None},
                                 {"glu_linear_offset": None}, {"activation": "gelu", "glu_linear_offset": None,
                                                               "activation_func_clamp_value": None}],
                         ids=["vanilla-softmax", "no-clamp", "no-offset", "gelu"])
def test_control_each_feature_off_in_the_runtime_fails(single_process, off):
    """The same comparison with the runtime training the model without one of the features: the loss differs."""
    rt, ref, loss, want = runtime_against_stock(OSS.model_copy(update=off), OSS)
    failures = mismatches(rt, ref, loss, want)
    assert failures and failures[0].startswith(("loss", "parameter sets")), failures
    if "softmax_type" in off:                                   # the sinks' parameters are missing
        assert "softmax_offset" in failures[-1], failures


@pytest.mark.parametrize("tag", ["core_v0.16.1", "core_v0.19.0"])
def test_the_config_is_megatron_lms_for_the_exported_flags(tag):
    """The runtime's stage config holds what Megatron-LM ``tag`` builds from the plan's exported command line (its
    own parse_args / core_transformer_config_from_args, tests/runtime/megatron_lm_oracle.py) for GPT-OSS's layer:
    the softmax type, quick_gelu gated, the GEGLU offset and clamp, the window."""
    from aceso_megatron.model.config import stage_config
    from tests.megatron_plans import case_plan
    from tests.runtime.test_megatron_lm_oracle import _oracle

    plan = case_plan("oss-pp2-window-selective")
    (got,) = _oracle([plan], tag)
    assert "error" not in got, got
    cfg = stage_config(plan.model, plan.stages[0].tp)
    assert got["layer_variants"] == {
        "window_size": list(cfg.window_size), "window_attn_skip_freq": cfg.window_attn_skip_freq,
        "softmax_type": cfg.softmax_type, "glu_linear_offset": cfg.glu_linear_offset,
        "activation_func_clamp_value": cfg.activation_func_clamp_value,
        "activation": cfg.activation_func.__name__, "gated": cfg.gated_linear_unit}
    assert cfg.softmax_type == "learnable" and cfg.gated_linear_unit and cfg.activation_func_clamp_value == 7.0


def test_a_dense_quick_geglu_mlp_runs_unfused_on_gpus(single_process):
    """megatron-core's ``MLP`` fuses quick GEGLU only in its weighted form (routed experts, ``per_token_scale``): a
    dense quick-GEGLU MLP with ``bias_activation_fusion`` raises at its first forward (0.16.1 and 0.19.2), so the
    fast path a GPU run chooses keeps it off there; an MoE model whose every MLP is a routed expert keeps it on."""
    from megatron.core.transformer.mlp import MLP

    from aceso_megatron.model.fast_path import Environment, choose
    from aceso_megatron.training.engine import build_runtime

    gpu = Environment(cuda=True, compute_capability=(9, 0))
    assert not choose(gpu, OSS).config["bias_activation_fusion"]
    assert choose(gpu, OSS_MOE).config["bias_activation_fusion"]
    assert choose(gpu, OSS.model_copy(update={"activation": "swiglu", "glu_linear_offset": None,
                                              "activation_func_clamp_value": None})).config["bias_activation_fusion"]
    rt = build_runtime(_plan(OSS), 0, 1, seed=7)
    mlp = next(m for m in rt.stage_module.modules() if isinstance(m, MLP))
    mlp.config = dataclasses.replace(mlp.config, bias_activation_fusion=True)
    with pytest.raises(ValueError, match="Only support fusion of gelu and swiglu"):
        mlp(torch.randn(4, 2, OSS.hidden_size))
