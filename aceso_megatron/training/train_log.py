"""Training logs, evaluation and the predicted-vs-measured summary of ``aceso train``.

Every ``--log-interval`` steps the last stage's last rank prints (and appends to ``--log-file`` as one JSON line):
the step's loss, the gradient norm before clipping, the learning rate the step used, the mean iteration time over
the interval, samples/s, tokens/s per GPU and model TFLOP/s per GPU (``search.costmodel.throughput``, the function every
report uses: ``ModelSpec.training_flops_per_sample`` x global batch / time / GPUs, model FLOPs, recompute not
counted; MFU on a GPU run, against the plan's GPU preset) and the max memory of each stage (the max over its ranks:
``torch.cuda.max_memory_allocated`` on GPUs, the process's max RSS on CPU).

The summary compares the plan's prediction (``plan.predicted``) with the measurement: the mean iteration time
of the steps after the first (the first pays for warm-up) and each stage's max memory. When the prediction is not
for this machine it says so (``machine_note``): a plan priced on the nominal ``cpu`` preset (search.spec.cluster
``NOMINAL_PRESETS``) and not calibrated, a GPU plan run on CPU, or a plan priced for other GPUs than the ones the
run is on (the device name's preset, ``search.spec.cluster.gpu_for_device``); with the ``aceso calibrate`` command
that fits the preset to this run.

The first record (``"kind": "run"``, and a console line) says which run the log is of: the plan's digest
(``ParallelPlan.digest``, what ``aceso calibrate`` checks the log against), model, processes, device, global batch
and the cluster it was priced for.
"""

from __future__ import annotations

import json
import math
import resource
from datetime import datetime, timezone

import torch
import torch.distributed as dist

from search.costmodel.throughput import throughput, tokens_per_sample


def max_memory_mb(device: str) -> float:
    if device == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB


def stage_max_memory_mb(rt, device: str) -> list[float]:
    """Per stage, the max memory over its ranks (collective: every rank calls it)."""
    t = torch.zeros(rt.plan.num_stages, dtype=torch.float64, device=device)
    t[rt.layout.stage] = max_memory_mb(device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [round(float(v), 1) for v in t]


def evaluate(rt, global_batches: list[list[dict]]) -> float:
    """Mean per-token loss over ``global_batches``: megatron-core's schedule run forward-only with the runtime's
    chunks, forward step and communicator (``Runtime.run_schedule``: masked sums over token counts)."""
    total = 0.0
    for m in rt.models:
        m.eval()
    with torch.no_grad():
        for micro_batches in global_batches:
            total += rt.run_schedule(micro_batches, forward_only=True)
    for m in rt.models:
        m.train()
    return total / len(global_batches)


class TrainLogger:
    """Console lines and JSON records from the last rank; window statistics on every rank."""

    def __init__(self, args, plan, rt, device: str) -> None:
        self.args, self.plan, self.rt, self.device = args, plan, rt, device
        self.is_writer = dist.get_rank() == dist.get_world_size() - 1
        self.file = open(args.log_file, "a") if (args.log_file and self.is_writer) else None
        from .writers import Writers

        self.writers = Writers(args, self.is_writer)
        cl = plan.cluster        # MFU on a GPU run: against the plan's GPU preset in the model's dtype
        self.peak = cl.gpu.peak_tflops(plan.model.params_dtype) if device == "cuda" and cl is not None else None
        self.window_time, self.window_steps = 0.0, 0
        self.step_times: list[float] = []
        self._run_record()

    # -- output -----------------------------------------------------------------------------------------------
    def _emit(self, record: dict, line: str) -> None:
        if not self.is_writer:
            return
        print(line, flush=True)
        if self.file:   # wall-clock time of the record, UTC
            record = {**record, "time": datetime.now(timezone.utc).isoformat(timespec="milliseconds")}
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()

    def message(self, text: str) -> None:
        self._emit({"kind": "message", "text": text}, text)

    # -- records ----------------------------------------------------------------------------------------------
    def _run_record(self) -> None:
        p, c = self.plan, self.plan.cluster
        name = torch.cuda.get_device_name() if self.device == "cuda" else "cpu"
        pred = p.predicted.iteration_time_ms if p.predicted else None
        rec = {"kind": "run", "plan": self.args.plan, "plan_digest": p.digest(), "model": p.model.name,
               "world_size": p.world_size, "global_batch_size": p.global_batch_size,
               "tokens_per_sample": tokens_per_sample(p.model), "device": self.device, "device_name": name,
               "cluster": c.label if c else None, "predicted_iteration_time_ms": pred}
        where = f"{p.world_size} {'GPUs' if self.device == 'cuda' else 'CPU processes'} ({name})"
        priced = f"priced for {c.label}: {pred:.1f} ms/it" if c and pred else "no prediction"
        self._emit(rec, f" plan {rec['plan_digest']}: {p.model.name} on {where}, global batch "
                        f"{p.global_batch_size}, {priced}")

    def step(self, iteration: int, loss: float, grad_norm: float, lr: float, seconds: float) -> None:
        self.step_times.append(seconds)
        self.window_time += seconds
        self.window_steps += 1
        if iteration % self.args.log_interval:
            return
        avg = self.window_time / self.window_steps
        self.window_time, self.window_steps = 0.0, 0
        gbs, n = self.plan.global_batch_size, self.plan.world_size
        t = throughput(self.plan.model, gbs, avg * 1e3, n, self.peak)      # one function: search, explain, ...
        mem = stage_max_memory_mb(self.rt, self.device)
        rec = {"kind": "train", "iteration": iteration, "loss": loss, "grad_norm": grad_norm, "lr": lr,
               "iteration_time_ms": avg * 1e3, "samples_per_s": t.samples_per_s,
               "tokens_per_s": t.tokens_per_s_per_gpu * n, "tokens_per_s_per_gpu": t.tokens_per_s_per_gpu,
               "tflops_per_gpu": t.tflops_per_gpu, **({"mfu": t.mfu} if t.mfu is not None else {}),
               "stage_max_memory_mib": mem}
        per = "GPU" if self.device == "cuda" else "process"
        mfu = f" | MFU {100 * t.mfu:.1f}%" if t.mfu is not None else ""
        line = (f" iteration {iteration:>6}/{self.args.train_iters} | loss {loss:.6f} | grad norm {grad_norm:.4f} "
                f"| lr {lr:.3e} | {avg * 1e3:.1f} ms/it | {t.samples_per_s:,.2f} samples/s | "
                f"{t.tokens_per_s_per_gpu:,.0f} tokens/s per {per} | {t.tflops_per_gpu:.3f} TFLOP/s per {per}{mfu} "
                f"| max mem/stage MiB {' / '.join(f'{v:.0f}' for v in mem)}")
        self._emit(rec, line)
        from .writers import train_scalars

        self.writers.scalars(iteration, train_scalars(rec, gbs, self.device))

    def eval(self, iteration: int, loss: float) -> None:
        ppl = math.exp(min(loss, 30.0))
        self._emit({"kind": "eval", "iteration": iteration, "loss": loss, "ppl": ppl},
                   f" validation at iteration {iteration} | loss {loss:.6f} | ppl {ppl:.3f}")
        self.writers.scalars(iteration, {"lm loss validation": loss, "lm loss validation ppl": ppl})

    def summary(self) -> dict:
        """Predicted vs measured (collective); printed and written by the last rank, returned everywhere."""
        times = self.step_times[1:] if len(self.step_times) > 1 else self.step_times
        measured_ms = 1e3 * sum(times) / len(times) if times else float("nan")
        mem = stage_max_memory_mb(self.rt, self.device)
        pred = self.plan.predicted
        rec = {"kind": "summary", "measured_iteration_time_ms": measured_ms, "measured_stage_memory_mib": mem,
               "predicted_iteration_time_ms": pred.iteration_time_ms if pred else None,
               "predicted_stage_memory_mib": pred.stage_memory_mb if pred else None,
               "memory_kind": "cuda_max_allocated" if self.device == "cuda" else "cpu_max_rss",
               "stage_shapes": [s.shape_text for s in self.plan.stages],
               "prediction_note": machine_note(self.plan, self.device, self.args.plan, self.args.log_file)}
        self._emit(rec, self._table(rec))
        if self.file:
            self.file.close()
        self.writers.close()
        return rec

    @staticmethod
    def _table(rec: dict) -> str:
        def fmt(v):
            return "-" if v is None else f"{v:.1f}"

        pm = rec["predicted_stage_memory_mib"] or [None] * len(rec["measured_stage_memory_mib"])
        rows = [("iteration time (ms)", rec["predicted_iteration_time_ms"], rec["measured_iteration_time_ms"])]
        measured = rec["measured_stage_memory_mib"]
        rows += [(f"stage {i} max memory (MiB)", p, m) for i, (p, m) in enumerate(zip(pm, measured, strict=True))]
        lines = [f" {'':<26}{'predicted':>12}{'measured':>12}"]
        lines += [f" {name:<26}{fmt(p):>12}{fmt(m):>12}" for name, p, m in rows]
        if rec["memory_kind"] == "cpu_max_rss":
            lines.append(" (CPU run: measured memory is the process's max RSS, not comparable with a GPU prediction)")
        if rec.get("prediction_note"):
            lines.append(f" ({rec['prediction_note']})")
        return "\n".join(lines)


def machine_note(plan, device: str, plan_path: str, log_file: str | None) -> str | None:
    """Why the plan's predicted time is not one for this machine, and what to do; None when it is (module
    docstring)."""
    from search.spec.cluster import GPU_PRESETS, NOMINAL_PRESETS, gpu_for_device

    c = plan.cluster
    if c is None or plan.predicted is None:
        return None
    gpu = c.gpu.name
    log = log_file or "LOG (this run's output saved to a file)"
    fit = (f"fit the cost model to this run: aceso calibrate --run {plan_path} {log} -o calib.json, then search "
           "or explain with --calibration calib.json")
    if device == "cpu":
        if gpu not in NOMINAL_PRESETS:
            return f"predicted for {c.label}, {gpu} GPUs; this run is on CPU processes: the times do not compare"
        if c.gpu != GPU_PRESETS.get(gpu):
            return None       # calibrated (search --calibration): priced on what a run of this machine measured
        return (f"predicted on the {gpu} preset, a nominal CPU ({c.gpu.peak_tflops_fp32:g} TFLOP/s, "
                f"{c.intra_node_gbps:g} GB/s between processes), not this machine; {fit}")
    here = torch.cuda.get_device_name()
    preset = gpu_for_device(here)
    if preset != gpu:
        return (f"predicted for {c.label}, {gpu} GPUs; this run is on {here} ({preset or 'no GPU preset'}): the "
                f"times do not compare; search a plan for {preset or 'these GPUs'}, or {fit}")
    return None
