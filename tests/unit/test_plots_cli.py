"""Every plot command writes a non-empty image of the expected size (matplotlib's Agg backend), and without
matplotlib says how to install it: one line, exit 2, nothing written (the import blocked in a subprocess)."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import textwrap

import pytest

from search.cli import main
from search.spec.cluster import parse_cluster
from search.spec.plan import uniform_plan
from search.plots import DPI
from search.plots import explain as explain_figure
from search.plots import search_progress, training
from tests.conftest import ROOT
from tests.unit.test_plots_data import FOUR, GPT, TWO


def png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return struct.unpack(">II", data[16:24])


def px(inches: tuple[float, float]) -> tuple[int, int]:
    return round(inches[0] * DPI), round(inches[1] * DPI)


@pytest.fixture
def plan_files(tmp_path):
    paths = {}
    for name, plan in (("two", TWO), ("four", FOUR)):
        paths[name] = tmp_path / f"{name}.json"
        paths[name].write_text(plan.to_json())
    return paths


@pytest.fixture
def log_file(tmp_path):
    recs = [{"kind": "train", "iteration": i, "loss": 6.0 / i, "grad_norm": 1.0, "lr": 1e-3,
             "iteration_time_ms": 400.0 + i, "tokens_per_s": 2000.0, "tflops_per_gpu": 0.01,
             "stage_max_memory_mb": [500.0, 400.0, 300.0]} for i in range(1, 21)]
    recs += [{"kind": "eval", "iteration": 10, "loss": 0.7, "ppl": 2.0},
             {"kind": "summary", "measured_iteration_time_ms": 410.0, "measured_stage_memory_mb": [500.0, 400.0, 300.0],
              "predicted_iteration_time_ms": 380.0, "predicted_stage_memory_mb": [520.0, 380.0, 310.0],
              "memory_kind": "cuda_max_allocated"}]
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


# ----- with matplotlib ---------------------------------------------------------------------------------------------
def test_explain_writes_png_svg_pdf_of_the_expected_size(plan_files, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    for name, plan in (("two", TWO), ("four", FOUR)):
        out = tmp_path / f"{name}.png"
        assert main(["explain", str(plan_files[name]), "--plot", str(out)]) == 0
        w, h = png_size(out)
        assert (w, h) == px(explain_figure.figure_inches(plan.num_stages, 1)) and w == 1400
    assert main(["explain", str(plan_files["two"]), "--json", "--plot", str(tmp_path / "two.svg")]) == 0
    assert b"<svg" in (tmp_path / "two.svg").read_bytes()[:2000]
    assert main(["explain", str(plan_files["two"]), "--plot", str(tmp_path / "two.pdf")]) == 0
    assert (tmp_path / "two.pdf").read_bytes()[:5] == b"%PDF-"
    assert main(["explain", str(plan_files["two"]), "--plot", str(tmp_path / "picture"), "--plot-format", "png"]) == 0
    assert png_size(tmp_path / "picture")[0] == 1400
    capsys.readouterr()


def test_explain_plots_a_big_pipeline_legibly_sized(tmp_path, capsys):
    """64 stages x 500 micro-batches: the timeline shows MAX_ROWS stages, so the figure stays a fixed size."""
    pytest.importorskip("matplotlib")
    from search.spec.presets import load_model
    plan = uniform_plan(load_model("gpt-175b"), 64, 8, 1, 1, 500, recompute="full",
                        cluster=parse_cluster("64x8-h100"))
    (tmp_path / "big.json").write_text(plan.to_json())
    assert main(["explain", str(tmp_path / "big.json"), "--json", "--plot", str(tmp_path / "big.png")]) == 0
    bottleneck = json.loads(capsys.readouterr().out)["bottleneck_stage"]
    assert png_size(tmp_path / "big.png") == px(explain_figure.figure_inches(64, 1, bottleneck))
    assert explain_figure.figure_inches(64, 1) == explain_figure.figure_inches(1000, 1)


def test_search_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "search.png"
    assert main(["search", "--model", "gpt-1.3b", "--num-layers", "4", "--cluster", "1x4-h100",
                 "--global-batch-size", "64", "--budget-evals", "200", "--json", "--plot", str(out)]) == 0
    assert png_size(out) == px((search_progress.WIDTH_IN, search_progress.HEIGHT_IN))
    capsys.readouterr()


def test_plot_redraws_a_training_log(log_file, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    assert main(["plot", str(log_file)]) == 0                       # default: beside the log, .png
    assert png_size(log_file.with_suffix(".png")) == px((training.WIDTH_IN, training.HEIGHT_IN))
    assert main(["plot", str(log_file), "-o", str(tmp_path / "run.svg")]) == 0
    assert (tmp_path / "run.svg").stat().st_size > 1000
    assert "wrote" in capsys.readouterr().out


def test_launch_hands_plot_to_train(plan_files, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from tests.tiny_models import GPT as TINY
    one = uniform_plan(TINY, 1, 1, 1, 2, 4, cluster=parse_cluster("1x1-cpu"))
    (tmp_path / "one.json").write_text(one.to_json())
    assert main(["launch", str(tmp_path / "one.json"), "--cpu", "--dry-run", "--plot", str(tmp_path / "t.svg"),
                 "--", "--mock-data", "--train-iters", "2", "--log-file", "t.jsonl"]) == 0
    line = capsys.readouterr().out
    assert f"--plot {tmp_path / 't.svg'}" in line and "--log-file t.jsonl" in line


# ----- bad input: one line, exit 2, nothing written -------------------------------------------------------------
@pytest.mark.parametrize("name,words", [("out.gif", "unknown image format .gif"),
                                        ("nofolder/out.png", "folder nofolder does not exist"),
                                        ("-", "cannot go to stdout")])
def test_bad_plot_targets_exit_2(plan_files, tmp_path, monkeypatch, capsys, name, words):
    monkeypatch.chdir(tmp_path)
    assert main(["explain", str(plan_files["two"]), "--plot", name]) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and len(err.splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["four.json", "two.json"]


def test_train_plot_needs_a_log_file(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    one = uniform_plan(GPT, 1, 1, 1, 1, 8, cluster=parse_cluster("1x1-a100"))
    (tmp_path / "one.json").write_text(one.to_json())
    code = run_blocked(["train", str(tmp_path / "one.json"), "--cpu", "--mock-data", "--train-iters", "1",
                        "--plot", str(tmp_path / "t.png")], block=("torch", "megatron"))
    assert code.returncode == 2, code.stderr
    assert "add --log-file FILE" in code.stderr and len(code.stderr.strip().splitlines()) == 1


BLOCKER = textwrap.dedent("""
    import importlib.abc, sys
    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split('.')[0] in {blocked!r}:
                raise ImportError(f'blocked import of {{name}}')
    sys.meta_path.insert(0, Block())
    from search.cli import main
    sys.exit(main({argv!r}))
""")


def run_blocked(argv: list[str], block=("matplotlib",)) -> subprocess.CompletedProcess:
    code = BLOCKER.format(blocked=tuple(block), argv=argv)
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_every_plot_command_without_matplotlib_is_one_line_and_exit_2(plan_files, log_file, tmp_path):
    one = uniform_plan(GPT, 1, 1, 1, 1, 8, cluster=parse_cluster("1x1-a100"))
    (tmp_path / "one.json").write_text(one.to_json())
    out = tmp_path / "out.png"
    commands = {
        "explain": ["explain", str(plan_files["two"]), "--plot", str(out)],
        "search": ["search", "--model", "gpt-1.3b", "--num-layers", "4", "--cluster", "1x4-h100",
                   "--global-batch-size", "64", "--budget-evals", "50", "--plot", str(out), "-o",
                   str(tmp_path / "plan.json")],
        "plot": ["plot", str(log_file), "-o", str(out)],
        # before torch is imported: the check runs before training starts (torch blocked too)
        "train": ["train", str(tmp_path / "one.json"), "--cpu", "--mock-data", "--train-iters", "1",
                  "--log-file", str(tmp_path / "t.jsonl"), "--plot", str(out)],
        "launch": ["launch", str(tmp_path / "one.json"), "--cpu", "--plot", str(out), "--", "--mock-data",
                   "--train-iters", "1", "--log-file", str(tmp_path / "t.jsonl")],
    }
    for name, argv in commands.items():
        r = run_blocked(argv, block=("matplotlib", "torch", "megatron") if name in ("train", "launch")
                        else ("matplotlib",))
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2, (name, r.stderr)
        assert len(lines) == 1 and "needs matplotlib" in lines[0] and 'pip install -e ".[plot]"' in lines[0], name
    assert sorted(p.name for p in tmp_path.iterdir()) == ["four.json", "one.json", "train.jsonl", "two.json"]


def test_readme_and_ci_install_the_same_extras_with_plot():
    import re
    readme = re.search(r'pip install -e "\.\[([a-z,]+)\]" && aceso', (ROOT / "README.md").read_text()).group(1)
    ci = re.search(r'pip install -q -e "\.\[([a-z,]+)\]"', (ROOT / ".ci" / "run").read_text()).group(1)
    assert readme == ci and "plot" in readme.split(",")
    assert '"plot": ["matplotlib' in (ROOT / "setup.py").read_text()


def test_explain_plots_a_reference_config_under_aceso_compat(reference_db, tmp_path, capsys):
    """The compat model has no event list: the 1F1B simulation of its stage times, one activations segment."""
    pytest.importorskip("matplotlib")
    cfg = reference_db / "configs" / "gpt_1_3B_4gpus_reference_search.json"
    out = tmp_path / "ref.png"
    assert main(["explain", str(cfg), "--cost-model", "aceso-compat", "--db", str(reference_db / "miniset"),
                 "--plot", str(out)]) == 0
    assert png_size(out) == px(explain_figure.figure_inches(4, 1))
    capsys.readouterr()


# ----- legible labels: no text box runs into another (matplotlib's own renderer extents) ----------------------------
def test_the_overlap_check_finds_overlapping_text():
    pytest.importorskip("matplotlib")
    from search.plots import pyplot
    from tests.unit.plot_layout import text_overlaps
    fig = pyplot().figure(figsize=(4, 3))
    fig.text(0.1, 0.5, "one label")
    fig.text(0.15, 0.5, "another label")
    fig.text(0.1, 0.1, "apart")
    assert text_overlaps(fig) == [("one label", "another label")]


def _interleaved_8_stage_plan():
    from search.spec.presets import load_model
    return uniform_plan(load_model("gpt-6.7b"), 8, 1, 1, 1, 48, cluster=parse_cluster("1x8-h100"),
                        num_virtual_stages=4, recompute="selective")


def test_pictures_have_no_overlapping_labels(plan_files, tmp_path, monkeypatch, capsys):
    """explain (2 and 4 stages, 8 interleaved stages with long chunk lists, 64 stages), search (a 10^5 ms axis)
    and a training log (stage shapes, a prediction far below the measured steps)."""
    pytest.importorskip("matplotlib")
    from tests.unit.plot_layout import capture
    found = capture(monkeypatch)
    from search.spec.presets import load_model
    (tmp_path / "i8.json").write_text(_interleaved_8_stage_plan().to_json())
    big = uniform_plan(load_model("gpt-175b"), 64, 8, 1, 1, 64, recompute="full", cluster=parse_cluster("64x8-h100"))
    (tmp_path / "big.json").write_text(big.to_json())
    for name in ("two", "four"):
        assert main(["explain", str(plan_files[name]), "--plot", str(tmp_path / f"{name}.png")]) == 0
    for name in ("i8", "big"):
        assert main(["explain", str(tmp_path / f"{name}.json"), "--plot", str(tmp_path / f"{name}.png")]) == 0
    assert main(["search", "--model", "gpt-175b", "--num-layers", "8", "--cluster", "2x8-h100",
                 "--global-batch-size", "1024", "--budget-evals", "60", "--plot", str(tmp_path / "s.png")]) == 0
    log = tmp_path / "t.jsonl"
    recs = [{"kind": "train", "iteration": i, "loss": 6.0 / i, "iteration_time_ms": 400.0 + i,
             "stage_max_memory_mb": [500.0] * 3} for i in range(1, 21)]
    recs.append({"kind": "summary", "measured_iteration_time_ms": 410.0, "measured_stage_memory_mb": [500.0] * 3,
                 "predicted_iteration_time_ms": 20.0, "predicted_stage_memory_mb": [520.0] * 3,
                 "memory_kind": "cpu_max_rss", "stage_shapes": ["tp2 cp2 dp1 sp", "tp1 dp4", "tp1 dp4"]})
    log.write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert main(["plot", str(log)]) == 0
    capsys.readouterr()
    assert len(found) == 6 and found == [[]] * 6


def test_training_legend_stays_off_the_step_time_lines(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from search.plots import training as training_figure
    figs = []
    monkeypatch.setattr(training_figure, "save", lambda fig, out: figs.append(fig))
    log = tmp_path / "t.jsonl"
    recs = [{"kind": "train", "iteration": i, "loss": 1.0, "iteration_time_ms": 400.0} for i in range(1, 5)]
    recs.append({"kind": "summary", "measured_iteration_time_ms": 400.0, "measured_stage_memory_mb": [1.0],
                 "predicted_iteration_time_ms": 10.0, "predicted_stage_memory_mb": [1.0]})
    log.write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert main(["plot", str(log), "-o", str(tmp_path / "t.png")]) == 0
    fig = figs[0]
    fig.canvas.draw()
    r = fig.canvas.get_renderer()
    step = next(ax for ax in fig.axes if ax.get_title(loc="left") == "step time")
    assert not step.get_legend().get_window_extent(r).overlaps(step.get_window_extent(r))
