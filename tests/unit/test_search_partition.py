"""Exact partition DP (search/planner/partition.py) against brute force on random synthetic costs (alpa-style)."""

import itertools

import numpy as np
import pytest

from search.planner.partition import Spans, best_partition, brute_force_partition


def _random_spans(rng, U, S, M, window=None):
    stages = []
    for _ in range(S):
        pairs = [(a, b) for a in range(U) for b in range(a + 1, U + 1)]
        a, b = (np.array(x) for x in zip(*pairs))
        w = rng.uniform(0.5, 2, U)
        cs = np.concatenate([[0], np.cumsum(w)])
        t = cs[b] - cs[a] + rng.uniform(0, 0.3, len(a))
        t[rng.uniform(size=len(a)) < 0.15] = np.inf  # spans that do not fit in memory
        A = np.where(np.isfinite(t), (M - 1) * np.where(np.isfinite(t), t, 0) + rng.uniform(0, 1, len(a)), np.inf)
        stages.append(Spans(a, b, t, A))
    return stages


@pytest.mark.parametrize("seed", range(40))
def test_partition_matches_brute_force(seed):
    rng = np.random.default_rng(seed)
    U = int(rng.integers(2, 10))
    S = int(rng.integers(1, min(U, 4) + 1))
    M = int(rng.integers(1, 12))
    stages = _random_spans(rng, U, S, M)
    got, gb = best_partition(U, stages)
    want, _wb = brute_force_partition(U, stages)
    if not np.isfinite(want):
        assert gb is None
    else:
        assert got == pytest.approx(want, rel=1e-12)
        assert gb[0] == 0 and gb[-1] == U and all(x < y for x, y in itertools.pairwise(gb))


def test_partition_hand_example():
    # 4 equal units, 2 stages, t = units, no sync, M = 3: the even cut gives max 2*2 + 4 = 8
    pairs = [(a, b) for a in range(4) for b in range(a + 1, 5)]
    a, b = (np.array(x) for x in zip(*pairs))
    t = (b - a).astype(float)
    sp = Spans(a, b, t, 2 * t)
    val, bounds = best_partition(4, [sp, sp])
    assert val == 8.0 and bounds == (0, 2, 4)
