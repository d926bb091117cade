"""Intra-stage resharding (SPEC §3.3) and the out-comm tp quirk (§3.2), on hand-made heterogeneous GPT configs.

Expected primitives come from the SPEC's rule table applied by hand to the layout table of §2.1; expected costs
are read straight from the database's collective and op CSVs.
"""

from __future__ import annotations

import pytest

from search.compat import AcesoDB, evaluate_ref_config, parse_ref_config
from search.compat.db import OUT
from search.compat.formulas import p2p_us
from search.compat.reshard import op_layouts, reshard_prims


def test_reshard_rule_table():
    # replicated (R=2) -> batch split over dp 2: split forward, all_gather backward, n = 2
    assert reshard_prims((2, 1, (1, 1, 1)), (1, 1, (1, 2, 1))) == ("split", "all_gather", 2)
    # batch split -> replicated over tp 2: all_gather forward, split backward, n = 2
    assert reshard_prims((1, 1, (1, 2, 1)), (2, 1, (1, 1, 1))) == ("all_gather", "split", 2)
    # hidden split -> seq split: all_to_all both ways
    assert reshard_prims((1, 1, (1, 1, 2)), (1, 1, (2, 1, 1))) == ("all_to_all", "all_to_all", 2)
    assert reshard_prims((2, 1, (1, 1, 1)), (2, 1, (1, 1, 1))) == (None, None, 0)
    # uniform stage: every consecutive GPT op pair at one tp/dp/algo 0 agrees
    names = ["encoder-embedding", "enc-1st-layernorm", "enc-attention-qkv", "enc-attention-score",
             "enc-attention-softmax", "enc-attention-dropout", "enc-attention-context", "enc-attention-dense",
             "enc-post-attention-dropout", "enc-2nd-layernorm", "enc-MLP-GEMM-1", "enc-MLP-gelu", "enc-MLP-GEMM-2",
             "enc-post-MLP-dropout", "final-layernorm", "gpt-post-process"]
    for a, b in zip(names, names[1:]):
        assert op_layouts(a, 2, 2, 0)[1] == op_layouts(b, 2, 2, 0)[0], (a, b)


def _config(stage_ops, tp, dp, num_gpus):
    return parse_ref_config({
        "model_name": "gpt", "model_size": "1_3B", "num_layers": 1, "global_batch_size": 8, "micro_batch_size": 2,
        "num_stages": len(stage_ops), "num_gpus": num_gpus, "checkpoint_activations": [False] * len(stage_ops),
        "resharding_stages": [True] * len(stage_ops), "num_ops_in_each_stage": stage_ops,
        "model_parallel_size_of_each_op": tp, "data_parallel_size_of_each_op": dp,
        "recompute_ops": [[0] * n for n in stage_ops], "algo_of_each_op": [[0] * n for n in stage_ops]})


def test_heterogeneous_stage_pays_the_collective(reference_db):
    db = AcesoDB(reference_db / "miniset", "gpt_1_3B")
    # one stage of 2 GPUs: embedding + attention half at tp 2, the rest at dp 2
    cfg = _config([16], [[2] * 9 + [1] * 7], [[1] * 9 + [2] * 7], [2])
    on = evaluate_ref_config(cfg, db, resharding=True).stages[0]
    off = evaluate_ref_config(cfg, db, resharding=False).stages[0]
    # post-attention-dropout (R=2) -> 2nd-layernorm (batch split): split fwd (free), all_gather bwd on 2 GPUs,
    # keyed by 2nd-layernorm's input at (batch 1, tp 1): 8 MB -> 1.412 ms in prim_gpt_1_3B_all_gather_2gpus.csv
    assert on.in_ms == pytest.approx(off.in_ms)
    assert on.out_ms - off.out_ms == pytest.approx(1.412)


def test_out_comm_uses_the_first_ops_tp(reference_db):
    db = AcesoDB(reference_db / "miniset", "gpt_1_3B")
    # stage 0 ends at MLP-GEMM-1 (op 10) with tp 1 / dp 2, but its first op runs at tp 2
    cfg = _config([11, 5], [[2] * 9 + [1] * 2, [1] * 5], [[1] * 9 + [2] * 2, [1] * 5], [2, 1])
    st = evaluate_ref_config(cfg, db, resharding=False).stages[0]
    wrong_tp_size = db.op("enc-MLP-GEMM-1", 1, 2)[OUT]          # 24.008 MB (tp 2), not 40.016 (tp 1)
    assert st.out_ms == pytest.approx(p2p_us(wrong_tp_size, db.p2p_intra) / 1000)
