"""The analytic model against the fully specified published runs (bench/calibration.py, bench/published_runs.py).

Reference: the measured step times of NVIDIA's DGX Cloud Benchmarking H100 BF16 recipes (bench/data/README.md,
source 7), whose sources state every setting the model prices. The test prices each row at its own configuration
(no option is chosen by us) and holds the issue's targets: calibration MAE <= 5% and no row beyond 10%, held-out
check MAE <= 7%; and ``kernels.SUSTAINED_HOPPER`` is the least-squares factor of those calibration rows (fit 1).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from search.costmodel import kernels as K

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("published_runs_bench", ROOT / "bench" / "published_runs.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)
cal = bench.cal

RUNS = bench.pr.load_published_runs()
DGXC = [r for r in RUNS if r["id"].startswith("dgxc-h100-")]


def _errors(rows: list[dict]) -> np.ndarray:
    out = [bench.evaluate_row(r) for r in rows]
    assert all("error" in r for r in out), [r for r in out if "error" not in r]
    return np.array([r["error"] for r in out])


def test_fully_specified_rows_have_exactly_one_configuration():
    full = [r for r in RUNS if cal.fully_specified(r) and not r["fp8"]]
    assert {r["id"] for r in DGXC} <= {r["id"] for r in full}
    assert not any(cal.fully_specified(r) for r in RUNS if r["id"].startswith("megatron-readme-"))
    for r in full:
        assert len(bench.options_of(r)) == 1, r["id"]
    # a row with unstated micro-batch, virtual stages and recompute spans Megatron's options (nuisance parameters)
    readme_70b = next(r for r in RUNS if r["id"] == "megatron-readme-h100-gpt-70b")
    assert len(bench.options_of(readme_70b)) > 20


def test_targets_on_fully_specified_h100_rows():
    cal_rows = [r for r in DGXC if r["set"] == "calibration"]
    chk_rows = [r for r in DGXC if r["set"] == "check"]
    assert len(cal_rows) == 21 and len(chk_rows) == 14
    e_cal, e_chk = _errors(cal_rows), _errors(chk_rows)
    assert np.mean(np.abs(e_cal)) <= 0.05 and np.max(np.abs(e_cal)) <= 0.10
    assert np.mean(np.abs(e_chk)) <= 0.07


def test_sustained_hopper_is_the_least_squares_fit_of_the_fully_specified_rows():
    rows = [r for r in DGXC if r["set"] == "calibration"]
    # one row per model and GPU-count extreme keeps the test fast; the bench's --fit uses all 21 (same result)
    rows = [r for r in rows if r["id"].endswith(("-8g", "-128g", "-576g", "-2304g", "-32g-proxy", "-2048g"))]

    def rms(eta: float) -> float:
        with cal.sustained({"SUSTAINED_HOPPER": eta}):
            return float(np.sqrt(np.mean(_errors(rows) ** 2)))
    here = rms(K.SUSTAINED_HOPPER)
    assert here <= rms(K.SUSTAINED_HOPPER - 0.02) and here <= rms(K.SUSTAINED_HOPPER + 0.02)


def test_sustained_context_restores_the_constants():
    before = dict(K.ARCH)
    with pytest.raises(RuntimeError):
        with cal.sustained({"SUSTAINED_HOPPER": 0.5}):
            assert K.ARCH["h100"].sustained == 0.5 and K.ARCH["b200"].sustained == 0.5
            raise RuntimeError
    assert K.ARCH == before
