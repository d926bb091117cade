"""Exposed and hidden time of the tensor-parallel collectives of one sub-layer half (attention or MLP).

A half has a column-parallel GEMM ``col`` (QKV / fc1) and a row-parallel GEMM ``row`` (projection / fc2)
(Shoeybi et al. 2019, fig. 3). With X = the half's full activation (dt s b h bytes) on a TP group of t ranks,
ring times from ``comm.py`` (an all-reduce is an all-gather plus a reduce-scatter of the same volume):

    no SP   forward   all-reduce of the row output                                   blocking
            backward  all-reduce of the col input gradient
    SP      forward   all-gather of the col input, reduce-scatter of the row output  blocking
            backward  all-gather of the row output gradient (blocking), all-gather of the col input again (its
                      weight gradient needs the full input; megatron keeps only the shard), reduce-scatter of the
                      col input gradient (Korthikanti et al. 2023, section 4.2.2)

Overlap (``mode``):
- ``none``: everything exposed (Megatron-LM of 2021; the v1 model).
- ``dgrad`` (megatron-core ``LinearWithGradAccumulationAndAsyncCommunication``, ``RunSettings.overlap_tp_dgrad``):
  the col backward launches the re-gather async before its input-gradient GEMM and the all-reduce /
  reduce-scatter async before its weight-gradient GEMM: each exposes ``max(0, c - g)``.
- ``te`` (transformer-engine userbuffers, ``tp_comm_overlap``; TE's default ``initialize_ub`` methods):
  ``ring_exchange`` for the col forward all-gather and the row backward all-gather: t chunks, the GEMM of chunk i
  while chunk i+1 moves: ``g/t + (t-1) max(g/t, c/(t-1))``; ``pipeline`` for the row forward reduce-scatter:
  ``TE_SPLITS`` (4) GEMM chunks on the SMs left by ``TE_SMS`` (16) communication SMs, each chunk's
  reduce-scatter behind the next chunk; ``bulk`` for the col backward (re-gather behind the input-gradient GEMM,
  reduce-scatter behind the weight-gradient GEMM), also on ``TE_SMS`` SMs: ``max(g', c)``.
Low precision (``ag``, ``amax``; ``precision.sp_gather_bytes`` / ``amax_reductions``): transformer-engine gathers
the quantized tensors, so each of the three all-gathers has its own volume (the reduce-scatters stay ``dt``), and
current scaling adds one blocking all-reduce of one fp32 amax per gathered tensor in each direction.
Exposed = the overlapped pair's time minus the GEMM's own (so it includes the GEMM slow-down); hidden = the rest of
the communication. NCCL-run overlap (``dgrad``) also slows the GEMM it hides behind: ``tax`` x hidden is exposed
(``comm.overlap_tax``). GEMM windows come from the kernel model (``gemm_parts``: forward, input-gradient,
weight-gradient).
"""

from __future__ import annotations

from typing import NamedTuple

TE_SPLITS = 4       # transformer-engine add_ub(num_splits=4)
TE_SMS = 16         # transformer-engine add_ub(num_sm=16) for pipeline / bulk overlaps


class TPComm(NamedTuple):
    fwd: float       # exposed in the forward
    bwd: float       # exposed in the backward
    hidden: float    # behind GEMMs (forward + backward)
    hidden_fwd: float = 0.0   # the part of ``hidden`` behind forward GEMMs (only transformer-engine overlaps those)


def _ring(g: float, c: float, t: int) -> float:
    return g / t + (t - 1) * max(g / t, c / (t - 1))


def _pipeline(g: float, c: float, n: int) -> float:
    return g / n + (n - 1) * max(g / n, c / n) + c / n


def tp_half(comm, kern, col: tuple, row: tuple, x_bytes: float, t: int, sp: bool, mode: str,
            sms: int, tax: float = 0.0, ag: tuple[float, float, float] | None = None,
            amax: float = 0.0) -> TPComm:
    """Exposed / hidden TP communication of one half; ``col``/``row`` = the GEMM shapes ``(m, n, k)``.
    ``ag``: bytes of the SP all-gathers (forward col input, backward row output gradient, backward col input
    re-gather; default ``x_bytes`` each); ``amax``: exposed ms per direction of the amax all-reduces (SP only)."""
    if t <= 1:
        return TPComm(0.0, 0.0, 0.0)
    if not sp:
        ar = comm.all_reduce(x_bytes, t)
        if mode == "none":
            return TPComm(ar, ar, 0.0)
        wg = kern.gemm_parts(*col)[2]
        return TPComm(ar, max(0.0, ar - wg) + tax * min(ar, wg), min(ar, wg))
    a_x, a_dy, a_re = (comm.all_gather(v, t) for v in (ag or (x_bytes,) * 3))
    rs = comm.reduce_scatter(x_bytes, t)
    total = a_x + a_dy + a_re + 2 * rs
    if mode == "none":
        return TPComm(a_x + rs + amax, a_dy + a_re + rs + amax, 0.0)
    c_f, c_d, c_w = kern.gemm_parts(*col)
    r_f, r_d, _ = kern.gemm_parts(*row)
    if mode == "dgrad":
        hid = min(a_re, c_d) + min(rs, c_w)
        fwd, bwd = a_x + rs, a_dy + max(0.0, a_re - c_d) + max(0.0, rs - c_w) + tax * hid
    else:
        slow = sms / (sms - TE_SMS)
        fwd = (_ring(c_f, a_x, t) - c_f) + (_pipeline(r_f * slow, rs, TE_SPLITS) - r_f)
        bwd = (_ring(r_d, a_dy, t) - r_d) + (max(c_d * slow, a_re) - c_d) + (max(c_w * slow, rs) - c_w)
    hidden = max(0.0, total - fwd - bwd + (tax * hid if mode == "dgrad" else 0.0))
    hidden_fwd = 0.0 if mode == "dgrad" else min(hidden, max(0.0, a_x + rs - fwd))   # forward volume a_x + rs
    return TPComm(fwd + amax, bwd + amax, hidden, hidden_fwd)
