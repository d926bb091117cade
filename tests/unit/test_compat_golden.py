"""aceso-compat reproduces the Aceso reference's own predictions (configs/*.csv) on its database (miniset/).

Independent reference: the golden CSVs were computed by the published Aceso implementation. Also: the reference's
greedy recompute rule regenerates the recompute flags of the two configs its search produced, and hand-computed
checks of the p2p lookup and the memory rules.
"""

from __future__ import annotations

import csv

import numpy as np
import pytest

from search.compat import AcesoDB, evaluate_ref_config, load_ref_config, parse_ref_config
from search.compat.formulas import p2p_us, stage_memory
from search.compat.recompute import apply_greedy_recompute

CONFIGS = ["gpt_1_3B_4gpus_reference_search", "gpt_1_3B_4gpus_megatron_grid_best", "het_tp_3stages",
           "het_dp_3stages", "uniform_tp2_2stages", "uniform_dp4_1stage", "t5_770M_4gpus_reference_search",
           "t5_770M_4gpus_megatron_grid_best"]
README_ITERATION_MS = {"gpt_1_3B_4gpus_reference_search": 58760.92, "gpt_1_3B_4gpus_megatron_grid_best": 73654.74,
                       "het_tp_3stages": 86376.64, "het_dp_3stages": 67732.52, "uniform_tp2_2stages": 120022.69,
                       "uniform_dp4_1stage": 64788.76, "t5_770M_4gpus_reference_search": 33659.50,
                       "t5_770M_4gpus_megatron_grid_best": 52169.67}


def _golden(path):
    with open(path) as f:
        rows = list(csv.reader(f))[1:]
    return [[float(x) for x in r[1:]] for r in rows]


@pytest.fixture(scope="module")
def dbs(reference_db):
    return {key: AcesoDB(reference_db / "miniset", key) for key in ("gpt_1_3B", "t5_770M")}


@pytest.mark.parametrize("name", CONFIGS)
def test_golden_stage_time_and_memory(name, reference_db, dbs):
    cfg = load_ref_config(reference_db / "configs" / f"{name}.json")
    result = evaluate_ref_config(cfg, dbs[cfg.key])
    golden = _golden(reference_db / "configs" / f"{name}.csv")
    assert len(result.stages) == len(golden)
    for i, (st, (time, total, normal, reserved)) in enumerate(zip(result.stages, golden)):
        assert st.time_ms == pytest.approx(time, rel=1e-3), f"stage {i} time"
        assert st.memory_mb == pytest.approx(total, rel=1e-3), f"stage {i} memory(total)"
        assert st.normal_mb == pytest.approx(normal, rel=1e-3), f"stage {i} memory(normal)"
        assert st.reserved_mb == pytest.approx(reserved, rel=1e-3), f"stage {i} memory(reserved)"
    assert result.iteration_ms == pytest.approx(max(g[0] for g in golden), rel=1e-3)
    assert result.iteration_ms == pytest.approx(README_ITERATION_MS[name], rel=1e-3)


@pytest.mark.parametrize("name", ["gpt_1_3B_4gpus_reference_search", "t5_770M_4gpus_reference_search"])
def test_greedy_recompute_regenerates_the_reference_search_flags(name, reference_db, dbs):
    cfg = load_ref_config(reference_db / "configs" / f"{name}.json")
    cleared = parse_ref_config(dict(cfg.raw, recompute_ops=[[0] * n for n in cfg.num_ops]))
    greedy = apply_greedy_recompute(cleared, dbs[cfg.key], 12000.0)
    assert greedy.recompute == cfg.recompute
    assert max(s.memory_mb for s in evaluate_ref_config(greedy, dbs[cfg.key]).stages) <= 12000.0


def test_p2p_lookup_off_by_one(reference_db, dbs):
    bw = dbs["gpt_1_3B"].p2p_intra          # 7.41, 8.20, 10.18, ... GB/s at 1, 2, 4, ... MB
    assert p2p_us(8.0, bw) == pytest.approx(8.0 / (10.18e-3))    # 8 MB uses the 4 MB column
    assert p2p_us(1.0, bw) == pytest.approx(1.0 / (7.41e-3))
    assert p2p_us(2.0, bw) == pytest.approx(2.0 / (7.41e-3))     # idx 1 -> 0
    assert p2p_us(0.5, bw) == pytest.approx(0.5 / (bw[-1] * 1e-3))  # log2 < 0 wraps to the end
    assert p2p_us(1e6, bw) == pytest.approx(1e6 / (bw[-1] * 1e-3))  # clamped
    assert p2p_us(0.0, bw) == 0.0


def test_memory_rules_by_hand():
    # ops: 0 LN1 (segment start), 1, 2, 3 rc; 4 LN1 rc; 5 rc; 6 not rc
    act = np.array([1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0])
    flags = np.array([0, 1, 1, 1, 1, 1, 0])
    start = np.array([1, 0, 0, 0, 1, 0, 0], dtype=bool)
    rf, rb = np.array([5.0, 1, 1, 1, 1, 1, 100]), np.array([1.0, 7, 1, 1, 1, 1, 100])
    m = stage_memory(10.0, 3.0, act, rf, rb, flags, start, behind=2)
    freed = 2 + 4 + 16             # pairs (1,2) (2,3) (4,5); (3,4) not: op 4 starts a segment
    peak = max(2 + 4 + 8, 16)      # run 1-3 counts op 3 (before the segment start), run 4 alone
    kept = 3 + act.sum() - freed
    assert m["normal"] == pytest.approx(8 * 10 + kept * 3 + peak)
    assert m["reserved"] == pytest.approx(max(5 + 7, 10))   # last op's 100 excluded
    assert m["total"] == pytest.approx(m["normal"] + m["reserved"])
