"""YaRN on standard attention (GPT-OSS's ``rope_scaling``) in the runtime: a one-stage plan trains exactly as stock
megatron-core's single-process ``GPTModel(position_embedding_type="yarn")`` with the ``yarn_*`` config attributes
(loss and every gradient); the runtime's frequencies and attention factor are transformers' ``_compute_yarn_parameters``
(``hf_yarn``, tests/runtime/test_yarn_oracle.py); with an MTP depth too; and the same test fails with YaRN off in
the runtime (plain RoPE against the stock YaRN model). Multi-stage plans: tests/distributed/test_yarn_plans.py.

The tiny model keeps GPT-OSS's YaRN (factor 32, beta 32 / 1, no rounding: ``truncate`` false) with a pretraining
context of 64 and base 10000 so that the ramp and the scaled frequencies fall inside its 8 rotary pairs and move
the angles of 16 positions.
"""

import math

import pytest
import torch

from search.spec.model import ModelSpec
from search.spec.rope_scaling import yarn
from tests.runtime.test_yarn_oracle import hf_yarn
from tests.tiny_models import LLAMA

YARN = yarn(32.0, original_max_position_embeddings=64, correction_range_round_to_int=False)
MODEL = ModelSpec.model_validate({**LLAMA.model_dump(), "name": "tiny-llama-yarn", "hidden_size": 64,
                                  "ffn_hidden_size": 96, "rope_scaling": YARN})
# one MTP depth: the chunk passes the same YaRN table to the MTP layer, as GPTModel does (Megatron-LM's validate_args
# refuses MTP with YaRN; megatron-core builds it)
MTP = ModelSpec.model_validate({**MODEL.model_dump(), "name": "tiny-llama-yarn-mtp", "mtp_num_layers": 1})


def hf_config(model: ModelSpec) -> dict:
    """The model's YaRN as a Hugging Face config.json states it."""
    r = model.rope_scaling
    return {"rope_theta": model.rotary_base, "head_dim": model.head_dim, "max_position_embeddings": 4096,
            "rope_scaling": {"rope_type": "yarn", "factor": r.factor, "truncate": r.correction_range_round_to_int,
                             "original_max_position_embeddings": r.original_max_position_embeddings}}


def _plan(model):
    recompute = ["selective", "none", "full", "selective"] + ["none"] * (model.num_units - 4)
    return {"model": model.model_dump(), "micro_batch_size": 2, "global_batch_size": 4,
            "stages": [{"num_gpus": 1, "tp": 1, "dp": 1, "start_unit": 0, "end_unit": model.num_units,
                        "recompute": recompute}]}


@pytest.fixture(scope="module")
def single_process():
    from aceso_megatron.testing import free_port
    from aceso_megatron.testing.reference import init_single_process

    init_single_process(free_port())


def runtime_against_stock(model, stock=MODEL):
    """The runtime's loss and gradients for ``model`` under the one-stage plan, and stock ``GPTModel``'s for
    ``stock``."""
    from aceso_megatron.testing import make_batches
    from aceso_megatron.testing.reference import Reference
    from aceso_megatron.training.engine import build_runtime

    batches = make_batches(stock, 2, 4, seed=3)
    rt = build_runtime(_plan(model), 0, 1, seed=7)
    ref = Reference(stock, seed=7)
    return rt, ref, rt.forward_backward(iter(batches)), ref.forward_backward(batches)


def mismatches(rt, ref, loss: float, want: float) -> list[str]:
    """What differs from the stock model beyond the usual tolerances (loss rel 1e-6, gradients rtol 1e-5)."""
    out = [] if loss == pytest.approx(want, rel=1e-6) else [f"loss {loss} != {want}"]
    want_g, got_g = ref.grads(), rt.full_grads()
    if set(got_g) != set(want_g):
        return out + [f"parameter sets differ: {sorted(set(got_g) ^ set(want_g))}"]
    return out + [f"gradient {k}: " + (f"shape {tuple(got_g[k].shape)}" if got_g[k].shape != g.shape else
                                       f"rel err {float((got_g[k] - g).norm() / g.norm()):.1e}")
                  for k, g in want_g.items()
                  if got_g[k].shape != g.shape or not torch.allclose(got_g[k], g, rtol=1e-5, atol=1e-7)]


def test_yarn_trains_as_stock_megatron_core(single_process):
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
        _yarn_get_concentration_factor_from_config,
    )
    from megatron.core.transformer.attention import Attention

    rt, ref, loss, want = runtime_against_stock(MODEL)
    assert not mismatches(rt, ref, loss, want)
    inv, factor = hf_yarn(hf_config(MODEL))
    emb = rt.stage_module.rotary_table(2)
    assert emb[1, 0, 0, :MODEL.head_dim // 2].double().tolist() == pytest.approx(inv, rel=1e-5)
    assert factor == pytest.approx(1 + 0.1 * math.log(32))                    # GPT-OSS: no mscale keys
    attentions = [m for m in rt.stage_module.modules() if isinstance(m, Attention)]
    assert len(attentions) == MODEL.num_layers                                  # each scales its cos / sin by it
    for a in attentions:
        assert _yarn_get_concentration_factor_from_config(a.config) == pytest.approx(factor, rel=1e-12)
    plain = 1.0 / MODEL.rotary_base ** (torch.arange(0, MODEL.head_dim, 2, dtype=torch.float64) / MODEL.head_dim)
    assert not torch.allclose(torch.tensor(inv, dtype=torch.float64), plain, rtol=1e-3)   # the scaling moves them


def test_yarn_with_mtp_trains_as_stock_megatron_core(single_process):
    rt, ref, loss, want = runtime_against_stock(MTP, MTP)
    assert not mismatches(rt, ref, loss, want)
    assert any(k.startswith("mtp.layers.0.") for k in rt.full_grads())


def test_control_plain_rope_in_the_runtime_fails(single_process):
    """The same comparison with the runtime training the model without its YaRN: the loss and the attention
    weights' gradients differ."""
    rt, ref, loss, want = runtime_against_stock(MODEL.model_copy(update={"rope_scaling": None}))
    failures = mismatches(rt, ref, loss, want)
    assert failures[0].startswith("loss") and any("linear_qkv.weight" in f for f in failures), failures
