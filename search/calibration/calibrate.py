"""``aceso calibrate``: fit the analytic model's GPU and link fields to the user's own short runs.

A run is a configuration (a Megatron-LM launch script, read as ``aceso import --from megatron-lm`` reads it, or an
aceso plan) plus its log (``search.calibration.megatron_log``). Each run is priced exactly as ``aceso explain`` prices it
(``price``: the plan's training spec; Megatron-LM's ``RunSettings`` for a script, the runtime's for a plan) on a
cluster whose fields ``search.costmodel.calibration.scaled_cluster`` scales by four factors: GEMM peak, fused attention,
intra-node and inter-node bandwidth. The fit minimises ``sum_i log(pred_i / meas_i)^2 + PRIOR sum_j log(f_j)^2``
by damped Gauss-Newton with a finite-difference Jacobian: a factor no run exercises (the network, for one-node
runs) has a zero column and keeps its default, and with fewer runs than factors the small prior picks the
smallest change that explains them (mostly GEMM, where the time is). No factor goes beyond the hardware
(``upper_bounds``: kernels at most their microbenchmark ceilings, links at most the datasheet). The memory reserve
is the default ``RESERVE_MB`` plus the largest measured-minus-predicted peak of any run (the conservative side:
the run needed it).

Before pricing, a log is checked against its configuration (``check_log``). A Megatron-LM log must say which run
it is -- the model (the arguments block's ``num_layers``, ``hidden_size``, ``num_attention_heads``,
``seq_length``, or the logged throughput), the cluster (``world_size``, or the throughput) and the global batch
size -- else it is refused naming what is missing; then the arguments it prints (model shape, experts, MTP,
parallel sizes, batch, world size) and the logged global batch size must match the script, and the logged
throughput must be what Megatron-LM's own ``num_floating_point_operations`` (core_v0.16.1: dense, MoE, MLA and
MTP layers, ``search.megatron.flops``) gives for the script's model at the logged time: otherwise it is a log of
another model or cluster. An aceso train log names its plan by digest (its run record), which must be the plan's.

The fit's factors stay within the hardware for a datasheet preset; a nominal one (``cluster.NOMINAL_PRESETS``:
the ``cpu`` preset describes no particular machine) is fitted from 1/10^4 to 10^4 of its numbers (kernels at most
the whole nominal peak), so a CPU run calibrates it to the machine it ran on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from search.costmodel.calibration import (
    CalibrationFile, GPUCalibration, RunResidual, apply_calibration, defaults, scaled_cluster,
)
from search.spec.cluster import ClusterSpec
from search.io.errors import AcesoError
from search.calibration.megatron_log import MeasuredRun
from search.megatron.flops import num_floating_point_operations
from search.pricing import price as price_plan
from search.spec.plan import ParallelPlan

PRIOR = 1e-3          # weight of log(factor)^2 against log(pred/meas)^2: a 3% factor change costs a 0.1% residual
FACTORS = ("gemm", "attention", "intra", "inter")
STEP = 0.02           # finite-difference step in log(factor)
BOUND = math.log(4.0)  # factors stay above 1/4 of the defaults, and below the hardware (upper_bounds)
NOMINAL = 1e4          # a nominal preset's factors: within 10^-4 .. 10^4 (lower_bound, upper_bounds)
TPUT_TOLERANCE = 0.03  # logged vs recomputed throughput (the log rounds to 0.1 TFLOP/s; vocab padding by tp)


@dataclass
class Run:
    label: str
    plan: ParallelPlan          # with the (uncalibrated) cluster it ran on
    attention: str | None
    framework: str              # "megatron-lm" (a launch script) or "runtime" (an aceso plan)
    measured: MeasuredRun
    settings: object = None     # a RunSettings other than the framework's (the benchmark's 2021/2022 rows)
    digest: str | None = None   # an aceso plan's ParallelPlan.digest (of the file, before --cluster replaced it)


def price(run: Run, cluster: ClusterSpec):
    """The run's ``PlanCost`` on ``cluster``: the one price (``search.pricing``, as ``aceso explain`` prices it) as
    the run's framework runs the plan."""
    return price_plan(run.plan, run.framework, cluster=cluster, attention=run.attention or "auto", run=run.settings)


# ----- is this log the run of this configuration? ------------------------------------------------------------------
def megatron_flops(plan: ParallelPlan, padded_vocab: int) -> float:
    """Megatron-LM's ``num_floating_point_operations`` of one global batch of ``plan`` (search.megatron.flops)."""
    return num_floating_point_operations(plan.model, plan.global_batch_size, padded_vocab)


def _none(value):
    return value or None     # Megatron-LM prints an unset count as None (no experts, no MTP)


ARG_CHECKS = (("num_layers", lambda p, c: p.model.num_layers, "model"),
              ("hidden_size", lambda p, c: p.model.hidden_size, "model"),
              ("num_attention_heads", lambda p, c: p.model.num_attention_heads, "model"),
              ("seq_length", lambda p, c: p.model.seq_length, "model"),
              ("ffn_hidden_size", lambda p, c: p.model.ffn_hidden_size, "model"),
              ("num_experts", lambda p, c: _none(p.model.moe and p.model.moe.num_experts), "model"),
              ("mtp_num_layers", lambda p, c: _none(p.model.mtp_num_layers), "model"),
              ("global_batch_size", lambda p, c: p.global_batch_size, "model"),
              ("tensor_model_parallel_size", lambda p, c: p.stages[0].tp, "cluster"),
              ("pipeline_model_parallel_size", lambda p, c: p.num_stages, "cluster"),
              ("world_size", lambda p, c: c.num_gpus, "cluster"))
MODEL_ARGS = ("num_layers", "hidden_size", "num_attention_heads", "seq_length")   # what names the model


def identity_gaps(meas: MeasuredRun) -> list[str]:
    """What a Megatron-LM log lacks to say which run it is (model, cluster, global batch), each with where it would
    be; empty when it says all three."""
    gaps, args, tput = [], meas.arguments, meas.tflops_per_gpu is not None
    missing = [k for k in MODEL_ARGS if k not in args]
    if missing and not tput:
        gaps.append(f"model (arguments {', '.join(missing)}, or the throughput per GPU of --log-throughput)")
    if "world_size" not in args and not tput:
        gaps.append("cluster (argument world_size, or the throughput per GPU)")
    if meas.global_batch_size is None and "global_batch_size" not in args:
        gaps.append("global batch size (the iteration lines' 'global batch size', or argument global_batch_size)")
    return gaps


def check_log(run: Run, cluster: ClusterSpec, padded_vocab: int | None) -> None:
    """AcesoError when the log is not a run of ``run.plan`` on ``cluster`` (module docstring)."""
    meas, plan, src = run.measured, run.plan, run.measured.source
    if run.framework == "runtime":
        digest = run.digest or plan.digest()
        if meas.run is None or meas.run["plan_digest"] != digest:
            got = meas.run["plan_digest"] if meas.run else "none"
            raise AcesoError(f"{src}: the log is of plan {got} but {run.label.split(' + ')[0]} is plan {digest}: a "
                             "log of another plan; give the log of the run of this plan")
        return
    if gaps := identity_gaps(meas):
        raise AcesoError(f"{src}: the log does not say which run it is: no {'; no '.join(gaps)}; give the run's "
                         "complete stdout (Megatron-LM prints its arguments first)")
    for key, want, what in ARG_CHECKS:
        got = meas.arguments.get(key)
        if got is not None and got != str(want(plan, cluster)):
            raise AcesoError(f"{src}: the log's {key} is {got} but {run.label} has {want(plan, cluster)}: a log of "
                             f"another {what}; give the log of this run")
    if meas.global_batch_size is not None and meas.global_batch_size != plan.global_batch_size:
        raise AcesoError(f"{src}: the log's global batch size is {meas.global_batch_size} but {run.label} has "
                         f"{plan.global_batch_size}: a log of another run; give the log of this run")
    if meas.tflops_per_gpu is None or not meas.tflops_at_ms or plan.model.is_t5:
        return
    flops = megatron_flops(plan, padded_vocab)
    expect = flops / (meas.tflops_at_ms / 1e3) / cluster.num_gpus / 1e12
    if abs(meas.tflops_per_gpu / expect - 1) > TPUT_TOLERANCE and abs(meas.tflops_per_gpu - expect) > 0.1:
        raise AcesoError(f"{src}: the log's throughput ({meas.tflops_per_gpu:.1f} TFLOP/s/GPU at "
                         f"{meas.tflops_at_ms:.1f} ms) is not {run.label}'s model on {cluster.num_gpus} GPUs "
                         f"({expect:.1f}): a log of another model or cluster; give the log of this run")


# ----- the fit -----------------------------------------------------------------------------------------------------
def _cluster(base: ClusterSpec, x: np.ndarray) -> ClusterSpec:
    return scaled_cluster(base, *np.exp(x))


def _residuals(runs: list[Run], x: np.ndarray) -> np.ndarray:
    return np.array([math.log(price(r, _cluster(r.plan.cluster, x)).iteration_ms / r.measured.iteration_ms)
                     for r in runs])


def jacobian(runs: list[Run], x: np.ndarray, r: np.ndarray | None = None, cols=None) -> np.ndarray:
    """d log(pred_i) / d log(factor_j) at ``x`` (forward differences; only ``cols`` where given)."""
    r = _residuals(runs, x) if r is None else r
    jac = np.zeros((len(runs), len(FACTORS)))
    for j in range(len(FACTORS)):
        if cols is not None and not cols[j]:
            continue
        dx = x.copy()
        dx[j] += STEP
        jac[:, j] = (_residuals(runs, dx) - r) / STEP
    return jac


def upper_bounds(gpu: str) -> np.ndarray:
    """log of the largest physical factors: kernels at their microbenchmark ceilings (``sustained`` 1), links at
    the datasheet bandwidth (``LINK_EFFICIENCY`` 1). A nominal preset has no datasheet: kernels up to the whole
    nominal peak, links up to 10^4 x."""
    from search.spec.cluster import NOMINAL_PRESETS
    from search.costmodel.comm import LINK_EFFICIENCY
    from search.costmodel.kernels import arch
    a = arch(gpu)
    if gpu in NOMINAL_PRESETS:
        return np.log([1 / (a.gemm_max * a.sustained), 1 / ((a.attn_fwd or 1.0) * a.sustained), NOMINAL, NOMINAL])
    return np.log([1 / a.sustained, 1 / a.sustained, 1 / LINK_EFFICIENCY, 1 / LINK_EFFICIENCY])


def lower_bound(gpu: str) -> float:
    """log of the smallest factor: 1/4 of a datasheet preset, 1/10^4 of a nominal one."""
    from search.spec.cluster import NOMINAL_PRESETS
    return -math.log(NOMINAL) if gpu in NOMINAL_PRESETS else -BOUND


def _clip(x: np.ndarray, hi: np.ndarray, lo: float = -BOUND) -> np.ndarray:
    x = np.clip(x, lo, hi)
    x[1] = min(x[1], hi[1] - x[0])        # attention's factor is relative to the GEMM's
    return x


def _bounded_step(x: np.ndarray, r: np.ndarray, jac: np.ndarray, free: np.ndarray, hi: np.ndarray,
                  lo: float = -BOUND) -> np.ndarray:
    """One regularised Gauss-Newton step within the bounds: a factor the step would push past its bound is pinned
    there (the residuals moved by its linearised effect) and the step re-solved for the others (an active set)."""
    x, r, active = x.copy(), r.copy(), free.copy()
    while active.any():
        jf = jac[:, active]
        step = np.linalg.solve(jf.T @ jf + PRIOR * np.eye(jf.shape[1]), -(jf.T @ r + PRIOR * x[active]))
        trial = x.copy()
        trial[active] += step
        clipped = _clip(trial.copy(), hi, lo)
        hit = active & ~np.isclose(clipped, trial, rtol=0, atol=1e-12)
        if not hit.any():
            return clipped
        r = r + jac[:, hit] @ (clipped[hit] - x[hit])
        x[hit] = clipped[hit]
        active &= ~hit
    return x


def fit_factors(runs: list[Run], iterations: int = 6, jac: np.ndarray | None = None) -> tuple[np.ndarray, list[str]]:
    """log(factor) per ``FACTORS`` and the names of those some run exercised. With ``jac`` (the runs' Jacobian,
    e.g. at the defaults) it stays frozen and each iteration re-prices the runs once (a chord method)."""
    hi, lo = upper_bounds(runs[0].plan.cluster.gpu.name), lower_bound(runs[0].plan.cluster.gpu.name)
    x = np.zeros(len(FACTORS))
    frozen = jac is not None
    free = np.ones(len(FACTORS), bool) if jac is None else np.abs(jac).max(axis=0) > 1e-4
    for it in range(iterations):
        r = _residuals(runs, x)
        if not frozen:
            jac = jacobian(runs, x, r, None if it == 0 else free)
            if it == 0:
                free = np.abs(jac).max(axis=0) > 1e-4
        before = x.copy()
        x = _bounded_step(x, r, jac, free, hi, lo)
        if np.max(np.abs(x - before)) < 1e-4:
            break
    return x, [FACTORS[j] for j in range(len(FACTORS)) if free[j]]


def at_bounds(x: np.ndarray, gpu: str) -> list[str]:
    """The factors at a bound of the fit (``upper_bounds``, ``lower_bound``; attention's upper bound is relative
    to the GEMM's, ``_clip``): a factor the runs exercised that stops there is pinned, not determined."""
    hi, lo = upper_bounds(gpu), lower_bound(gpu)
    top = hi.copy()
    top[1] = min(hi[1], hi[1] - x[0])
    near = lambda a, b: math.isclose(a, b, rel_tol=0, abs_tol=1e-9)   # noqa: E731
    return [FACTORS[j] for j in range(len(FACTORS)) if near(x[j], top[j]) or near(x[j], lo)]


def calibrate_gpu(runs: list[Run], jac: np.ndarray | None = None, iterations: int = 6) -> GPUCalibration:
    """One GPU type's calibration from its runs, with each run's residuals before and after."""
    x, exercised = fit_factors(runs, iterations, jac)
    gemm, attn, intra, inter = np.exp(x)
    base = runs[0].plan.cluster
    pinned = [f for f in at_bounds(x, base.gpu.name) if f in exercised]
    fitted = [f for f in exercised if f not in pinned]
    d = defaults(base.gpu.name, base.intra_node_gbps, base.inter_node_gbps)
    over = []
    for r in runs:
        if r.measured.memory_mb is not None:
            over.append(r.measured.memory_mb - price(r, _cluster(r.plan.cluster, x)).max_memory_mb)
    reserve = max(0.0, d["memory_reserve_mib"] + max(over)) if over else d["memory_reserve_mib"]
    calib = GPUCalibration(
        gemm_efficiency=min(1.0, d["gemm_efficiency"] * gemm),
        attention_efficiency=min(1.0, d["attention_efficiency"] * gemm * attn),
        intra_node_gbps=d["intra_node_gbps"] * intra if "intra" in exercised else None,
        inter_node_gbps=d["inter_node_gbps"] * inter if "inter" in exercised else None,
        memory_reserve_mib=round(reserve, 1), fitted=fitted + (["memory_reserve"] if over else []), pinned=pinned)
    file = CalibrationFile(gpus={base.gpu.name: calib})
    calib.runs = [residual(r, file) for r in runs]
    return calib


def residual(run: Run, file: CalibrationFile) -> RunResidual:
    """The run priced with the defaults and with ``file`` (through ``apply_calibration``, as every command)."""
    from search.costmodel.memory import RESERVE_MB
    before = price(run, run.plan.cluster)
    after = price(run, apply_calibration(run.plan.cluster, file))
    extra = file.gpus[run.plan.cluster.gpu.name].memory_reserve_mib - RESERVE_MB   # the budget carries it
    m = run.measured
    return RunResidual(run=run.label, cluster=run.plan.cluster.label, measured_iteration_ms=m.iteration_ms,
                       predicted_before_ms=before.iteration_ms, predicted_after_ms=after.iteration_ms,
                       error_before=before.iteration_ms / m.iteration_ms - 1,
                       error_after=after.iteration_ms / m.iteration_ms - 1, measured_memory_mb=m.memory_mb,
                       predicted_memory_before_mb=before.max_memory_mb if m.memory_mb is not None else None,
                       predicted_memory_after_mb=after.max_memory_mb + extra if m.memory_mb is not None else None)


def calibrate(runs: list[Run]) -> CalibrationFile:
    """The calibration file of ``runs``, one entry per GPU type."""
    by_gpu: dict[str, list[Run]] = {}
    for r in runs:
        by_gpu.setdefault(r.plan.cluster.gpu.name, []).append(r)
    return CalibrationFile(gpus={g: calibrate_gpu(rs) for g, rs in sorted(by_gpu.items())})
