"""Profile a model's units, collectives and p2p on this machine into a profile database (docs/profiler.md).

  aceso profile --model gpt-1.3b --tp 1 2 4 8 --micro-batch-sizes 1 2 4 8 -o gpt13.json     # GPUs (NCCL)
  aceso profile --model tiny.json --tp 1 2 --micro-batch-sizes 1 2 -o db.json --cpu          # CPU (gloo)
  aceso profile --model gpt-1.3b --comm -o gpt13.json          # only the network (merged into an existing DB)

Starts itself under torchrun (python -m torch.distributed.run) with max(--tp) processes per node (--nproc to
change). --micro-batch-sizes are per-rank batches (samples). A killed run resumes where it stopped when rerun
with the same options (--fresh starts over). The result is read by `--cost-model profile --db DB`.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from search.io.errors import AcesoError
from search.spec.model import ModelSpec

from ..profiler.args import add_arguments  # noqa: F401  (the subcommand's contract)
from ..profiler.args import db_path, header, model_from_args, settings
from .common import check_output


def check(args: argparse.Namespace, model: ModelSpec) -> None:
    """Every bad option as one line, before any process starts."""
    for t in args.tp:
        if t < 1:
            raise AcesoError(f"--tp {t}: must be a positive integer")
        if model.num_attention_heads % t or model.groups % t:
            raise AcesoError(f"--tp {t}: num_attention_heads ({model.num_attention_heads}) and query groups "
                             f"({model.groups}) must be multiples of it")
    _check_ep(args, model)
    for b in args.micro_batch_sizes:
        if b < 1:
            raise AcesoError(f"--micro-batch-sizes {b}: must be a positive integer")
    nproc = args.nproc
    if nproc is not None and nproc < 1:
        raise AcesoError(f"--nproc {nproc}: must be at least 1")
    if not args.comm:
        n = nproc or max(args.tp + args.ep)
        bad = [t for t in args.tp if n % t]
        if bad:
            raise AcesoError(f"--tp {bad[0]} does not divide the {n} processes (--nproc); use --nproc a multiple "
                             "of every --tp")
        bad = [e for e in args.ep if n % (e * max(args.tp))]
        if bad:
            raise AcesoError(f"--ep {bad[0]} x --tp {max(args.tp)} does not divide the {n} processes (--nproc); use "
                             "--nproc a multiple of every ep x tp")
    s = settings(args)
    if s["repeats"] < 1 or s["warmup"] < 0 or s["passes"] < 1:
        raise AcesoError("--repeats and --passes must be at least 1 and --warmup at least 0")
    if not 0 < s["min_bytes"] <= s["max_bytes"]:
        raise AcesoError(f"--min-bytes ({s['min_bytes']}) must be positive and at most --max-bytes ({s['max_bytes']})")
    if args.nnodes < 1 or not 0 <= args.node_rank < args.nnodes:
        raise AcesoError(f"--node-rank ({args.node_rank}) must be in [0, --nnodes ({args.nnodes}))")
    out = db_path(args.output)
    if out.exists() and not out.is_file():
        raise AcesoError(f"-o {args.output}: {out} is not a regular file; the profiler writes a database file there")
    check_output(str(out))


def _check_ep(args: argparse.Namespace, model: ModelSpec) -> None:
    """--ep against the model: an MoE model's experts at tp 1 (MoE + TP runs with sequence parallelism, which the
    profiler does not measure), ep dividing num_experts; a dense model has no --ep."""
    if model.moe is None:
        if args.ep != [1]:
            raise AcesoError(f"--ep: the model {model.name} has no experts; drop --ep")
        return
    for e in args.ep:
        if e < 1 or model.moe.num_experts % e:
            raise AcesoError(f"--ep {e}: must be a positive divisor of num_experts ({model.moe.num_experts})")
    if not args.comm and max(args.tp) > 1:
        raise AcesoError(f"--tp {max(args.tp)}: an MoE model at tp > 1 runs with sequence parallelism, which the "
                         "profiler does not measure (nor the profile cost model price); profile --tp 1")


def check_device(args: argparse.Namespace, nproc: int) -> None:
    """A GPU profile (no --cpu) on a machine without CUDA, or with fewer GPUs than processes: one line, before
    any process starts (``aceso launch`` checks the same)."""
    if args.cpu:
        return
    from launch.commands import count_visible_gpus

    visible = count_visible_gpus()
    if visible == 0:
        raise AcesoError("no GPU on this node (CUDA_VISIBLE_DEVICES or nvidia-smi lists none); add --cpu to profile "
                         "CPU processes (gloo, fp32), or run aceso profile on a GPU node")
    import torch

    if not torch.cuda.is_available():
        from ..model.fast_path import no_cuda_message

        raise AcesoError(no_cuda_message(torch))
    visible = torch.cuda.device_count()
    if nproc > visible:
        raise AcesoError(f"this node has {visible} visible GPU(s) but the profile starts {nproc} processes per node "
                         "(max --tp and --ep, or --nproc); profile smaller degrees here or run on a bigger node")


def num_procs(args: argparse.Namespace) -> int:
    if args.nproc:
        return args.nproc
    if not args.comm:
        return max(args.tp + args.ep)
    if args.cpu:
        return 2
    from launch.commands import count_visible_gpus

    return max(count_visible_gpus() or 1, 1)


def worker_argv(args: argparse.Namespace) -> list[str]:
    argv = ["--model", args.model, "--tp", *map(str, args.tp), "--micro-batch-sizes",
            *map(str, args.micro_batch_sizes), "-o", args.output, "--min-bytes", str(args.min_bytes),
            "--seed", str(args.seed)]
    if args.num_layers is not None:
        argv += ["--num-layers", str(args.num_layers)]
    if args.ep != [1]:
        argv += ["--ep", *map(str, args.ep)]
    for flag in ("cpu", "comm", "no_comm", "fresh", "quiet"):
        if getattr(args, flag):
            argv.append("--" + flag.replace("_", "-"))
    if args.passes != 1:
        argv += ["--passes", str(args.passes)]
    for opt in ("warmup", "repeats", "max_bytes", "gpu"):   # not --nproc: torchrun takes it for its own
        if getattr(args, opt) is not None:
            argv += ["--" + opt.replace("_", "-"), str(getattr(args, opt))]
    return argv


def torchrun_command(args: argparse.Namespace, nproc: int) -> list[str]:
    cmd = [args.python, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc)]
    if args.nnodes == 1 and args.master_addr is None and args.master_port is None:
        cmd.append("--standalone")
    else:
        cmd += ["--nnodes", str(args.nnodes), "--node-rank", str(args.node_rank), "--master-addr",
                args.master_addr or "127.0.0.1", "--master-port", str(args.master_port or 29500)]
    return cmd + ["-m", "aceso_megatron.profiler"] + worker_argv(args)


def _check_partial(args: argparse.Namespace, model: ModelSpec, world: int) -> None:
    part = db_path(args.output)
    part = part.with_name(part.name + ".partial.jsonl")
    if args.fresh or not part.exists() or args.node_rank:
        return
    try:
        head = json.loads(part.read_text().splitlines()[0])["header"]
    except (IndexError, json.JSONDecodeError, KeyError, TypeError):
        head = None
    if head != header(args, model, world):
        raise AcesoError(f"{part}: an unfinished profile made with other settings; rerun with the same options, "
                         "or add --fresh to start over")


def _repo_root() -> str | None:
    root = Path(__file__).resolve().parents[2]
    return str(root) if (root / "aceso_megatron").is_dir() else None


def run(args: argparse.Namespace) -> int:
    model = model_from_args(args)
    check(args, model)
    if model.layer_spec or model.megatron or model.moe or model.mla or model.mtp_num_layers:
        # the user's modules, what the runtime's MoE stages refuse (torch): one line before any process starts
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")   # megatron-core's import-time notices (no TE / apex)
            from ..profiler.units import check_profiled_model

            check_profiled_model(model, "cpu" if args.cpu else "cuda")
    nproc = num_procs(args)
    check_device(args, nproc)
    _check_partial(args, model, nproc * args.nnodes)
    cmd = torchrun_command(args, nproc)
    env = dict(os.environ)
    root = _repo_root()
    if root:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("PYTHONWARNINGS", "ignore")
    from launch.commands import run_torchrun

    rc = run_torchrun(cmd, env=env, error_env="ACESO_PROFILE_ERROR_FILE")   # a worker's bad input: AcesoError
    return 0 if rc == 0 else 1
