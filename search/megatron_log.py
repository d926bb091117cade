"""Measurements of a finished short run, read from its log: Megatron-LM stdout or ``aceso train --log-file`` JSONL.

Megatron-LM core_v0.16.1 prints (megatron/training/training.py ``training_log``, the last rank, every
``--log-interval`` iterations and after the first)::

     [2026-01-02 03:04:05.678901] iteration       10/     100 | consumed samples:         5120 | elapsed time per
     iteration (ms): 4321.0 | throughput per GPU (TFLOP/s/GPU): 412.3 | learning rate: 1.000000E-04 | global batch
     size:   512 | lm loss: 7.123456E+00 | loss scale: 1.0 | grad norm: 1.234 | number of skipped iterations:   0 |
     number of nan iterations:   0 |

(one line), ``report_memory`` (megatron/training/utils.py; data-parallel rank 0 of every tp x pp rank)::

    [Rank 0] (after 10 iterations) memory (MB) | allocated: 1.00 | max allocated: 2.00 | reserved: 3.00 | max
    reserved: 4.00

and the ``arguments`` block of ``_print_args`` (arguments.py: ``  name ....... value`` between dashed title lines).
``read_megatron_log`` keeps the steady iteration time (the median of the interval lines after the first, which
pays for warm-up), the logged throughput, global batch size, the max ``max reserved`` over ranks and the printed
arguments; ``read_train_jsonl`` the same from aceso's own records (``max allocated`` per stage). A log that cannot
be a completed run is refused in one line: empty, no iteration line, NaN or inf numbers or nan iterations, a CUDA
out-of-memory error, a line cut off (an iteration line without its closing ``number of nan iterations`` field).
"""

from __future__ import annotations

import json
import math
import re
import statistics
from dataclasses import dataclass, field

from .errors import AcesoError
from .units import legacy_keys

_ITER = re.compile(r"^\s*(?:\[[^\]]*\]\s*)?iteration\s+(\d+)/\s*(\d+)\s*\|")
_MEM = re.compile(r"^\[Rank (\d+)\] \(after (\d+) iterations\) memory \(MB\) \| allocated: (\S+) \| max allocated: "
                  r"(\S+) \| reserved: (\S+) \| max reserved: (\S+)")
_ARG = re.compile(r"^  (\S+) \.+ (.*)$")
_OOM = re.compile(r"CUDA out of memory|OutOfMemoryError|out of memory", re.IGNORECASE)
_LAST_FIELD = "number of nan iterations"


@dataclass
class MeasuredRun:
    """One run's measurements (``memory_mb``: the peak over ranks; ``None`` when the log has none)."""

    source: str
    iteration_ms: float
    global_batch_size: int | None = None
    tflops_per_gpu: float | None = None     # the logged throughput of one interval ...
    tflops_at_ms: float | None = None       # ... whose iteration time was this
    memory_mb: float | None = None
    memory_kind: str = "max_reserved"
    arguments: dict[str, str] = field(default_factory=dict)
    intervals: int = 0


def _number(text: str, what: str, source: str, line: int) -> float:
    try:
        v = float(text)
    except ValueError:
        raise AcesoError(f"{source}: line {line}: {what} '{text}' is not a number; give the run's unedited log") \
            from None
    if not math.isfinite(v):
        raise AcesoError(f"{source}: line {line}: {what} is {text}: the run diverged or its timer failed; "
                         "calibrate with a run that trained normally")
    return v


def _fields(line: str) -> dict[str, str]:
    out = {}
    for part in line.split("|")[1:]:
        key, sep, val = part.partition(":")
        if sep:
            out[key.strip()] = val.strip()
    return out


def read_megatron_log(text: str, source: str) -> MeasuredRun:
    """The run's measurements from Megatron-LM's stdout (module docstring); AcesoError for a log that is not one."""
    if not text.strip():
        raise AcesoError(f"{source}: the log is empty; give the stdout of a finished Megatron-LM run")
    lines = text.splitlines()
    times: list[float] = []
    gbs = tput = None
    mem: list[float] = []
    args: dict[str, str] = {}
    in_args = False
    for n, line in enumerate(lines, 1):
        if _OOM.search(line):
            raise AcesoError(f"{source}: line {n}: the run ran out of GPU memory; calibrate with runs that completed "
                             "(a smaller micro-batch or more recompute)")
        if "------------------------ arguments ------------------------" in line:
            in_args = True
            continue
        if in_args:
            if "end of arguments" in line:
                in_args = False
            elif m := _ARG.match(line):
                args[m.group(1)] = m.group(2).strip()
            continue
        if m := _MEM.match(line):
            mem.append(_number(m.group(6), "max reserved", source, n))
            continue
        if "memory (MB)" in line and line.startswith("[Rank "):
            raise AcesoError(f"{source}: line {n}: the memory report is cut off (no 'max reserved' field); give the "
                             "complete log")
        if not _ITER.match(line):
            if n == len(lines) and not text.endswith("\n") and re.search(r"\biteration\s+\d", line):
                raise AcesoError(f"{source}: line {n}: the log ends inside an iteration line; give the complete log")
            continue
        if not line.rstrip().endswith("|") or _LAST_FIELD not in line:
            raise AcesoError(f"{source}: line {n}: the iteration line is cut off (no '{_LAST_FIELD}' field); give "
                             "the complete log")
        f = _fields(line)
        if "elapsed time per iteration (ms)" not in f:
            raise AcesoError(f"{source}: line {n}: no 'elapsed time per iteration (ms)' field; give Megatron-LM's "
                             "unedited stdout")
        times.append(_number(f["elapsed time per iteration (ms)"], "elapsed time per iteration", source, n))
        if int(_number(f[_LAST_FIELD], _LAST_FIELD, source, n)):
            raise AcesoError(f"{source}: line {n}: the run had NaN iterations (loss or gradients); calibrate with a "
                             "run that trained normally")
        for key, val in f.items():
            if val.lower() in ("nan", "inf", "-inf"):
                raise AcesoError(f"{source}: line {n}: {key} is {val}; calibrate with a run that trained normally")
        if "global batch size" in f:
            gbs = int(_number(f["global batch size"], "global batch size", source, n))
        if "throughput per GPU (TFLOP/s/GPU)" in f:
            tput = (_number(f["throughput per GPU (TFLOP/s/GPU)"], "throughput per GPU", source, n), times[-1])
    if not times:
        raise AcesoError(f"{source}: no 'elapsed time per iteration (ms)' line; give the stdout of a Megatron-LM run "
                         "that logged at least one interval (--log-interval)")
    steady = times[1:] if len(times) > 1 else times
    return MeasuredRun(source, statistics.median(steady), gbs, *(tput or (None, None)), max(mem) if mem else None,
                       "max_reserved", args, len(times))


def read_train_jsonl(text: str, source: str) -> MeasuredRun:
    """The run's measurements from ``aceso train --log-file`` JSON lines (the runtime's training/train_log.py)."""
    if not text.strip():
        raise AcesoError(f"{source}: the log is empty; give the --log-file of a finished aceso train run")
    times, mem, tput = [], [], None
    lines = text.splitlines()
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            cut = n == len(lines) and not text.endswith("\n")
            raise AcesoError(f"{source}: line {n}: " + ("cut off mid-line; give the complete log" if cut
                                                        else "not a JSON record; give aceso train's --log-file")) \
                from None
        if not isinstance(rec, dict):
            raise AcesoError(f"{source}: line {n}: not a JSON record; give aceso train's --log-file")
        if rec.get("kind") == "message" and _OOM.search(str(rec.get("text", ""))):
            raise AcesoError(f"{source}: line {n}: the run ran out of GPU memory; calibrate with runs that completed")
        if rec.get("kind") != "train":
            continue
        for key in ("iteration_time_ms", "loss", "tflops_per_gpu"):
            v = rec.get(key)
            if not isinstance(v, (int, float)) or not math.isfinite(v):
                raise AcesoError(f"{source}: line {n}: {key} is {v}; calibrate with a run that trained normally")
        times.append(float(rec["iteration_time_ms"]))
        tput = (float(rec["tflops_per_gpu"]), times[-1])
        stage_mem = legacy_keys(rec).get("stage_max_memory_mib") or []       # (older logs: *_mb, the same MiB)
        if any(not isinstance(v, (int, float)) or not math.isfinite(v) for v in stage_mem):
            raise AcesoError(f"{source}: line {n}: stage_max_memory_mib has a non-number; give the unedited log")
        mem.extend(float(v) for v in stage_mem)
    if not times:
        raise AcesoError(f"{source}: no 'train' record; give the --log-file of an aceso train run that logged at "
                         "least one interval")
    steady = times[1:] if len(times) > 1 else times
    return MeasuredRun(source, statistics.median(steady), None, *tput, max(mem) if mem else None, "max_allocated",
                       {}, len(times))


def read_run_log(text: str, source: str) -> MeasuredRun:
    """Either kind of log: JSON lines when the first non-blank character opens a JSON object."""
    return read_train_jsonl(text, source) if text.lstrip().startswith("{") else read_megatron_log(text, source)
