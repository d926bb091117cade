"""Gated DeltaNet hybrids against a single-process stock ``HybridModel`` (megatron-core 0.19): the pattern ``G*EG-E``
(``tests.tiny_models.HYBRID_GDN``: GDN, attention, MoE and MLP layers), its GDN layers megatron-core's own
``GatedDeltaNet`` on CPU kernels (``patches.gdn_cpu``, applied by the runtime and the reference alike), on one
stage and on two stages cut inside the pattern, tp 2 | tp 1 dp 2. As ``test_hybrid_plans.py``: loss and every
gradient of step 1, the losses of 3 steps with active clipping and the weights after them (fp32, the same
tolerances); skipped before 0.19 (no hybrid models)."""

from __future__ import annotations

import pytest

from patches.compat import have_hybrid
from tests.distributed.test_hybrid_plans import MOE, ep1
from tests.distributed.test_modern_plans import plan, run_and_compare, st
from tests.distributed.test_plans import reference_process  # noqa: F401 (fixture)
from tests.tiny_models import HYBRID_GDN

pytestmark = pytest.mark.skipif(not have_hybrid(), reason="megatron-core without models.hybrid (before 0.19)")

PLANS = {   # GDN heads 2 key / 4 value split over tp 2; MoE + tp needs SP (megatron-core)
    "hybrid G*EG-E on one stage, SP tp2 x dp2, mixed recompute": plan(
        HYBRID_GDN, ep1(st(2, 2, 0, 6, ["full", "attn_dropout", "selective", "none", "selective", "full"], sp=True)),
        **MOE),
    "hybrid cut G*EG | -E, SP tp2 | tp1 dp2": plan(
        HYBRID_GDN, ep1(st(2, 1, 0, 4, ["none", "full", "none", "full"], sp=True)),
        st(1, 2, 4, 6, ["selective", "none"]), **MOE),
    "hybrid cut G* | EG-E, dp2 | dp2": plan(
        HYBRID_GDN, st(1, 2, 0, 2, ["full", "none"]), st(1, 2, 2, 6, ["none", "none", "full", "selective"]), **MOE),
}


def test_gdn_plans_match_stock_hybrid_model(tmp_path, reference_process):  # noqa: F811
    failures = run_and_compare(4, PLANS, tmp_path, hybrid=True)
    assert not failures, "\n".join(failures)
