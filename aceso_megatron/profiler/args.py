"""``aceso profile``'s arguments, torch-free: the parser the subcommand (``aceso_megatron.cli.profile``) and the workers
(``profiler.run.worker_parser``) share, the settings filled in by device, the database path and the header a resumed
run must share. ``--model`` reads like ``aceso search --model``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from search.io.argtypes import port, positive_int, seed
from search.spec.model import ModelSpec
from search.spec.presets import load_model

DB_FILE = "profile-db.json"   # as search.costmodel.profiledb.DB_FILE (not imported: keeps this module light)
KB, MB, GB = 1024, 1024**2, 1024**3


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    p.add_argument("--tp", type=int, nargs="+", default=[1], help="tensor-parallel degrees to profile (default 1)")
    p.add_argument("--ep", type=int, nargs="+", default=[1],
                   help="MoE models: expert-parallel degrees to profile the moe unit at (etp = tp; default 1)")
    p.add_argument("--micro-batch-sizes", type=int, nargs="+", default=[1],
                   help="per-rank micro-batch sizes (samples) to profile (default 1)")
    p.add_argument("-o", "--output", required=True, help="profile database file (or folder: FOLDER/profile-db.json)")
    p.add_argument("--cpu", action="store_true", help="profile CPU processes on gloo (fp32), not GPUs")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--comm", action="store_true", help="only the network (collectives, p2p); kept units of an "
                      "existing -o database")
    what.add_argument("--no-comm", action="store_true", help="only the units (no network benchmarks)")
    p.add_argument("--nproc", type=int, default=None,
                   help="processes per node (default: max --tp; --comm: the visible GPUs, 2 with --cpu)")
    p.add_argument("--nnodes", type=int, default=1, help="nodes (inter-node p2p and collectives; default 1)")
    p.add_argument("--node-rank", type=int, default=0, help="this node's rank")
    p.add_argument("--master-addr", default=None, help="rendezvous host (multi-node)")
    p.add_argument("--master-port", type=port, default=None, help="rendezvous port (default 29500)")
    p.add_argument("--warmup", type=int, default=None, help="untimed repeats first (default GPU 5, CPU 2)")
    p.add_argument("--repeats", type=int, default=None, help="timed repeats, median kept (default 20)")
    p.add_argument("--passes", type=int, default=1,
                   help="passes over all unit measurements, median kept (default 1; 3 on a busy shared CPU)")
    p.add_argument("--min-bytes", type=int, default=KB, help="smallest message (default 1 KB)")
    p.add_argument("--max-bytes", type=_bytes, default=None, help="largest message (default GPU 1 GiB, CPU 1 MiB)")
    p.add_argument("--gpu", default=None, help="GPU preset name to record (default: from the device name)")
    p.add_argument("--seed", type=seed, default=1234, help="weights and inputs seed")
    p.add_argument("--fresh", action="store_true", help="ignore an unfinished profile of -o and start over")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--python", default=sys.executable, help="python interpreter for the workers")


def _bytes(text: str) -> int:
    """A message size: up to 16 GiB."""
    value = int(text) if text.lstrip("-").isdigit() else -1
    if not 1 <= value <= 1 << 34:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size in bytes in [1, 2^34]")
    return value


def settings(args: argparse.Namespace) -> dict:
    """Defaults filled in by device; shared by the launcher and the workers."""
    cpu = args.cpu
    return {"warmup": args.warmup if args.warmup is not None else (2 if cpu else 5),
            "repeats": args.repeats if args.repeats is not None else 20,
            "passes": args.passes, "min_bytes": args.min_bytes, "max_bytes": args.max_bytes or (MB if cpu else GB)}


def db_path(output: str) -> Path:
    p = Path(output)
    return p / DB_FILE if p.is_dir() else p


def add_model_args(p: argparse.ArgumentParser, required: bool = True) -> None:
    p.add_argument("--model", required=required, help="preset name (see `aceso models`) or a spec file")
    p.add_argument("--num-layers", type=positive_int, default=None, help="override the preset's depth")


def model_from_args(args: argparse.Namespace) -> ModelSpec:
    return load_model(args.model, num_layers=args.num_layers)


def header(args: argparse.Namespace, model: ModelSpec, world: int) -> dict:
    """What a resumed run must share with the run that wrote the partial file."""
    from search.costmodel.profiledb import model_fingerprint

    return {"model": model_fingerprint(model), "seq": [model.seq_length, model.decoder_seq_length],
            "device": "cpu" if args.cpu else "cuda", "world": world, "tp": list(args.tp),
            "micro_batch_sizes": list(args.micro_batch_sizes), "comm": bool(args.comm),
            "no_comm": bool(args.no_comm), **settings(args), **({"ep": list(args.ep)} if args.ep != [1] else {})}
