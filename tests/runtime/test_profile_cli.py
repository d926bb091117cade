"""``aceso profile`` option checks: bad input is one line and exit 2 before any process starts; the torchrun
command it builds; the partial-file guard."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from aceso_megatron.cli.profile import torchrun_command
from aceso_megatron.profiler.args import header
from search.cli import build_parser

TINY = {"name": "tiny-gpt", "family": "gpt", "num_layers": 2, "hidden_size": 32, "num_attention_heads": 4,
        "ffn_hidden_size": 64, "seq_length": 16, "vocab_size": 128, "params_dtype": "fp32"}


@pytest.fixture()
def spec(tmp_path):
    p = tmp_path / "tiny.json"
    p.write_text(json.dumps(TINY))
    return p


def _run(*argv):
    return subprocess.run([sys.executable, "-m", "search", "profile", *map(str, argv)], capture_output=True,
                          text=True, timeout=60, check=False)


@pytest.mark.parametrize("extra, needle", [
    (["--tp", "3"], "--tp 3: num_attention_heads (4)"),
    (["--tp", "1", "2", "--nproc", "3"], "--tp 2 does not divide the 3 processes"),
    (["--micro-batch-sizes", "0"], "--micro-batch-sizes 0"),
    (["--repeats", "0"], "--repeats and --passes must be at least 1"),
    (["--passes", "0"], "--repeats and --passes must be at least 1"),
    (["--min-bytes", "4096", "--max-bytes", "1024"], "--min-bytes (4096)"),
])
def test_bad_options_exit_2(spec, tmp_path, extra, needle):
    r = _run("--model", spec, "-o", tmp_path / "db.json", "--cpu", *extra)
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and needle in lines[0], r.stderr
    assert not (tmp_path / "db.json").exists()


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a machine with CUDA profiles GPUs")
@pytest.mark.parametrize("visible, needle", [
    ("", "no GPU on this node"),                           # CUDA_VISIBLE_DEVICES empty: found without torch
    ("0", "no CUDA device: torch"),                         # a GPU named but torch cannot use it (CPU build here)
])
def test_no_cuda_without_cpu_is_one_line(spec, tmp_path, visible, needle):
    """Without --cpu on a machine without CUDA: one line naming --cpu, exit 2, before any worker starts (was 313
    lines, 8 tracebacks and exit 1 for --tp 1 2 4 8); the worker under torchrun itself says the same line."""
    import os

    env = dict(os.environ, CUDA_VISIBLE_DEVICES=visible)
    r = subprocess.run([sys.executable, "-m", "search", "profile", "--model", str(spec), "--tp", "1", "2", "-o",
                        str(tmp_path / "db.json")], capture_output=True, text=True, timeout=120, env=env)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1 and needle in lines[0] and "--cpu" in lines[0], r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "db.json").exists()
    from aceso_megatron.profiler.run import main

    assert main(["--model", str(spec), "-o", str(tmp_path / "db.json")]) == 2     # the worker: before any group


def test_missing_folder(spec, tmp_path):
    r = _run("--model", spec, "-o", tmp_path / "nope" / "db.json", "--cpu")
    assert r.returncode == 2 and "does not exist" in r.stderr


def test_partial_from_other_settings_refused(spec, tmp_path):
    db = tmp_path / "db.json"
    (tmp_path / "db.json.partial.jsonl").write_text(json.dumps({"header": {"repeats": 99}}) + "\n")
    r = _run("--model", spec, "-o", db, "--cpu")
    assert r.returncode == 2 and "--fresh" in r.stderr


def test_torchrun_command(spec, tmp_path):
    args = build_parser().parse_args(["profile", "--model", str(spec), "--tp", "1", "2", "--micro-batch-sizes",
                                      "1", "4", "-o", str(tmp_path / "db.json"), "--cpu", "--repeats", "3"])
    cmd = torchrun_command(args, 2)
    assert cmd[1:6] == ["-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone"]
    i = cmd.index("aceso_megatron.profiler")
    assert cmd[i - 1] == "-m"
    worker = cmd[i + 1:]
    assert worker[worker.index("--tp") + 1:worker.index("--tp") + 3] == ["1", "2"]
    assert "--cpu" in worker and "--nproc" not in worker     # torchrun would take --nproc for itself
    # the worker parses the same options back into the same run header
    from aceso_megatron.profiler.args import model_from_args

    wargs = build_parser().parse_args(["profile", *worker])
    assert header(wargs, model_from_args(wargs), 2) == header(args, model_from_args(args), 2)


def test_moe_model_the_runtime_refuses_is_refused_before_any_process(tmp_path):
    """A LatentMoE model (the runtime does not build its latent projections: runtime_rules.latent_moe) is one line,
    exit 2, from the launcher, not a traceback in the workers."""
    p = tmp_path / "moe.json"
    p.write_text(json.dumps({**TINY, "moe": {"num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 32,
                                             "moe_latent_size": 16}}))
    r = _run("--model", p, "--ep", "2", "-o", tmp_path / "db.json", "--cpu")
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "moe.moe_latent_size" in lines[0], r.stderr
    assert not (tmp_path / "db.json").exists()


def test_moe_ep_in_the_worker_command(tmp_path):
    p = tmp_path / "moe.json"
    p.write_text(json.dumps({**TINY, "add_bias_linear": False,
                             "moe": {"num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 32}}))
    args = build_parser().parse_args(["profile", "--model", str(p), "--ep", "1", "2", "-o", str(tmp_path / "d.json"),
                                      "--cpu"])
    from aceso_megatron.cli.profile import num_procs

    cmd = torchrun_command(args, num_procs(args))
    assert cmd[cmd.index("--nproc-per-node") + 1] == "2" and cmd[cmd.index("--ep"):][:3] == ["--ep", "1", "2"]
