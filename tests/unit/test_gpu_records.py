"""GPUs as data (issue 35a): one record per GPU (search/data/gpus.json), an unknown GPU name refused instead of
priced with another GPU's constants, and a GPU added by one record file (``--gpu-file``) planned end to end.

The record used is a GH200-class superchip (tests/unit/data/gh200.json, numbers from NVIDIA's GH200 datasheet,
sourced in the file)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from search.cli import main
from search.spec.cluster import GPU_PRESETS, ClusterSpec, GPUSpec, gpu_for_device, gpu_record, load_gpu_file, parse_cluster
from search.pricing import make_cost_model
from search.io.errors import AcesoError
from search.spec.training import TrainingSpec
from search.spec.presets import load_model

GH200 = Path(__file__).parent / "data" / "gh200.json"


def _run(capsys, *argv) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def _one_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_unknown_gpu_is_refused_not_priced_as_a100():
    """A cluster of a GPU no record names (a plan written elsewhere, a hand-made ClusterSpec) used to be priced
    with A100 kernel constants (kernels.py ``ARCH.get(gpu, ARCH["a100"])``); now pricing it names the field and
    the known GPUs."""
    a100 = GPU_PRESETS["a100"]
    gpu = GPUSpec(**{**a100.model_dump(exclude_none=True), "name": "mi300x"})
    cluster = ClusterSpec(num_nodes=1, gpus_per_node=8, gpu=gpu, intra_node_gbps=300.0, inter_node_gbps=25.0)
    with pytest.raises(AcesoError) as e:
        make_cost_model(load_model("gpt-1.3b"), cluster, TrainingSpec(global_batch_size=8))
    msg = str(e.value)
    assert msg.startswith("gpu 'mi300x': unknown GPU") and "h100" in msg and "--gpu-file" in msg, msg
    with pytest.raises(AcesoError, match="unknown GPU"):
        gpu_record("mi300x")


def test_records_hold_the_datasheet_numbers():
    """The data file's records are the presets: H100-SXM5 datasheet (989 dense bf16, 1979 FP8, 3350 GB/s HBM3,
    NVLink4 900 GB/s bidirectional = 450 per direction, NDR 400 Gb/s = 50 GB/s, PCIe Gen5 x16 64 GB/s)."""
    c = parse_cluster("2x8-h100")
    assert (c.gpu.peak_tflops("bf16"), c.gpu.peak_tflops("fp8"), c.gpu.hbm_gbps) == (989, 1979, 3350)
    assert (c.intra_node_gbps, c.inter_node_gbps, gpu_record("h100").host_link_gbps) == (450, 50, 64)
    assert parse_cluster("2x8-h100").nvlink_size == 8 and parse_cluster("16x4-gb200-nvl72").nvlink_size == 72


def test_gpu_file_plans_end_to_end(tmp_path, capsys):
    """``aceso search --gpu-file gh200.json --cluster 1x4-gh200-custom`` plans with the file's numbers, and
    explain prices the plan it wrote the same way; without the file the name is refused (exit 2, one line)."""
    rec = json.loads(GH200.read_text())
    rc, _, err = _run(capsys, "search", "--model", "gpt-1.3b", "--cluster", "1x4-gh200-custom",
                      "--global-batch-size", "16", "-o", str(tmp_path / "refused.json"))
    assert rc == 2 and "gh200-custom" in _one_line(err) and not (tmp_path / "refused.json").exists()

    plan_file = tmp_path / "plan.json"
    rc, out, err = _run(capsys, "search", "--gpu-file", str(GH200), "--model", "gpt-1.3b", "--cluster",
                        "1x4-gh200-custom", "--global-batch-size", "16", "-o", str(plan_file))
    assert rc == 0, err
    plan = json.loads(plan_file.read_text())
    c = plan["cluster"]
    assert c["gpu"]["name"] == "gh200-custom" and c["gpu"]["memory_gib"] == rec["memory_gib"]
    assert (c["gpu"]["hbm_gbps"], c["gpu"]["peak_tflops_bf16"]) == (rec["hbm_gbps"], rec["peak_tflops_bf16"])
    assert (c["intra_node_gbps"], c["inter_node_gbps"]) == (rec["nvlink_gbps"], rec["network_gbps"])
    assert max(plan["predicted"]["stage_memory_mib"]) <= rec["memory_gib"] * 1024

    rc, out, err = _run(capsys, "clusters", "--gpu-file", str(GH200), "--json")
    assert rc == 0 and {"gpu": "gh200-custom", "hbm_gbps": rec["hbm_gbps"]}.items() <= next(
        r for r in json.loads(out) if r["gpu"] == "gh200-custom").items()

    rc, out, err = _run(capsys, "explain", "--gpu-file", str(GH200), str(plan_file), "--json")
    assert rc == 0, err
    got = json.loads(out)
    assert got["iteration_time_ms"] == pytest.approx(plan["predicted"]["iteration_time_ms"], rel=1e-9)
    assert got["memory_limit_mib"] == rec["memory_gib"] * 1024
    # the same plan on an H100 (the same die and kernel constants, a lower peak and HBM bandwidth) is not faster
    rc, out, err = _run(capsys, "explain", str(plan_file), "--cluster", "1x4-h100", "--json")
    assert rc == 0, err
    assert json.loads(out)["iteration_time_ms"] >= got["iteration_time_ms"]

    # the same plan under a name no record has: refused, not priced as an A100
    plan["cluster"]["gpu"]["name"] = "mi300x"
    other = tmp_path / "other.json"
    other.write_text(json.dumps(plan))
    rc, _, err = _run(capsys, "explain", str(other))
    line = _one_line(err)
    assert rc == 2 and "gpu 'mi300x': unknown GPU" in line and "gh200-custom" in line, line


@pytest.mark.parametrize("edit, expect", [
    (lambda r: r.pop("source"), "source"),
    (lambda r: r.update(name="h100"), "h100"),
    (lambda r: r.update(hbm_gbps=-1), "hbm_gbps"),
])
def test_bad_gpu_file(tmp_path, capsys, edit, expect):
    """A bad record: one line naming the file and the field, exit 2, nothing written."""
    rec = json.loads(GH200.read_text())
    rec["name"] = "gh200-bad"
    edit(rec)
    f = tmp_path / "bad.json"
    f.write_text(json.dumps(rec))
    rc, _, err = _run(capsys, "search", "--gpu-file", str(f), "--model", "gpt-1.3b", "--cluster", "1x4-h100",
                      "--global-batch-size", "16", "-o", str(tmp_path / "p.json"))
    line = _one_line(err)
    assert rc == 2 and str(f) in line and expect in line, line
    assert not (tmp_path / "p.json").exists()


def test_device_names_match_their_record():
    """torch.cuda.get_device_name() strings (nvidia-smi names) to records; a GH200 superchip was taken for an H200
    (the old pattern "H200" matched "GH200"): no record until one is added, then that one."""
    names = {"NVIDIA H100 80GB HBM3": "h100", "NVIDIA H200": "h200", "NVIDIA A100-SXM4-40GB": "a100-40gb",
             "NVIDIA A100-SXM4-80GB": "a100", "Tesla V100-SXM2-32GB": "v100", "NVIDIA B200": "b200",
             "NVIDIA GB200": "gb200", "NVIDIA GB300": "gb300", "NVIDIA L4": None}
    assert {n: gpu_for_device(n) for n in names} == names
    assert gpu_for_device("NVIDIA GH200 480GB") in (None, "gh200-custom")
    load_gpu_file(GH200)
    assert gpu_for_device("NVIDIA GH200 480GB") == "gh200-custom"
