"""Pipelined plans against a single-process stock ``HybridModel`` (megatron-core 0.19): the model as its hybrid layer
pattern (a dense model's units as ``*-`` per layer; a hybrid model's own pattern, ``tests.tiny_models.HYBRID``:
Mamba-2 ``M``, attention ``*``, MoE ``E`` and MLP ``-`` layers), the plan's stages and chunks slices of that pattern
cut anywhere, each chunk's units placed by megatron-core's ``HybridStack`` (``aceso_megatron.model.hybrid``), Mamba
layers megatron-core's ``MambaLayer`` on CPU kernels (``patches.mamba_cpu``, applied by the runtime and the
reference alike). As ``test_plans.py`` and ``test_modern_plans.py`` against ``GPTModel``: loss and every gradient of
step 1, the losses of 3 steps with active clipping and the weights after them; skipped before 0.19 (no hybrid
models). The shared MTP layer (``mtp_use_repeated_layer``: one ``MultiTokenPredictionBlock`` layer whose weights
both depths run) on one stage and cut across two, against ``HybridModel`` with the same flag."""

from __future__ import annotations

import pytest

from patches.compat import have_hybrid
from tests.distributed.test_modern_plans import GPT4, LLAMA4, OVERLAP, plan, run_and_compare, st, vst
from tests.distributed.test_plans import reference_process  # noqa: F401 (fixture)
from tests.tiny_models import HYBRID, HYBRID_MTP, HYBRID_SHARED_MTP

# experts at etp 1 (gloo cannot all-gather uneven token counts over expert-TP), unfused as on CPU
MOE = {"moe": {"token_dispatcher": "alltoall", "grouped_gemm": False, "permute_fusion": False}}


def ep1(stage: dict) -> dict:
    return {**stage, "etp": 1}

pytestmark = pytest.mark.skipif(not have_hybrid(), reason="megatron-core without models.hybrid (before 0.19)")

PLANS = {
    3: {
        "gpt 2 stages cut attention|mlp, tp 2 -> 1, mixed recompute": plan(
            GPT4, st(2, 1, 0, 3, ["attn_dropout", "full", "selective"]), st(1, 1, 3, 8)),
        "llama SP tp2 -> tp1, cut mlp|attention": plan(
            LLAMA4, st(2, 1, 0, 4, ["selective", "none", "full", "none"], sp=True), st(1, 1, 4, 8)),
        "llama dp2 -> dp1, distributed optimizer, both overlaps": plan(
            LLAMA4, st(1, 2, 0, 5, ["selective", "none", "full", "none", "selective"]), st(1, 1, 5, 8), **OVERLAP),
        "gpt VPP 2, uneven chunks, dp 1 | 2": plan(GPT4, vst(1, 1, (0, 3), (5, 6)), vst(1, 2, (3, 5), (6, 8))),
        "hybrid M*EME-/*E, MTP on the last stage, cut M*E | ME- + MTP, dp 1 | 2": plan(
            HYBRID_MTP, st(1, 1, 0, 3, ["full", "none", "selective"]), st(1, 2, 3, 7, ["none", "full", "none", "none"]),
            **MOE),
    },
    4: {   # HYBRID is M*EM-E: Mamba heads 8 and groups 2 split over tp 2; MoE + tp needs SP (megatron-core)
        "hybrid M*EM-E on one stage, SP tp2 x dp2, mixed recompute": plan(
            HYBRID, ep1(st(2, 2, 0, 6, ["full", "attn_dropout", "selective", "none", "selective", "full"], sp=True)),
            **MOE),
        "hybrid cut M*EM | -E, SP tp2 | tp1 dp2": plan(
            HYBRID, ep1(st(2, 1, 0, 4, ["none", "full", "none", "full"], sp=True)),
            st(1, 2, 4, 6, ["selective", "none"]), **MOE),
        "hybrid VPP 2, uneven chunks M* | EM | - | E, dp 2 | dp 2": plan(
            HYBRID, vst(1, 2, (0, 2, ["full", "none"]), (4, 5)), vst(1, 2, (2, 4), (5, 6, ["full"])), **MOE),
    },
}


@pytest.mark.parametrize("world_size", sorted(PLANS))
def test_plans_match_stock_hybrid_model(world_size, tmp_path, reference_process):  # noqa: F811
    failures = run_and_compare(world_size, PLANS[world_size], tmp_path, hybrid=True)
    assert not failures, "\n".join(failures)


# M*EME-/*E/*E: 2 MTP depths of one shared layer (its weights mtp.layers.0.*, as HybridModel's), its MoE at tp 2 + SP
SHARED_MTP = {
    "hybrid shared MTP at 2 depths on one stage, SP tp2 x dp2": plan(
        HYBRID_SHARED_MTP, ep1(st(2, 2, 0, 8, ["full", "none", "selective", "none", "full", "none", "none", "none"],
                                  sp=True)), **MOE),
    "hybrid shared MTP at 2 depths, cut M*E | ME- + MTP, SP tp2 | tp1 dp2": plan(
        HYBRID_SHARED_MTP, ep1(st(2, 1, 0, 3, ["none", "full", "none"], sp=True)),
        st(1, 2, 3, 8, ["full", "none", "selective", "none", "none"]), **MOE),
}


def test_shared_mtp_layer_matches_stock_hybrid_model(tmp_path, reference_process):  # noqa: F811
    """The plans equal stock HybridModel, which holds one MTP layer's weights for the two depths (so the runtime,
    whose parameter set equals it, does too)."""
    from aceso_megatron.testing.reference import stock_run
    from tests.distributed.test_plans import SEED, STEPS, TC

    failures = run_and_compare(4, SHARED_MTP, tmp_path, hybrid=True)
    assert not failures, "\n".join(failures)
    names = stock_run(next(iter(SHARED_MTP.values())), SEED, TC, STEPS, hybrid=True)["params"]
    assert any(k.startswith("mtp.layers.0.") for k in names) and not any(k.startswith("mtp.layers.1.") for k in names)
