"""Measurements of an ``aceso train`` run read from its log: the ``--log-file`` JSON lines or the console output
(what the last rank prints, saved to a file), for ``aceso calibrate --run PLAN LOG``.

Both are written by the runtime's training log (``train_log.py``): first the run's identity (a ``{"kind": "run"}`` record,
on the console ``plan DIGEST: MODEL on N GPUs|CPU processes (DEVICE), global batch B, ...``), then every
``--log-interval`` steps a ``train`` record / ``iteration`` line with the interval's mean iteration time, TFLOP/s
per GPU and each stage's max memory. The steady iteration time is the median of the intervals after the first
(which pays for warm-up); the memory the largest stage peak (``max allocated``; none for a CPU run, whose max RSS
is not what the cost model prices).

A log that cannot be a completed run of a plan is refused in one line: empty, no identity (a log of another tool,
or written before the run record existed: run it again), no iteration, a line cut off, a number that is not one,
NaN or inf, a zero or negative iteration time, a negative throughput or memory, a memory field that is not a
list of numbers, a CUDA out-of-memory message.
"""

from __future__ import annotations

import json
import re
import statistics

from search.io.errors import AcesoError
from search.calibration.megatron_log import _OOM, MeasuredRun, number
from search.io.units import legacy_keys

_RUN = re.compile(r"^ ?plan ([0-9a-f]{16}): (\S+) on (\d+) (GPUs|CPU processes) \((.*)\), global batch (\d+)")
# the iteration line as train_log prints it (samples/s, tokens/s per GPU or process, MFU on a GPU) or as it was
# before tokens/s per GPU and MFU (``N tokens/s | ...``)
_STEP = re.compile(r"^ ?iteration\s+(\d+)/\s*(\d+) \| loss (\S+) \| grad norm (\S+) \| lr (\S+) \| (\S+) ms/it \| "
                   r"(?:\S+ samples/s \| )?(\S+) tokens/s(?: per (?:GPU|process))? \| (\S+) TFLOP/s per (?:GPU|process)"
                   r"(?: \| MFU \S+%)? \| max mem/stage MiB (.*)$")
_STEP_START = re.compile(r"^ ?iteration\s+\d+/\s*\d+ \| loss ")
IDENTITY = "run record (the plan digest aceso train writes first)"


def is_train_stdout(text: str) -> bool:
    """Whether ``text`` is aceso train's console output (an identity or iteration line of its own format)."""
    return any(_RUN.match(ln) or _STEP_START.match(ln) for ln in text.splitlines())


def _json_number(value, what: str, source: str, n: int, **kw) -> float:
    """A JSON record's number (not text that reads as one: the runtime writes numbers)."""
    if isinstance(value, str):
        raise AcesoError(f"{source}: line {n}: {what} is {value!r}, not a number; give the run's unedited log")
    return number(value, what, source, n, **kw)


def _run_record(rec: dict, source: str, n: int) -> dict:
    digest = rec.get("plan_digest")
    if not isinstance(digest, str) or not re.fullmatch(r"[0-9a-f]{16}", digest):
        raise AcesoError(f"{source}: line {n}: the run record's plan_digest is {digest!r}; give the unedited log")
    if rec.get("device") not in ("cpu", "cuda"):
        raise AcesoError(f"{source}: line {n}: the run record's device is {rec.get('device')!r}, not cpu or cuda; "
                         "give the unedited log")
    return {"plan_digest": digest, "device": rec["device"], "device_name": str(rec.get("device_name", ""))}


def _measured(source: str, times: list[float], tput: tuple[float, float], mem: list[float], run: dict | None,
              kind: str) -> MeasuredRun:
    if run is None:
        raise AcesoError(f"{source}: no {IDENTITY}; give the log of an aceso train run of this version (the log "
                         "must say which plan it ran)")
    if not times:
        raise AcesoError(f"{source}: no {kind}; give the log of an aceso train run that logged at least one "
                         "interval (--log-interval)")
    steady = times[1:] if len(times) > 1 else times
    cpu = run["device"] == "cpu"
    return MeasuredRun(source, statistics.median(steady), None, *tput, None if cpu or not mem else max(mem),
                       "max_allocated", {}, len(times), run)


def read_train_jsonl(text: str, source: str) -> MeasuredRun:
    """The run's measurements from ``aceso train --log-file`` JSON lines (module docstring)."""
    if not text.strip():
        raise AcesoError(f"{source}: the log is empty; give the --log-file of a finished aceso train run")
    times, mem, tput, run = [], [], None, None
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
        kind = rec.get("kind")
        if kind == "message" and _OOM.search(str(rec.get("text", ""))):
            raise AcesoError(f"{source}: line {n}: the run ran out of GPU memory; calibrate with runs that completed")
        if kind == "run":
            run = _run_record(rec, source, n)
        if kind != "train":
            continue
        _json_number(rec.get("loss"), "loss", source, n, low=None)
        times.append(_json_number(rec.get("iteration_time_ms"), "iteration_time_ms", source, n))
        tput = (_json_number(rec.get("tflops_per_gpu"), "tflops_per_gpu", source, n, strict=False), times[-1])
        stage_mem = legacy_keys(rec).get("stage_max_memory_mib", [])       # (older logs: *_mb, the same MiB)
        if not isinstance(stage_mem, list):
            raise AcesoError(f"{source}: line {n}: stage_max_memory_mib is {stage_mem!r}, not a list of MiB per "
                             "stage; give the unedited log")
        mem.extend(_json_number(v, "stage_max_memory_mib", source, n, strict=False) for v in stage_mem)
    return _measured(source, times, tput, mem, run, "'train' record")


def read_train_stdout(text: str, source: str) -> MeasuredRun:
    """The run's measurements from aceso train's console output (module docstring)."""
    times, mem, tput, run = [], [], None, None
    lines = text.splitlines()
    for n, line in enumerate(lines, 1):
        if _OOM.search(line):
            raise AcesoError(f"{source}: line {n}: the run ran out of GPU memory; calibrate with runs that completed")
        if m := _RUN.match(line):
            run = {"plan_digest": m.group(1), "device": "cuda" if m.group(4) == "GPUs" else "cpu",
                   "device_name": m.group(5)}
            continue
        if not _STEP_START.match(line):
            continue
        cut = n == len(lines) and not text.endswith("\n")
        if cut or not (m := _STEP.match(line)) or not line.rstrip()[-1:].isdigit():
            raise AcesoError(f"{source}: line {n}: the iteration line is cut off or edited; give the complete output")
        number(m.group(3), "loss", source, n, low=None)
        times.append(number(m.group(6), "ms/it", source, n))
        tput = (number(m.group(8), "TFLOP/s", source, n, strict=False), times[-1])
        mem.extend(number(v.strip(), "max mem/stage MiB", source, n, strict=False) for v in m.group(9).split("/"))
    return _measured(source, times, tput, mem, run, "iteration line")
