"""The profiling worker, one process per rank under torchrun (started by ``aceso profile``).

Order: parse the same options as ``aceso profile``; start the process group (gloo on CPU, NCCL on GPUs); CPU
shims; rank 0 opens the partial file (``progress.py``) and broadcasts the finished keys; then every rank walks
the same task list (``tasks.py``), skipping finished keys, building the runtime's modules at each tp once
(``units.TPBench``) and the network groups once (``comm.CommBench``); rank 0 appends each result as it comes.
At the end rank 0 assembles the database with the cost model's writer and removes the partial file.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings

from patches.compat import quiet_cuda_build_notices
from search.io.errors import AcesoError

quiet_cuda_build_notices()   # a worker on CPU with torch's CUDA build: no import-time notice (patches.compat)
warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")


def _env() -> tuple[int, int, int, int]:
    """(world, rank, local rank, processes per node) from torchrun's environment."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return (world, int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0")),
            int(os.environ.get("LOCAL_WORLD_SIZE", str(world))))


def _init(cpu: bool, local_rank: int) -> None:
    import torch
    import torch.distributed as dist

    from ..parallel.distenv import ensure_rendezvous_env

    ensure_rendezvous_env()
    if cpu:
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        dist.init_process_group("gloo")
        from patches import cpu_mode

        cpu_mode.apply()
    else:
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl")


def _broadcast(obj):
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class Worker:
    def __init__(self, args: argparse.Namespace):
        from .args import header, model_from_args, settings

        self.args = args
        self.model = model_from_args(args)
        self.world, self.rank, self.local_rank, self.per_node = _env()
        self.device = "cpu" if args.cpu else "cuda"
        self.set = settings(args)
        self.header = header(args, self.model, self.world)

    def tasks(self):
        from .tasks import comm_tasks, unit_tasks

        out = [] if self.args.comm else unit_tasks(self.model, self.args.tp, self.args.micro_batch_sizes,
                                                        self.set["passes"], self.args.ep)
        if not self.args.no_comm:
            out += comm_tasks(self.world, self.per_node, self.set["min_bytes"], self.set["max_bytes"])
        return out

    def _open_partial(self):
        """Rank 0's partial file and the finished keys (broadcast; an error is raised on every rank)."""
        from .args import db_path
        from .progress import PartialFile, partial_path

        part, msg = None, None
        if self.rank == 0:
            try:
                part = PartialFile(partial_path(db_path(self.args.output)), self.header, self.args.fresh)
            except AcesoError as e:
                msg = str(e)
        done, msg = _broadcast((sorted(part.done) if part else [], msg))
        if msg:
            raise AcesoError(msg)
        return part, set(done)

    def run(self) -> None:
        import torch

        from .progress import Progress
        from .units import Settings, TPBench

        part, done = self._open_partial()
        tasks = self.tasks()
        skipped = sum(t.key in done for t in tasks)
        bar = Progress(len(tasks), skipped, self.rank == 0 and not self.args.quiet, self.rank == 0)
        bench = comm = None
        st = Settings(self.device, self.set["warmup"], self.set["repeats"])
        t0 = time.time()
        try:
            for t in tasks:
                if t.key in done:
                    continue
                bar.update(t.key)
                if t.what in ("unit", "embedding", "head"):
                    if bench is None or (bench.tp, bench.ep) != (t.tp, t.ep):
                        bench = None
                        bench = TPBench(self.model, t.tp, self.world, self.rank, st, self.args.seed, t.ep)
                    try:
                        res = (bench.unit(t.stack, t.kind, t.batch) if t.what == "unit"
                               else getattr(bench, t.what)(t.batch))
                    except torch.OutOfMemoryError:
                        raise AcesoError(f"{t.key}: out of GPU memory; profile smaller --micro-batch-sizes or "
                                         "a larger --tp (finished measurements are kept)") from None
                elif t.what == "optimizer":
                    from .optim import optimizer_step

                    bench = None
                    res = optimizer_step(self.model, self.world, self.rank, self.device, st.warmup, st.repeats)
                else:
                    if comm is None:
                        from .comm import CommBench

                        dtype = torch.float32 if self.device == "cpu" else torch.float16
                        comm = CommBench(self.world, self.per_node, self.device, dtype, st.warmup, st.repeats)
                    us = comm.collective(t.kind, t.group, t.nbytes) if t.what == "coll" else comm.p2p(t.inter, t.nbytes)
                    res = {"us": us}
                if part is not None:
                    part.add(t.key, res)
                bar.update(t.key, advance=1)
        finally:
            bar.close()
        if self.rank == 0:
            self._write(part, tasks, time.time() - t0)

    def _write(self, part, tasks, seconds: float) -> None:
        from search.costmodel.profiledb import ProfileDBWriter, model_fingerprint

        from .args import db_path
        from .fingerprint import gpu_preset, hardware
        from .tasks import assemble

        hw = hardware(self.device, self.per_node, self.world // self.per_node)
        gpu = "cpu" if self.device == "cpu" else (self.args.gpu or gpu_preset(hw["device_name"]))
        if gpu is None:
            from search.spec.cluster import GPU_PRESETS
            raise AcesoError(f"GPU '{hw['device_name']}' matches no GPU record ({', '.join(GPU_PRESETS)}); name "
                             "it with --gpu (a new GPU: a record file, docs/gpus.md)")
        dtype = "fp32" if self.device == "cpu" else self.model.params_dtype
        w = ProfileDBWriter(self.model, gpu=gpu, dtype=dtype, hardware=hw)
        out = db_path(self.args.output)
        if self.args.comm and out.exists():   # keep the units of the existing database
            old = json.loads(out.read_text())
            if old.get("model") != model_fingerprint(self.model):
                raise AcesoError(f"-o {out}: holds a profile of another model; use a new file for --comm")
            for k in ("units", "embedding", "head", "optimizer"):
                if k in old:
                    w.data[k] = old[k]
        assemble(w, self.model, tasks, part.done)
        w.data["model_spec"] = self.model.model_dump()   # the full spec it was made with (informational)
        from ..model.fast_path import Environment, choose

        fast = choose(Environment.detect(self.device), self.model)  # what the units were measured with (and run)
        w.data["profiler"] = {"settings": self.header, "seconds": round(seconds, 1),
                              "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                              "fast_path": {"spec": fast.spec, "dtype": fast.dtype, **fast.config}}
        w.save(out)
        part.remove()
        n = len(w.data["units"]) + len(w.data["embedding"]) + len(w.data["head"])
        print(f"wrote {out}: {n} unit rows, {len(w.data['collectives'])} collective curves, "
              f"{len(w.data['p2p'])} p2p curves ({seconds:.0f} s)", file=sys.stderr, flush=True)


def worker_parser():
    """The worker's parser: ``aceso profile``'s arguments, built by the one constructor (no abbreviations)."""
    from search.io.argparser import AcesoParser

    from .args import add_arguments

    parser = AcesoParser(prog="python -m aceso_megatron.profiler")
    add_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    from ..errors import bad_input_from_patches
    args = worker_parser().parse_args(argv)
    _world, rank, local_rank, _ = _env()
    if "TORCHELASTIC_RUN_ID" in os.environ:
        from launch.commands import die_with_parent

        die_with_parent()   # a SIGKILLed torchrun cannot stop its workers
    try:
        with bad_input_from_patches():
            from .args import model_from_args
            from .units import check_profiled_model

            # before any group (on a machine without CUDA: Environment.detect's one line)
            check_profiled_model(model_from_args(args), "cpu" if args.cpu else "cuda")
            _init(args.cpu, local_rank)
            Worker(args).run()
    except AcesoError as e:
        path = os.environ.get("ACESO_PROFILE_ERROR_FILE")
        if path and (rank == 0 or not os.path.exists(path)):   # any rank may be the one that failed
            with open(path, "w") as f:
                f.write(str(e))
        if rank == 0 or not path:
            print(f"aceso profile: error: {e}", file=sys.stderr, flush=True)
        return e.exit_code
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            from ..training.teardown import destroy_groups

            destroy_groups()   # megatron-core's groups, then torch's, while the interpreter is whole (teardown)
    return 0
