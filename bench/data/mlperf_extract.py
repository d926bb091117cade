"""Writes ``mlperf_training.json`` from NVIDIA's MLPerf Training submissions (v4.0, v4.1, v5.0, v5.1).

Each row is one NVIDIA submission of an LLM pre-training benchmark (``gpt3``, ``llama31_405b``, ``llama31_8b``) in
``github:mlcommons/training_results_v<round>``, read from the submission's own files only:

- ``NVIDIA/benchmarks/<bench>/implementations/<submission>/README-<submission>.md``: the config script the
  submission ran (the README's ``source config_....sh`` line);
- that script and the ``config_*.sh`` files it sources: run with ``bash`` (``env -i``, in a temporary folder holding
  only the implementation's ``config_*.sh`` files) and its exported environment recorded (``env``: every variable the
  run's ``run.sub`` / NeMo configuration reads for parallelism, precision and the data-parallel overlaps);
- ``NVIDIA/results/<submission>/<bench>/result_*.txt``: the MLPerf logs: ``global_batch_size``,
  ``gradient_accumulation_steps``, ``max_sequence_length``, and the step time;
- ``NVIDIA/systems/<submission>.json``: the system (nodes, GPUs per node, GPU memory, NICs, framework release).

Measured step time (``measured.step_s``), exactly as the logs give it:
- logs with ``tracked_stats`` ``train_step_time`` (v5.0, v5.1: the benchmark's ``DeltaTimingCallback`` logs the wall
  time between two consecutive ``on_train_batch_end`` calls, i.e. one optimizer step, every ``LOG_EVERY_N_STEPS``
  steps; the entry without a ``step``, a closing average, is left out): the median over all logged training steps
  of all the submission's result files (the first logged step of each file left out: it follows the warm-up);
- logs without it (v4.x GPT-3): each ``block_start`` .. ``block_stop`` interval of the timed run holds
  ``epoch_count`` tokens (``metadata``), i.e. ``epoch_count / (global_batch_size x max_sequence_length)`` steps with
  no evaluation inside (evaluation runs between blocks); step time = interval / steps, median over all blocks of all
  files but each file's first.
``measured.block_step_s`` is the block-based time for every row, a cross-check of the logged step times (the steps
of a block: v5.1 logs ``step`` at both ends, v5.0 the cumulative ``samples_count`` at the block's start and at the
next ``eval_start``, v4.x ``epoch_count`` tokens). It is a few percent above the logged median where the first step
after each evaluation is slow (e.g. v5.1 405B on 5,120 GB200: 11.6 s for the first step, 2.2 s after).
``measured.validation_step_s`` (v5.0, v5.1): the median logged ``validation_step_time``, the same callback's wall
time between two consecutive ``on_validation_batch_end`` calls: one forward-only step over a global batch (v5.1
Llama 3.1 8B: its ``samples_count`` grows by the training global batch per step), under the same full-iteration
CUDA graph (megatron-core ``FullCudaGraphWrapper`` captures a 'validation' graph too) but without the backward, the
optimizer step and the data-parallel collectives, and without TP communication overlap (``NVTE_TP_OVERLAP_TRAINING_
ONLY=1``). The first of each evaluation is left out (it times from the last training step: 0.185 s against 0.021 s
after, v5.1 8B on 512 GB300); ``validation_samples`` counts the rest.

Run: ``python bench/data/mlperf_extract.py [MIRROR_ROOT]`` (default ``/work/.mirror``: the folders
``mlcommons+training_results_v<round>/repo``, bare git clones, as the project's ``fetch`` tool writes them).
Not run by the tests; the JSON it writes is what the bench reads.
"""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROUNDS = ("4.0", "4.1", "5.0", "5.1")
BENCHMARKS = ("gpt3", "llama31_405b", "llama31_8b")
OUT = Path(__file__).resolve().parent / "mlperf_training.json"
# the environment variables kept (what NeMo's MLPerf configuration reads for the run's shape and its overlaps)
ENV_KEYS = ("DGXNNODES", "DGXNGPU", "MINIBS", "MICRO_BATCH_SIZE", "TENSOR_MODEL_PARALLEL", "PIPELINE_MODEL_PARALLEL",
            "INTERLEAVED_PIPELINE", "CONTEXT_PARALLEL", "SEQ_PARALLEL", "MODEL_SIZE", "OVERWRITTEN_NUM_LAYERS",
            "NUM_LAYERS", "FP8", "FP8_HYBRID", "FP8_RECIPE", "FP8_PARAMS", "FP8_PARAM_GATHER", "FP8_AMAX_ALGO",
            "FP8_AMAX_HISTORY", "FP4", "FP4_RECIPE", "FP8_DPA", "USE_DIST_OPTIMIZER", "OVERLAP_GRAD_REDUCE",
            "OVERLAP_PARAM_GATHER", "OVERLAP_PARAM_GATHER_WITH_OPTIM_STEP", "ALIGN_PARAM_GATHER", "BUCKET_SIZE",
            "BUCKET_CAP_MB", "TP_COMM_OVERLAP", "FULL_CUDA_GRAPH", "MCORE_CUDA_GRAPH", "LAYER_CUDA_GRAPH",
            "CUDA_GRAPH_SCOPE", "ACT_CKPT_GRANULARITY", "ACT_CKPT_METHOD", "ACT_CKPT_NUM_LAYERS", "ASYM_PP_EMBED",
            "ASYM_PP_LOSS", "TP_PP_DP_MAPPING", "NCCL_NVLS_ENABLE", "NCCL_SHARP_GROUP_SIZE_THRESH", "SHARP",
            "NCCL_MIN_CTAS", "NCCL_MAX_CTAS", "NCCL_CFG_PATH", "SEGMENT", "CPU_OFFLOADING", "DEFER_EMBEDDING_WGRAD_COMPUTE")
MLLOG = re.compile(r":::MLLOG (\{.*\})")


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", f"--git-dir={repo}", *args], check=True, capture_output=True, text=True).stdout


def ls(repo: Path, path: str) -> list[str]:
    out = git(repo, "ls-tree", "--name-only", "HEAD", path.rstrip("/") + "/")
    return [line for line in out.splitlines() if line]


def sourced_env(repo: Path, impl: str, config: str) -> tuple[dict, list[str]]:
    """The environment ``source config`` exports, and the config files present (the implementation's own, else the
    shared ``implementations/nemo`` folder the README points at)."""
    folder = impl if f"{impl}/{config}" in ls(repo, impl) else str(Path(impl).parent / "nemo")
    files = [f for f in ls(repo, folder) if re.search(r"/config_[^/]*\.sh$", f)]
    with tempfile.TemporaryDirectory() as tmp:
        for f in files:
            (Path(tmp) / Path(f).name).write_text(git(repo, "show", f"HEAD:{f}"))
        out = subprocess.run(["env", "-i", "PATH=/usr/bin:/bin", "bash", "--noprofile", "--norc", "-c",
                              f"source ./{config} >/dev/null 2>&1; env"], cwd=tmp, capture_output=True,
                             text=True, check=True).stdout
    env = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    return {k: env[k] for k in ENV_KEYS if k in env}, [f"{folder}/{config}"]


def read_log(text: str) -> list[dict]:
    return [json.loads(m.group(1)) for m in map(MLLOG.search, text.splitlines()) if m]


def validation_times(events: list[dict]) -> list[float]:
    """Logged validation_step_time values, each evaluation's first left out (module docstring)."""
    out, first = [], True
    for e in events:
        if e["key"] == "eval_start":
            first = True
        elif e["key"] == "tracked_stats" and isinstance(e["value"], dict) and "validation_step_time" in e["value"]:
            if not first:
                out.append(e["value"]["validation_step_time"])
            first = False
    return out


def step_times(events: list[dict]) -> tuple[list[float], list[float], dict]:
    """(logged train_step_time values but the first, block-based step times but the first block, log constants)."""
    const = {e["key"]: e["value"] for e in events if e["key"] in ("global_batch_size", "gradient_accumulation_steps",
                                                                  "max_sequence_length", "submission_platform")}
    gbs = const["global_batch_size"]
    logged = [e["value"]["train_step_time"] for e in events
              if e["key"] == "tracked_stats" and isinstance(e["value"], dict) and "train_step_time" in e["value"]
              and e["metadata"].get("step") is not None]     # (a run's closing average has no step)
    blocks, start = [], None
    for i, e in enumerate(events):
        if e["key"] == "block_start":
            start = e
        elif e["key"] == "block_stop" and start is not None:
            a, b = start["metadata"], e["metadata"]
            if "step" in a and "step" in b:           # v5.1: the steps at the block's ends
                steps = b["step"] - a["step"]
            elif "epoch_count" in a:                  # v4.x: the block's tokens
                steps = a["epoch_count"] / (gbs * const["max_sequence_length"])
            else:                                     # v5.0: cumulative samples at the block's start and next eval
                nxt = next((x for x in events[i:] if x["key"] == "eval_start"), None)
                steps = (nxt["metadata"]["samples_count"] - a["samples_count"]) / gbs if nxt else 0
            if steps >= 1:
                blocks.append((e["time_ms"] - start["time_ms"]) / 1e3 / steps)
            start = None
    return logged[1:], blocks[1:], const


def row_of(repo: Path, rnd: str, commit: str, sub: str, bench: str) -> dict | None:
    impl = f"NVIDIA/benchmarks/{bench}/implementations/{sub}"
    readme = next((f for f in ls(repo, impl) if "/README-" in f), None)
    if readme is None:
        return None
    config = re.search(r"source (config_[A-Za-z0-9_x]+\.sh)", git(repo, "show", f"HEAD:{readme}")).group(1)
    env, config_paths = sourced_env(repo, impl, config)
    results = sorted(f for f in ls(repo, f"NVIDIA/results/{sub}/{bench}") if re.search(r"result_\d+\.txt$", f))
    logged, blocks, consts, valid = [], [], [], []
    for f in results:
        events = read_log(git(repo, "show", f"HEAD:{f}"))
        lg, bl, const = step_times(events)
        valid += validation_times(events)
        logged += lg
        blocks += bl
        consts.append(const)
    if any(c != consts[0] for c in consts):
        raise SystemExit(f"{sub}/{bench}: the result files disagree on {consts}")
    system_path = f"NVIDIA/systems/{sub}.json"
    system = json.loads(git(repo, "show", f"HEAD:{system_path}"))
    step = statistics.median(logged) if logged else statistics.median(blocks)
    checks = []
    n = int(system["number_of_nodes"]) * int(system["accelerators_per_node"])
    dp = n // (int(env["TENSOR_MODEL_PARALLEL"]) * int(env["PIPELINE_MODEL_PARALLEL"]) *
               int(env.get("CONTEXT_PARALLEL", 1)))
    gbs = consts[0]["global_batch_size"]
    if int(env["MINIBS"]) * dp != gbs:      # the config's GBS = MINIBS x DP (conf/custom.yaml)
        checks.append(f"the config's MINIBS {env['MINIBS']} x DP {dp} = {int(env['MINIBS']) * dp} disagrees with the "
                      f"logged global_batch_size {gbs} (= GA {consts[0]['gradient_accumulation_steps']} x MBS "
                      f"{env['MICRO_BATCH_SIZE']} x DP {dp}): the run's own log is taken")
    return {
        "id": f"v{rnd}/{sub}/{bench}", "round": f"v{rnd}", "submission": sub, "benchmark": bench,
        "source": {"repo": f"mlcommons/training_results_v{rnd}", "commit": commit, "readme": readme,
                   "config": config_paths[0], "results": results, "system": system_path},
        "system": {k: system.get(k) for k in ("system_name", "number_of_nodes", "accelerators_per_node",
                                              "accelerator_model_name", "accelerator_memory_capacity",
                                              "host_networking", "accelerator_interconnect", "framework")},
        "log": consts[0], "env": env,
        "measured": {"step_s": step,
                     "method": "median logged train_step_time" if logged else "median block time / block steps",
                     "samples": len(logged) if logged else len(blocks),
                     "block_step_s": statistics.median(blocks) if blocks else None,
                     "validation_step_s": statistics.median(valid) if valid else None,
                     "validation_samples": len(valid),
                     "files": len(results)},
        "checks": checks,
    }


def main(argv: list[str]) -> int:
    mirror = Path(argv[0]) if argv else Path("/work/.mirror")
    rows: dict[tuple[str, str], dict] = {}
    for rnd in ROUNDS:
        repo = mirror / f"mlcommons+training_results_v{rnd}" / "repo"
        if not repo.exists():
            print(f"skipped v{rnd}: {repo} is absent")
            continue
        commit = git(repo, "rev-parse", "HEAD").strip()
        for sub in [Path(p).name for p in ls(repo, "NVIDIA/results")]:
            for bench in BENCHMARKS:
                if f"NVIDIA/results/{sub}/{bench}" not in ls(repo, f"NVIDIA/results/{sub}"):
                    continue
                row = row_of(repo, rnd, commit, sub, bench)
                if row is None:
                    continue
                key = (sub, bench)
                if key in rows:     # a submission republished by a later round: the later round's runs
                    row["also_published"] = [{"round": rows[key]["round"], "step_s": rows[key]["measured"]["step_s"],
                                              "results": rows[key]["source"]["results"]}]
                rows[key] = row
                print(f"{row['id']}: {row['measured']['step_s']:.4f} s ({row['measured']['method']})")
    out = {"about": __doc__.split("\n\n")[0], "rows": list(rows.values())}
    OUT.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {OUT} ({len(rows)} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
