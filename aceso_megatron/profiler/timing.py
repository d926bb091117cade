"""Timing harness of the profiler: warm-up, repeats, median and spread, on CPU or GPU.

On a GPU each repeat is bracketed by CUDA events (the kernels' time, not the launch overhead) and read after a
``torch.cuda.synchronize``; on CPU by ``time.perf_counter``. Before every repeat the ranks meet at a barrier (the
caller's group), so a tensor-parallel unit's time does not include waiting for a late peer. The median is the
reported value (robust to the odd preempted repeat on a shared CPU); the spread is the interquartile range
relative to the median, kept so a noisy measurement can be recognised in the database.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Stats:
    """Summary of repeated measurements, microseconds."""

    median_us: float
    spread: float          # (q75 - q25) / median
    repeats: int
    samples: tuple[float, ...] = ()

    @classmethod
    def of(cls, samples_us: list[float]) -> Stats:
        a = np.asarray(samples_us, dtype=float)
        med = float(np.median(a))
        q25, q75 = np.percentile(a, [25, 75])
        return cls(med, float((q75 - q25) / med) if med > 0 else 0.0, len(a), tuple(float(v) for v in a))


class Clock:
    """Marks points in time on the device and returns the intervals between them in microseconds."""

    def __init__(self, device: str):
        self.cuda = device == "cuda"
        self._marks: list = []

    def start(self) -> None:
        self._marks = []
        self.mark()

    def mark(self) -> None:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self._marks.append(ev)
        else:
            self._marks.append(time.perf_counter())

    def intervals_us(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
            return [1e3 * a.elapsed_time(b) for a, b in zip(self._marks, self._marks[1:])]
        return [1e6 * (b - a) for a, b in zip(self._marks, self._marks[1:])]


def repeat(step, num_phases: int, warmup: int, repeats: int, device: str, group=None) -> list[Stats]:
    """Run ``step(clock)`` ``warmup + repeats`` times; ``step`` calls ``clock.mark()`` after each of its
    ``num_phases`` phases (e.g. forward, backward). Returns one ``Stats`` per phase over the timed repeats."""
    clock = Clock(device)
    samples: list[list[float]] = [[] for _ in range(num_phases)]
    for i in range(warmup + repeats):
        if group is not None:
            dist.barrier(group=group)
        if clock.cuda:
            torch.cuda.synchronize()
        clock.start()
        step(clock)
        got = clock.intervals_us()
        if len(got) != num_phases:
            raise RuntimeError(f"timing step marked {len(got)} phases, expected {num_phases}")
        if i >= warmup:
            for k, v in enumerate(got):
                samples[k].append(v)
    return [Stats.of(s) for s in samples]
