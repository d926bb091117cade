"""Which part of a stage-boundary activation each rank holds (pure arithmetic, no torch).

An activation crossing a stage boundary is ``[s, b, h]``: the sequence of one or more *segments* (GPT: one; a T5
decoder stage receives ``[encoder output; decoder hidden]``, two) and the stage's share of the pipeline
micro-batch. A rank of a stage with ``(tp, cp, dp, sequence_parallel)`` holds:

- along the batch: its DP replica's samples ``[j*mb/dp, (j+1)*mb/dp)``;
- along the sequence, per segment of length ``L``: with context parallelism the two chunks ``c`` and
  ``2*cp-1-c`` of the ``2*cp`` chunks of ``L / (2*cp)`` tokens (megatron-core's load-balanced causal split,
  ``get_batch_on_this_cp_rank``), concatenated; then with sequence parallelism the ``t``-th of ``tp`` equal
  contiguous parts of that local sequence (megatron-core's ``scatter_to_sequence_parallel_region``); without it
  the whole local sequence, identical on the stage's TP ranks.

A ``Holding`` lists the global sequence intervals of the rank's local tensor in local order, so any two layouts
can be matched piece by piece (``aceso_megatron.parallel.p2p``).
"""

from __future__ import annotations

from dataclasses import dataclass

from search.spec.plan import ParallelPlan

from .layout import RankLayout, sample_range


@dataclass(frozen=True)
class Holding:
    """The samples ``batch = (lo, hi)`` and global sequence intervals ``seq`` (local order) a rank holds."""

    batch: tuple[int, int]
    seq: tuple[tuple[int, int], ...]

    @property
    def seq_len(self) -> int:
        return sum(hi - lo for lo, hi in self.seq)

    @property
    def batch_len(self) -> int:
        return self.batch[1] - self.batch[0]

    def local_seq(self, lo: int, hi: int) -> tuple[int, int]:
        """Positions in the local tensor of global tokens ``[lo, hi)`` (inside one of the intervals)."""
        off = 0
        for a, b in self.seq:
            if a <= lo and hi <= b:
                return off + lo - a, off + hi - a
            off += b - a
        raise ValueError(f"tokens [{lo}, {hi}) are not held in one piece by {self}")


def boundary_segments(plan: ParallelPlan, stage: int) -> tuple[int, ...]:
    """Sequence segments of the activation entering ``stage`` (T5: the encoder hidden state while the encoder
    runs, then encoder output and decoder hidden state)."""
    m = plan.model
    if not m.is_t5:
        return (m.seq_length,)
    if plan.stages[stage].start_unit > m.num_encoder_units:
        return (m.seq_length, m.decoder_seq_length)
    return (m.seq_length,)


def _take(parts: list[tuple[int, int]], lo: int, hi: int) -> list[tuple[int, int]]:
    """Global intervals of local positions ``[lo, hi)`` of the concatenation of ``parts``."""
    out, off = [], 0
    for a, b in parts:
        s, e = max(lo, off), min(hi, off + b - a)
        if s < e:
            out.append((a + s - off, a + e - off))
        off += b - a
    return out


def _merge(intervals: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    out: list[tuple[int, int]] = []
    for a, b in intervals:
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return tuple(out)


def holding(plan: ParallelPlan, lay: RankLayout, segments: tuple[int, ...]) -> Holding:
    """What rank ``lay`` holds of an activation with ``segments`` (its stage's CP, SP and DP)."""
    st = plan.stages[lay.stage]
    seq, off = [], 0
    for length in segments:
        parts = cp_intervals(length, st.cp, lay.cp_rank, off)
        if st.sequence_parallel:
            n = (length // st.cp) // st.tp
            parts = _take(parts, lay.tp_rank * n, (lay.tp_rank + 1) * n)
        seq += parts
        off += length
    return Holding(sample_range(plan.micro_batch_size, st.dp, lay.dp_rank), _merge(seq))


def cp_intervals(length: int, cp: int, cp_rank: int, offset: int = 0) -> list[tuple[int, int]]:
    """The tokens of a sequence of ``length`` that CP rank ``cp_rank`` of ``cp`` holds: chunks ``c`` and
    ``2*cp-1-c`` of ``2*cp`` (megatron-core's load balance for causal attention), in that order."""
    if cp == 1:
        return [(offset, offset + length)]
    q, c = length // (2 * cp), cp_rank
    return [(offset + c * q, offset + (c + 1) * q), (offset + (2 * cp - 1 - c) * q, offset + (2 * cp - c) * q)]


def cp_token_index(length: int, cp: int, cp_rank: int) -> list[int]:
    """Positions of ``cp_intervals`` as a flat index (to slice a batch's ``[b, s]`` tensors)."""
    return [i for lo, hi in cp_intervals(length, cp, cp_rank) for i in range(lo, hi)]
