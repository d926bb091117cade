"""A hybrid model's checkpoint (``tests.tiny_models.HYBRID``: Mamba-2, attention, MoE and MLP layers, megatron-core
0.19) saved under one plan resumes under another with the saving run's weights (bit for bit, every tensor by
canonical name) and the losses of the uninterrupted steps 3 and 4 (relative 1e-5): ``test_moe_checkpoint.py``'s runs
and checks with these plans.

Saved: one stage of 4 gloo ranks, SP tp2 x dp2 (Mamba's heads and groups, the attention heads and the experts split
over TP). Resumed under: the pattern cut ``M*E | M-E`` at tp1 x dp2 per stage (Mamba's packed ``in_proj`` and
``conv1d`` re-sharded part by part: a contiguous re-shard mixes their z / x / B / C / dt rows), and in one process,
the stock single-process layout (tp = dp = 1: each parameter under its stock ``HybridModel`` name and shape).
"""

from __future__ import annotations

import pytest

from patches.compat import have_hybrid
from tests.distributed.test_moe_checkpoint import _mismatches, save_and_resume
from tests.tiny_models import HYBRID as MODEL

pytestmark = pytest.mark.skipif(not have_hybrid(), reason="megatron-core without models.hybrid (before 0.19)")

N = MODEL.num_units


def st(tp, dp, lo, hi):
    return {"num_gpus": tp * dp, "tp": tp, "dp": dp, "sequence_parallel": tp > 1, "start_unit": lo,
            "end_unit": hi, "recompute": ["none"] * (hi - lo)}


def plan(*stages):
    return {"model": MODEL.model_dump(), "micro_batch_size": 4, "global_batch_size": 8, "stages": list(stages),
            "moe": {"token_dispatcher": "allgather", "grouped_gemm": False, "permute_fusion": False}}


SAVED = plan(st(2, 2, 0, N))
RESUMED = {"SP tp2 x dp2 -> cut M*E | M-E, tp1 x dp2 each": plan(st(1, 2, 0, 3), st(1, 2, 3, N))}
SINGLE = plan(st(1, 1, 0, N))


def test_hybrid_checkpoint_resumes_under_other_plans(tmp_path):
    res = save_and_resume(tmp_path, SAVED, RESUMED, SINGLE)
    want = res["saved"]
    assert any(k.endswith("mixer.in_proj.weight") for k in want["params"])
    failures = [f for name in [*RESUMED, "single"] for f in _mismatches(name, res[name], want)]
    assert not failures, "\n".join(failures)
