"""A hybrid model's checkpoint (``tests.tiny_models.HYBRID``: Mamba-2, attention, MoE and MLP layers, megatron-core
0.19) saved under one plan resumes under another with the saving run's weights (bit for bit, every tensor by
canonical name) and the losses of the uninterrupted steps 3 and 4 (relative 1e-5): ``test_moe_checkpoint.py``'s runs
and checks with these plans.

Saved: one stage of 4 gloo ranks, SP tp2 x dp2 (Mamba's heads and groups, the attention heads and the experts split
over TP). Resumed under: the pattern cut ``M*E | M-E`` at tp1 x dp2 per stage (Mamba's packed ``in_proj`` and
``conv1d`` re-sharded part by part: a contiguous re-shard mixes their z / x / B / C / dt rows), and in one process,
the stock single-process layout (tp = dp = 1: each parameter under its stock ``HybridModel`` name and shape). The
same for ``HYBRID_SHARED_MTP`` (two MTP depths of one shared layer, ``mtp_use_repeated_layer``), cut ``M*E | ME-``
with the MTP block on the second stage. And for ``HYBRID_GDN`` (Gated DeltaNet layers on ``patches.gdn_cpu``), cut
``G*E | G-E``: GDN's packed ``in_proj`` (q / k / v / z / beta / alpha) and ``conv1d`` (q / k / v) re-sharded part by
part, as Mamba's.
"""

from __future__ import annotations

import pytest

from patches.compat import have_hybrid
from tests.distributed.test_moe_checkpoint import _mismatches, save_and_resume
from tests.tiny_models import HYBRID, HYBRID_GDN, HYBRID_SHARED_MTP

pytestmark = pytest.mark.skipif(not have_hybrid(), reason="megatron-core without models.hybrid (before 0.19)")


def st(tp, dp, lo, hi):
    return {"num_gpus": tp * dp, "tp": tp, "dp": dp, "sequence_parallel": tp > 1, "start_unit": lo,
            "end_unit": hi, "recompute": ["none"] * (hi - lo)}


def plan(model, *stages):
    return {"model": model.model_dump(), "micro_batch_size": 4, "global_batch_size": 8, "stages": list(stages),
            "moe": {"token_dispatcher": "allgather", "grouped_gemm": False, "permute_fusion": False}}


def plans(model, cut: str):
    """Saved on one SP tp2 x dp2 stage; resumed cut after 3 units at tp1 x dp2 each, and single-process."""
    n = model.num_units
    return (plan(model, st(2, 2, 0, n)), {f"SP tp2 x dp2 -> cut {cut}, tp1 x dp2 each": plan(
        model, st(1, 2, 0, 3), st(1, 2, 3, n))}, plan(model, st(1, 1, 0, n)))


# HYBRID_SHARED_MTP: M*EME-/*E/*E, 2 MTP depths of one shared layer (mtp.layers.0.*, saved at tp2, resumed at tp1)
CASES = {"hybrid": (HYBRID, "M*E | M-E", "mixer.in_proj.weight"),
         "shared MTP": (HYBRID_SHARED_MTP, "M*E | ME- + MTP", "mtp.layers.0.eh_proj.weight"),
         "gdn": (HYBRID_GDN, "G*E | G-E", "self_attention.in_proj.weight")}


@pytest.mark.parametrize("case", sorted(CASES))
def test_hybrid_checkpoint_resumes_under_other_plans(tmp_path, case):
    model, cut, needle = CASES[case]
    saved, resumed, single = plans(model, cut)
    res = save_and_resume(tmp_path, saved, resumed, single)
    want = res["saved"]
    assert any(k.endswith(needle) for k in want["params"])
    failures = [f for name in [*resumed, "single"] for f in _mismatches(name, res[name], want)]
    assert not failures, "\n".join(failures)
