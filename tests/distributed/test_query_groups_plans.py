"""tp above the query groups on gloo against a single-process stock megatron-core model: tiny Llama with one query
group (MQA) on a tp 2 stage, where megatron-core all-gathers the QKV output over TP and each rank slices the one
K/V group and its half of the query heads (loss, every gradient, 3 optimizer steps, as ``test_plans.py``)."""

from __future__ import annotations

from tests.distributed.test_modern_plans import plan, run_and_compare, st
from tests.distributed.test_plans import reference_process  # noqa: F401 (fixture)
from tests.tiny_models import LLAMA

MQA = LLAMA.model_copy(update={"name": "tiny-llama-mqa", "num_query_groups": 1})


def test_tp_above_query_groups_matches_single_process(tmp_path, reference_process):  # noqa: F811
    plans = {"llama 1 query group, tp 2 (QKV all-gather)": plan(MQA, st(2, 1, 0, 4, ["none", "selective", "full",
                                                                                       "none"]))}
    failures = run_and_compare(2, plans, tmp_path)
    assert not failures, "\n".join(failures)
