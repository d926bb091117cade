"""The two fits of the analytic model's sustained-efficiency factors on the published runs, and their statistics.

The only fitted constants are ``kernels.py``'s ``SUSTAINED_HOPPER`` and ``SUSTAINED_AMPERE`` (one per GPU generation,
multiplying its GEMM and attention ceilings). They are fitted two ways, and both are reported (bench/published_runs.py):

- **Fit 1, fully specified** (the constants in ``kernels.py``): only calibration rows whose sources state every setting
  the model prices (``PRICED``; ``fully_specified``), so that nothing about the run is chosen by us. Least squares of
  the relative throughput errors, equal weights.
- **Fit 2, nuisance** (``NUISANCE_FIT``): every calibration row. A setting the sources do not state (micro-batch,
  virtual stages, recompute) is a nuisance parameter, fitted per row within the values Megatron accepts for it
  (profiled: among the configurations that fit memory, the one whose prediction is nearest the measurement), not
  chosen by the model as the fastest (that flatters the model: the old H100 factor absorbed it, the README rows'
  fastest configurations being ~10% faster than the runs). A row with unknowns so constrains the factor only when
  its measurement lies outside the range its configurations span; a fully specified row constrains it always,
  so the rows that publish every setting weigh most, as they should.

Fit either with ``python bench/published_runs.py --fit`` (slow: every option of every row, per trial).
"""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np

from search.costmodel import kernels as K

# settings the analytic model prices that a row's sources may leave unstated (bench/data/README.md, "unknown")
PRICED = ("micro_batch_size", "vpp", "recompute", "sequence_parallel", "distributed_optimizer", "overlap_grad_reduce",
          "overlap_param_gather", "tp_comm_overlap", "precision")
FIT_GPUS = {"h100": ("SUSTAINED_HOPPER", ("h100", "h200", "b200", "gb200")),
            "a100": ("SUSTAINED_AMPERE", ("a100", "a100-40gb"))}
NUISANCE_FIT = {"SUSTAINED_HOPPER": 0.82, "SUSTAINED_AMPERE": 0.81}   # the last ``--fit`` (fit 2), docs/costmodel.md


def fully_specified(row: dict) -> bool:
    """The row's sources state every setting the analytic model prices."""
    return not set(row["unknown"]) & set(PRICED)


def current() -> dict[str, float]:
    return {"SUSTAINED_HOPPER": K.SUSTAINED_HOPPER, "SUSTAINED_AMPERE": K.SUSTAINED_AMPERE}


@contextmanager
def sustained(values: dict[str, float]):
    """Price with these sustained factors (``{"SUSTAINED_HOPPER": x, ...}``) instead of kernels.py's."""
    saved = dict(K.ARCH)
    try:
        for gpu, (const, names) in FIT_GPUS.items():
            if const in values:
                for g in names:
                    K.ARCH[g] = saved[g]._replace(sustained=values[const])
        yield
    finally:
        K.ARCH.clear()
        K.ARCH.update(saved)


def _golden(f, lo: float = 0.55, hi: float = 1.0, tol: float = 0.005) -> tuple[float, float]:
    g = (5 ** 0.5 - 1) / 2
    a, b = hi - g * (hi - lo), lo + g * (hi - lo)
    fa, fb = f(a), f(b)
    while hi - lo > tol:
        if fa < fb:
            hi, b, fb = b, a, fa
            a = hi - g * (hi - lo)
            fa = f(a)
        else:
            lo, a, fa = a, b, fb
            b = lo + g * (hi - lo)
            fb = f(b)
    return round((lo + hi) / 2, 2), min(fa, fb)


def fit(runs_by_gpu: dict[str, list[dict]], evaluate) -> dict[str, float]:
    """Each generation's factor minimising the RMS relative error of its rows; ``evaluate(row)`` prices one row
    (its nuisance settings profiled) under the factors in force."""
    out = {}
    for gpu, (const, _) in FIT_GPUS.items():
        runs = runs_by_gpu.get(gpu, [])
        if not runs:
            continue

        def rms(eta: float) -> float:
            with sustained({const: eta}):
                rows = [r for r in map(evaluate, runs) if "error" in r]
            return float(np.sqrt(np.mean([r["error"] ** 2 for r in rows])))
        out[const], err = _golden(rms)
        print(f"{const} = {out[const]:.2f}  (RMS error {err:.3f} on {len(runs)} {gpu} rows)")
    return out


def in_stats(r: dict) -> bool:
    return "error" in r and r["stock_megatron"]


def summarize(rows: list[dict]) -> dict:
    """MAE, max |error|, bias by GPU and 'every run fits' of each set, all rows and the fully specified ones."""
    out = {}
    for s in ("calibration", "check"):
        for only_full in (False, True):
            sel = [r for r in rows if in_stats(r) and r["set"] == s and (r["fully_specified"] or not only_full)]
            if not sel:
                continue
            e = np.array([r["error"] for r in sel])
            worst = sel[int(np.argmax(np.abs(e)))]["id"]
            out[s + (" (fully specified)" if only_full else "")] = {
                "rows": len(sel), "mae": float(np.mean(np.abs(e))), "max_abs": float(np.max(np.abs(e))),
                "worst": worst, "bias_by_gpu": {g: float(np.mean([r["error"] for r in sel if r["gpu"] == g]))
                                                for g in sorted({r["gpu"] for r in sel})},
                "all_fit": all(r["fits"] for r in sel)}
    return out
