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
arguments (aceso train's own logs: ``search.calibration.aceso_log``). A log that cannot be a completed run is refused in one
line: empty, no iteration line, NaN or inf numbers or nan iterations, a zero or negative time, throughput, batch or
memory, a CUDA out-of-memory error, a line cut off (an iteration line without its closing ``number of nan
iterations`` field).
"""

from __future__ import annotations

import math
import re
import statistics
from dataclasses import dataclass, field

from search.io.errors import AcesoError

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
    run: dict | None = None                 # aceso train's "run" record: which plan (digest), device


def number(text, what: str, source: str, line: int, low: float | None = 0.0, strict: bool = True) -> float:
    """``text`` (a field of a text log, or a JSON number) as a finite number above ``low`` (at least ``low`` when
    not ``strict``); anything else is one ``AcesoError`` line naming the field."""
    if isinstance(text, bool) or not isinstance(text, (str, int, float)):
        raise AcesoError(f"{source}: line {line}: {what} is {text!r}, not a number; give the run's unedited log")
    v = _number(str(text), what, source, line) if isinstance(text, str) else float(text)
    if not math.isfinite(v):
        raise AcesoError(f"{source}: line {line}: {what} is {text}: the run diverged or its timer failed; "
                         "calibrate with a run that trained normally")
    if low is not None and (v <= low if strict else v < low):
        raise AcesoError(f"{source}: line {line}: {what} is {text}: a run's {what} is {'above' if strict else 'at least'} "
                         f"{low:g}; give the run's unedited log")
    return v


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
            mem.append(number(m.group(6), "max reserved", source, n, strict=False))
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
        times.append(number(f["elapsed time per iteration (ms)"], "elapsed time per iteration", source, n))
        if int(_number(f[_LAST_FIELD], _LAST_FIELD, source, n)):
            raise AcesoError(f"{source}: line {n}: the run had NaN iterations (loss or gradients); calibrate with a "
                             "run that trained normally")
        for key, val in f.items():
            if val.lower() in ("nan", "inf", "-inf"):
                raise AcesoError(f"{source}: line {n}: {key} is {val}; calibrate with a run that trained normally")
        if "global batch size" in f:
            gbs = int(number(f["global batch size"], "global batch size", source, n))
        if "throughput per GPU (TFLOP/s/GPU)" in f:
            tput = (number(f["throughput per GPU (TFLOP/s/GPU)"], "throughput per GPU", source, n, strict=False),
                    times[-1])
    if not times:
        raise AcesoError(f"{source}: no 'elapsed time per iteration (ms)' line; give the stdout of a Megatron-LM run "
                         "that logged at least one interval (--log-interval)")
    steady = times[1:] if len(times) > 1 else times
    return MeasuredRun(source, statistics.median(steady), gbs, *(tput or (None, None)), max(mem) if mem else None,
                       "max_reserved", args, len(times))


def read_run_log(text: str, source: str) -> MeasuredRun:
    """Any kind of log: aceso train's JSON lines (the first non-blank character opens a JSON object) or console
    output (its iteration lines), else Megatron-LM's stdout."""
    from search.calibration.aceso_log import is_train_stdout, read_train_jsonl, read_train_stdout

    if text.lstrip().startswith("{"):
        return read_train_jsonl(text, source)
    return read_train_stdout(text, source) if is_train_stdout(text) else read_megatron_log(text, source)
