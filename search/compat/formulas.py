"""The reference cost model's formulas (SPEC §3), shared by the config evaluator and ``CompatCostModel``.

Per stage and micro-batch (µs, reported in ms)::

    t_i = Σ fwd + Σ bwd + Σ_{rc ops} fwd + In(o_1)/BW(In(o_1)) + Out(o_n)/BW(Out(o_n)) (+ resharding)

with the reference's bandwidth lookup (§3.4): ``idx = int(log2(size))``, minus one when ``idx >= 1`` (the
off-by-one), clamped to the last entry; a negative index (size < 1 MB) wraps like Python's; GB/s x 0.001 is
taken as MB/µs. 1F1B (§3.6): ``T_i = (M-1) t_i + Σ_j t_j``, iteration = max_i T_i.

Memory per GPU (§3.7), MB, with A' the activations after the shared-space rule (``enc-attention-dropout`` x1.5,
``enc-attention-softmax`` 0)::

    normal = 8 W + (In(o_1) + Σ A' - S) (behind + 1) + P          (8 W: fp16 weights, fp32 master, grads, Adam)
    S      = Σ_{k<n: rc_k = rc_{k+1} = 1, o_{k+1} not enc-1st-layernorm} A'_k      (freed by recompute)
    P      = max over runs of Σ_{k: rc_k = rc_{k+1} = 1} A'_k, a run ending after an op that precedes
             enc-1st-layernorm or a non-recomputed op                              (re-materialisation peak)
    R      = max(max_{k<n} Rf_k + max_{k<n} Rb_k, W)                               (reserved; last op excluded)
    total  = normal + R

Note the asymmetry the golden values pin down: the op just before ``enc-1st-layernorm`` is not freed (S) but
counts in the peak (P). No DP all-reduce, optimizer step or tied-embedding sync is modelled (§3.5).
"""

from __future__ import annotations

import math

import numpy as np

STATIC_BYTES_FACTOR = 8.0   # fp16 weights (1) + fp32 master (2) + fp16 grads (1) + fp32 Adam m, v (4), x W (fp16)
DROPOUT_FACTOR = 1.5
SHARED_SPACE = {"enc-attention-dropout": DROPOUT_FACTOR, "enc-attention-softmax": 0.0}


def shared_space_factors(names) -> np.ndarray:
    """Per op: the factor on its profiled activations (consider_shared_space, on by default)."""
    return np.array([SHARED_SPACE.get(n, 1.0) for n in names])


def p2p_us(size_mb: float, bw_gbps: np.ndarray) -> float:
    """Reference p2p time of one boundary transfer, µs (one transfer per boundary per micro-batch)."""
    if size_mb <= 0:
        return 0.0
    idx = int(math.log2(size_mb))
    if idx >= 1:
        idx -= 1
    idx = min(idx, len(bw_gbps) - 1)
    return size_mb / (float(bw_gbps[idx]) * 0.001)


def stage_memory(weights_mb: float, input_mb: float, act: np.ndarray, rf: np.ndarray, rb: np.ndarray,
                 flags: np.ndarray, seg_start: np.ndarray, behind: int) -> dict[str, float]:
    """Memory of one stage (MB per GPU); ``act`` already carries the shared-space factors.

    Returns total, normal, reserved and the parts: static (8 W), activations (in flight), recompute_peak.
    """
    act_total, reserved = memory_fixed_terms(weights_mb, act, rf, rb)
    freed, peak = recompute_terms(act, flags, seg_start)
    return combine_memory(weights_mb, input_mb, act_total, reserved, freed, peak, behind)


def memory_fixed_terms(weights_mb: float, act: np.ndarray, rf: np.ndarray, rb: np.ndarray) -> tuple[float, float]:
    """The terms recompute does not change: (Σ A', reserved R)."""
    reserved = max(float(rf[:-1].max()) + float(rb[:-1].max()), weights_mb) if len(act) > 1 else weights_mb
    return float(act.sum()), reserved


def recompute_terms(act: np.ndarray, flags: np.ndarray, seg_start: np.ndarray) -> tuple[float, float]:
    """(S, P): the activations recompute frees and the re-materialisation peak, for op flags ``flags``."""
    if len(act) <= 1:
        return 0.0, 0.0
    flags = np.asarray(flags, dtype=bool)
    both = flags[:-1] & flags[1:]
    start_next = seg_start[1:]
    freed = float(act[:-1][both & ~start_next].sum())
    contrib = np.where(both, act[:-1], 0.0)
    reset = ~both | start_next                   # the run ends after op k
    seg_id = np.cumsum(reset) - reset
    peak = float(np.bincount(seg_id, weights=contrib).max())
    return freed, peak


def combine_memory(weights_mb: float, input_mb: float, act_total: float, reserved: float, freed: float,
                   peak: float, behind: int) -> dict[str, float]:
    """``stage_memory`` from its terms."""
    kept = input_mb + act_total - freed
    static = STATIC_BYTES_FACTOR * weights_mb
    normal = static + kept * (behind + 1) + peak
    return {"total": normal + reserved, "normal": normal, "reserved": reserved, "static": static,
            "weights": weights_mb, "activations": kept * (behind + 1), "recompute_peak": peak}


def pipeline_1f1b(stage_ms: list[float], num_micro_batches: int) -> list[float]:
    """Each stage's 1F1B total: (M-1) t_i + Σ_j t_j (ms)."""
    total = sum(stage_ms)
    return [(num_micro_batches - 1) * t + total for t in stage_ms]
