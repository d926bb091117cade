"""A CPU run of a plan priced on the nominal ``cpu`` preset says so at its predicted-vs-measured summary (the README's
tiny run printed 10.6 ms predicted beside 106.5 ms measured without a word), and ``aceso calibrate`` fits the
preset from that run -- its console output saved to a file, or its ``--log-file`` -- so that the plan priced with
the calibration lands on the measured time (the fit was held at 1/4 of the nominal numbers: -82% after).
``machine_note`` also says when a GPU plan runs on CPU, and nothing once the plan was priced calibrated."""

from __future__ import annotations

import json

import pytest

from aceso_megatron.testing import run_fresh
from aceso_megatron.training.train_log import machine_note
from search.costmodel.calibration import load_calibration
from search.cli import main
from tests.tiny_models import GPT


def test_a_cpu_run_says_its_preset_is_nominal_and_calibrate_fits_it(tmp_path, capfd):
    plan_file = tmp_path / "plan.json"
    assert main(["search", "--model", str(_spec(tmp_path)), "--cluster", "1x1-cpu", "--global-batch-size", "4",
                 "--precision", "fp32", "-o", str(plan_file)]) == 0
    predicted = json.loads(plan_file.read_text())["predicted"]["iteration_time_ms"]
    capfd.readouterr()
    log = tmp_path / "train.jsonl"
    run_fresh(main, ["train", str(plan_file), "--cpu", "--mock-data", "--train-iters", "12", "--log-interval", "3",
                     "--log-file", str(log)])
    out = capfd.readouterr().out
    (tmp_path / "console.log").write_text(out)
    assert f"plan {json.loads(log.read_text().splitlines()[0])['plan_digest']}: " in out
    note = next(ln for ln in out.splitlines() if "nominal CPU" in ln)
    assert f"aceso calibrate --run {plan_file} {log} -o calib.json" in note, note
    measured = json.loads(log.read_text().splitlines()[-1])
    assert measured["kind"] == "summary" and "nominal CPU" in measured["prediction_note"]
    fitted = {}
    for name in ("train.jsonl", "console.log"):           # the --log-file and the console output read alike
        calib = tmp_path / f"calib-{name}.json"
        assert main(["calibrate", "--run", str(plan_file), str(tmp_path / name), "-o", str(calib)]) == 0
        (r,) = load_calibration(str(calib)).gpus["cpu"].runs
        assert r.predicted_before_ms == pytest.approx(predicted, rel=1e-6)
        assert abs(r.error_after) < 0.02, r          # was -82% (the fit stopped at 1/4 of the nominal preset)
        assert r.measured_memory_mb is None           # CPU max RSS is not what the cost model prices
        fitted[name] = r.measured_iteration_ms
        capfd.readouterr()
        assert main(["explain", str(plan_file), "--calibration", str(calib), "--json"]) == 0
        got = json.loads(capfd.readouterr().out)["iteration_time_ms"]
        assert got == pytest.approx(r.measured_iteration_ms, rel=0.02)
    assert fitted["console.log"] == pytest.approx(fitted["train.jsonl"], abs=0.06)   # printed to 0.1 ms


def _spec(tmp_path):
    p = tmp_path / "tiny.json"
    p.write_text(GPT.model_dump_json())
    return p


@pytest.fixture(scope="module")
def gpu_plan_file(tmp_path_factory):
    """The tiny GPT's plan searched for 1x8-h100 (read, never changed, by both machine-note tests: one search)."""
    tmp_path = tmp_path_factory.mktemp("gpu-plan")
    assert main(["search", "--model", str(_spec(tmp_path)), "--cluster", "1x8-h100", "--global-batch-size", "8",
                 "-o", str(tmp_path / "gpu.json")]) == 0
    return tmp_path / "gpu.json"


def test_machine_note_names_the_mismatch_and_is_quiet_when_calibrated(tmp_path, gpu_plan_file):
    import shutil

    from search.costmodel.calibration import CalibrationFile, GPUCalibration, apply_calibration
    from search.spec.plan import load_plan

    gpu_plan = load_plan(gpu_plan_file)
    note = machine_note(gpu_plan, "cpu", "gpu.json", None)
    assert note.startswith("predicted for 1x8-h100, h100 GPUs; this run is on CPU processes")
    shutil.copy(gpu_plan_file, tmp_path / "cpu.json")
    assert main(["search", "--model", str(_spec(tmp_path)), "--cluster", "1x2-cpu", "--global-batch-size", "8",
                 "--precision", "fp32", "-o", str(tmp_path / "cpu.json")]) == 0
    cpu_plan = load_plan(tmp_path / "cpu.json")
    assert "LOG (this run's output saved to a file)" in machine_note(cpu_plan, "cpu", "cpu.json", None)
    calib = CalibrationFile(gpus={"cpu": GPUCalibration(gemm_efficiency=0.02, attention_efficiency=0.04,
                                                        memory_reserve_mib=1024.0)})
    calibrated = cpu_plan.model_copy(update={"cluster": apply_calibration(cpu_plan.cluster, calib)})
    assert machine_note(calibrated, "cpu", "cpu.json", None) is None


def test_machine_note_on_gpus_compares_the_device_with_the_preset(gpu_plan_file, monkeypatch):
    """A CUDA run: the device name's preset (``search.spec.cluster.gpu_for_device``) against the plan's GPU."""
    import torch

    from search.spec.plan import load_plan

    plan = load_plan(gpu_plan_file)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA A100-SXM4-80GB")
    note = machine_note(plan, "cuda", "gpu.json", "t.jsonl")
    assert "this run is on NVIDIA A100-SXM4-80GB (a100)" in note and "search a plan for a100" in note, note
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    assert machine_note(plan, "cuda", "gpu.json", "t.jsonl") is None
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA GB200")
    assert "(gb200)" in machine_note(plan, "cuda", "gpu.json", "t.jsonl")
