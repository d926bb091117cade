"""`aceso calibrate`: Megatron-LM logs written by Megatron-LM's own format strings (megatron_log_format.py) are read
back, fitted, written as a calibration file that every command applies the same way, and bad logs are refused."""

import json
import math
import re

import numpy as np
import pytest

from megatron_log_format import iteration_line, megatron_log, memory_line
from search.calibration.calibrate import Run, calibrate, megatron_flops, price
from search.costmodel.calibration import (
    CalibrationFile, apply_calibration, defaults, load_calibration, scaled_cluster,
)
from search.cli import main
from search.spec.cluster import parse_cluster
from search.megatron.importer import read_megatron
from search.calibration.aceso_log import read_train_jsonl
from search.calibration.megatron_log import read_megatron_log

CLUSTER = "1x8-h100"
DEFAULT = defaults("h100", 450.0, 50.0)     # the analytic model's own values (kernels.ARCH, comm, memory)
ARGS = ("--num-layers 4 --hidden-size 2048 --num-attention-heads 16 --seq-length 2048 --max-position-embeddings 2048 "
        "--micro-batch-size 2 --global-batch-size 64 --bf16 --tensor-model-parallel-size {tp} --vocab-size 50257 "
        "--transformer-impl transformer_engine --use-distributed-optimizer")


def script(tp: int = 2) -> str:
    return "#!/bin/bash\ntorchrun --nproc-per-node 8 --nnodes 1 pretrain_gpt.py \\\n    " + ARGS.format(tp=tp) + "\n"


def imported(tp: int = 2):
    return read_megatron(script(tp), "run.sh", cluster=parse_cluster(CLUSTER))


def padded_vocab(imp) -> int:
    """Megatron-LM's _vocab_size_with_padding: up to a multiple of --make-vocab-size-divisible-by x tp."""
    multiple = imp.config.vocab_divisor * imp.config.tp
    return -(-50257 // multiple) * multiple


def log_for(imp, iteration_ms: float, reserved_mb: float | None = 30000.0, **args) -> str:
    c = imp.config
    printed = {"num_layers": c.model.num_layers, "hidden_size": c.model.hidden_size, "world_size": 8,
               "tensor_model_parallel_size": c.tp, "pipeline_model_parallel_size": c.pp,
               "global_batch_size": c.global_batch_size, "seq_length": c.model.seq_length, **args}
    peaks = {r: reserved_mb - 10 * r for r in range(c.tp)} if reserved_mb else None
    return megatron_log(iteration_ms, megatron_flops(imp.plan, padded_vocab(imp)), 8, c.global_batch_size,
                        printed, max_reserved_mb=peaks)


def write_run(tmp_path, tp=2, factor=1.25, name="run", **kw):
    imp = imported(tp)
    pred = price(Run("", imp.plan, imp.config.attention, "megatron-lm", None), imp.plan.cluster)
    (tmp_path / f"{name}.sh").write_text(script(tp))
    (tmp_path / f"{name}.log").write_text(log_for(imp, pred.iteration_ms * factor, **kw))
    return str(tmp_path / f"{name}.sh"), str(tmp_path / f"{name}.log"), pred


# ----- the log format ------------------------------------------------------------------------------------------
def test_megatron_flops_is_megatron_lm_core_v0_16_1_num_floating_point_operations():
    """Hand formula: 3 x 2 x per token (h (q + 2k) + q s (causal half of QK^T and PV) + q h + 2 h f + h V)."""
    imp = imported()
    h, s, L, B, V = 2048, 2048, 4, 64, padded_vocab(imp)
    per_layer = h * (3 * h) + h * s + h * h + 2 * h * (4 * h)
    assert megatron_flops(imp.plan, V) == pytest.approx(6 * B * s * (L * per_layer + h * V), rel=1e-12)
    assert V == 50432 == imp.config.model.padded_vocab_size


def test_a_log_from_megatron_lms_format_strings_reads_back():
    imp = imported()
    run = read_megatron_log(log_for(imp, 1234.56), "run.log")
    assert run.iteration_ms == 1234.6           # the steady intervals, rounded as Megatron-LM prints ({:.1f})
    assert run.global_batch_size == 64 and run.intervals == 6
    assert run.memory_mb == 30000.0 and run.memory_kind == "max_reserved"
    assert run.arguments["tensor_model_parallel_size"] == "2"
    expect = megatron_flops(imp.plan, padded_vocab(imp)) / 1.2346 / 8 / 1e12
    assert run.tflops_per_gpu == pytest.approx(expect, abs=0.06)


def test_the_line_format_is_megatron_lms():
    line = iteration_line(10, 100, 640, 4321.04, 412.34, 1e-4, 64, {"lm loss": 7.1, "zero": 0.0})
    assert line.startswith(" [2026-01-02 03:04:05.000000] iteration       10/     100 | consumed samples:"
                           "          640 |")
    assert " elapsed time per iteration (ms): 4321.0 | throughput per GPU (TFLOP/s/GPU): 412.3 |" in line
    assert " lm loss: 7.100000E+00 |" in line and "zero" not in line
    assert line.endswith(" number of skipped iterations:   0 | number of nan iterations:   0 |")
    assert memory_line(3, 2, 2**20, 2 * 2**20, 3 * 2**20, 4 * 2**20) == (
        "[Rank 3] (after 2 iterations) memory (MB) | allocated: 1.00 | max allocated: 2.00 | reserved: 3.00 | "
        "max reserved: 4.00")


RUN = {"kind": "run", "plan": "plan.json", "plan_digest": "0123456789abcdef", "model": "m", "world_size": 8,
       "global_batch_size": 64, "tokens_per_sample": 2048, "device": "cuda", "device_name": "NVIDIA H100 80GB HBM3",
       "cluster": "1x8-h100", "predicted_iteration_time_ms": 500.0}


def test_aceso_train_jsonl_reads_back():
    recs = [RUN, {"kind": "message", "text": "hello"}] + [
        {"kind": "train", "iteration": i, "loss": 5.0, "grad_norm": 1.0, "lr": 1e-4, "iteration_time_ms": ms,
         "tokens_per_s": 1.0, "tflops_per_gpu": 100.0, "stage_max_memory_mib": [1000.0, 1200.0 + i]}
        for i, ms in ((5, 900.0), (10, 500.0), (15, 520.0), (20, 510.0))]
    run = read_train_jsonl("\n".join(json.dumps(r) for r in recs) + "\n", "train.jsonl")
    assert run.iteration_ms == 510.0 and run.memory_mb == 1220.0 and run.memory_kind == "max_allocated"


# ----- the fit and the file ----------------------------------------------------------------------------------
def test_one_run_calibrates_to_its_measurement_and_the_file_round_trips(tmp_path, capsys):
    sh, log, pred = write_run(tmp_path, factor=1.25)
    out = tmp_path / "calib.json"
    assert main(["calibrate", "--run", sh, log, "--cluster", CLUSTER, "-o", str(out)]) == 0
    assert "run.sh + " in capsys.readouterr().out        # the table of residuals
    f = load_calibration(str(out))
    assert CalibrationFile.model_validate_json(f.to_json()) == f and f.to_json() == out.read_text()
    c = f.gpus["h100"]
    (r,) = c.runs
    measured = round(pred.iteration_ms * 1.25, 1)               # as the log prints it ({:.1f} ms)
    assert r.error_before == pytest.approx(pred.iteration_ms / measured - 1, abs=1e-9)
    assert abs(r.error_after) < 0.005 and c.gemm_efficiency < DEFAULT["gemm_efficiency"]
    assert c.inter_node_gbps is None                     # one node: the network was not measured
    assert c.memory_reserve_mib == pytest.approx(1024 + 30000 - pred.max_memory_mb, abs=0.1)
    # explain, search's cluster and validate apply the same file the same way
    plan = imported().plan
    cal = apply_calibration(plan.cluster, f)
    again = price(Run("", plan, "flash", "megatron-lm", None), cal)
    assert again.iteration_ms == pytest.approx(r.predicted_after_ms, rel=1e-12)
    assert apply_calibration(cal, f) == cal                                  # idempotent
    assert main(["explain", "--megatron-args-file", sh, "--cluster", CLUSTER, "--calibration", str(out),
                 "--search-budget-evals", "1", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["iteration_time_ms"] == pytest.approx(r.predicted_after_ms, rel=1e-9)
    assert got["memory_limit_mib"] == pytest.approx(cal.memory_mb)


def test_several_runs_recover_the_factors_that_made_them():
    """Runs at tp 1, 2, 4, 8 'measured' on a cluster with GEMMs at 0.85 and NVLink at 0.6 of the defaults."""
    truth = dict(gemm=0.85, attention=1.0, intra=0.6)
    runs = []
    for tp in (1, 2, 4, 8):
        imp = imported(tp)
        r = Run(f"tp{tp}", imp.plan, imp.config.attention, "megatron-lm", None)
        ms = price(r, scaled_cluster(imp.plan.cluster, **truth)).iteration_ms
        r.measured = read_megatron_log(log_for(imp, ms, reserved_mb=None), f"tp{tp}.log")
        runs.append(r)
    c = calibrate(runs).gpus["h100"]
    assert c.gemm_efficiency == pytest.approx(DEFAULT["gemm_efficiency"] * 0.85, rel=0.03)
    assert c.intra_node_gbps == pytest.approx(DEFAULT["intra_node_gbps"] * 0.6, rel=0.1)
    assert max(abs(r.error_after) for r in c.runs) < 0.003
    assert np.mean([abs(r.error_before) for r in c.runs]) > 0.1


# ----- bad input: one line, exit 2, nothing written ------------------------------------------------------------
def _refused(tmp_path, capsys, log_text: str, want: str, sh: str | None = None):
    sh = sh or write_run(tmp_path)[0]
    log = tmp_path / "bad.log"
    log.write_text(log_text)
    out = tmp_path / "calib.json"
    assert main(["calibrate", "--run", sh, str(log), "--cluster", CLUSTER, "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert want in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert not out.exists()


def test_bad_logs_are_refused(tmp_path, capsys):
    good = open(write_run(tmp_path)[1]).read()
    _refused(tmp_path, capsys, "", "the log is empty")
    _refused(tmp_path, capsys, "\n".join(good.splitlines()[:-1])[:-60], "cut off")
    _refused(tmp_path, capsys, good.replace("number of nan iterations:   0 |", "number of nan iterations:   1 |"),
             "NaN iterations")
    _refused(tmp_path, capsys, re.sub(r"(elapsed time per iteration \(ms\): )[0-9.]+", r"\1nan", good, count=2),
             "elapsed time per iteration is nan")
    oom = good + ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total "
                  "capacity of 79.11 GiB of which 1.02 GiB is free.\n")
    _refused(tmp_path, capsys, oom, "ran out of GPU memory")
    _refused(tmp_path, capsys, "using world size: 8\nsome text\n", "no 'elapsed time per iteration (ms)' line")


def test_a_log_of_another_model_or_cluster_is_refused(tmp_path, capsys):
    sh, _, _ = write_run(tmp_path)
    imp = imported()
    _refused(tmp_path, capsys, log_for(imp, 1000.0, num_layers=8), "another model", sh)
    _refused(tmp_path, capsys, log_for(imp, 1000.0, world_size=16), "another cluster", sh)
    other = imported(4)         # same shape printed, another throughput: the printed block lies or is missing
    text = megatron_log(1000.0, 2.0 * megatron_flops(other.plan, padded_vocab(other)), 8, 64, {})
    _refused(tmp_path, capsys, text, "another model or cluster", sh)


def test_bad_calibration_files_are_refused(tmp_path, capsys):
    bad = tmp_path / "c.json"
    bad.write_text('{"kind": "aceso-calibration", "schema_version": 1, "gpus": {"h100": {"gemm_efficiency": NaN, '
                   '"attention_efficiency": 0.4, "memory_reserve_mib": 1024}}}')
    assert main(["validate", "--calibration", str(bad), str(_plan(tmp_path))]) == 2
    assert "gemm_efficiency" in capsys.readouterr().err
    bad.write_text('{"kind": "aceso-calibration", "schema_version": 1, "gpus": {"a100": {"gemm_efficiency": 0.5, '
                   '"attention_efficiency": 0.4, "memory_reserve_mib": 1024}}}')
    assert main(["baseline", "--model", "gpt-1.3b", "--cluster", CLUSTER, "--global-batch-size", "64",
                 "--calibration", str(bad)]) == 2
    assert "no calibration for h100 (the file has a100)" in capsys.readouterr().err


def _plan(tmp_path):
    p = tmp_path / "plan.json"
    p.write_text(imported().plan.to_json())
    return p


def test_an_aceso_plan_and_its_train_jsonl_calibrate(tmp_path, capsys):
    """The records as aceso_megatron/training/train_log.py ``TrainLogger.step`` writes them."""
    plan = imported().plan
    (tmp_path / "plan.json").write_text(plan.to_json())
    ms = 1.1 * price(Run("", plan, None, "runtime", None), plan.cluster).iteration_ms
    gbs = plan.global_batch_size
    recs = [{**RUN, "plan_digest": plan.digest()}] + [{"kind": "train", "iteration": i, "loss": 5.0, "grad_norm": 1.0, "lr": 1e-4, "iteration_time_ms": t,
             "tokens_per_s": gbs * 2048 / (t / 1e3),
             "tflops_per_gpu": plan.model.training_flops_per_sample() * gbs / (t / 1e3) / plan.world_size / 1e12,
             "stage_max_memory_mb": [20000.0]} for i, t in ((5, 3 * ms), (10, ms), (15, ms))]
    (tmp_path / "t.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert main(["calibrate", "--run", str(tmp_path / "plan.json"), str(tmp_path / "t.jsonl"), "-o",
                 str(tmp_path / "c.json"), "--json"]) == 0
    (r,) = json.loads(capsys.readouterr().out)["h100"]
    assert r["error_before"] == pytest.approx(1 / 1.1 - 1, abs=1e-3) and abs(r["error_after"]) < 0.005
    recs[0]["plan_digest"] = "fedcba9876543210"          # the log of another plan
    (tmp_path / "t.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert main(["calibrate", "--run", str(tmp_path / "plan.json"), str(tmp_path / "t.jsonl"), "-o",
                 str(tmp_path / "d.json")]) == 2
    assert "a log of another plan" in capsys.readouterr().err and not (tmp_path / "d.json").exists()
    (tmp_path / "t.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs[1:]))   # no run record
    assert main(["calibrate", "--run", str(tmp_path / "plan.json"), str(tmp_path / "t.jsonl"), "-o",
                 str(tmp_path / "d.json")]) == 2
    assert "no run record (the plan digest" in capsys.readouterr().err and not (tmp_path / "d.json").exists()


def test_every_command_prices_with_the_same_calibrated_cluster(tmp_path, capsys):
    sh, log, _ = write_run(tmp_path, factor=1.3)
    cal = str(tmp_path / "c.json")
    assert main(["calibrate", "--run", sh, log, "--cluster", CLUSTER, "-o", cal]) == 0
    base = str(tmp_path / "base.json")
    assert main(["baseline", "--model", "gpt-1.3b", "--num-layers", "4", "--cluster", CLUSTER, "--global-batch-size",
                 "64", "--calibration", cal, "-o", base]) == 0
    capsys.readouterr()
    plan = json.loads(open(base).read())
    assert plan["cluster"]["gpu"]["attention_scale"] is not None            # the plan records what it was priced on
    ms = plan["predicted"]["iteration_time_ms"]
    for extra in ([], ["--calibration", cal]):                               # applying it again changes nothing
        assert main(["explain", base, "--json", *extra]) == 0
        assert json.loads(capsys.readouterr().out)["iteration_time_ms"] == pytest.approx(ms, abs=1e-5)
    assert main(["baseline", "--model", "gpt-1.3b", "--num-layers", "4", "--cluster", CLUSTER, "--global-batch-size",
                 "64", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["iteration_ms"] < ms / 1.15         # the defaults: faster
    assert main(["export", base, "--to", "megatron-lm", "--calibration", cal, "-o", str(tmp_path / "run2.sh")]) == 0
    assert f"{ms:.1f} ms per iteration" in (tmp_path / "run2.sh").read_text()
    assert main(["validate", base, "--calibration", cal, "--json"]) == 0


def test_no_factor_goes_beyond_the_hardware(tmp_path):
    """A run 'measured' twice as fast as the defaults predict: the fit stops at the microbenchmark ceilings
    (kernels.ARCH gemm_max, attn_fwd) and the datasheet links, and says how far off the run still is."""
    from search.costmodel.kernels import ARCH
    imp = imported()
    r = Run("fast", imp.plan, imp.config.attention, "megatron-lm", None)
    r.measured = read_megatron_log(log_for(imp, price(r, imp.plan.cluster).iteration_ms / 2, reserved_mb=None), "x")
    c = calibrate([r]).gpus["h100"]
    assert c.gemm_efficiency == pytest.approx(ARCH["h100"].gemm_max, rel=1e-9)
    assert c.attention_efficiency <= ARCH["h100"].attn_fwd * (1 + 1e-9)
    assert c.intra_node_gbps <= 450.0 * (1 + 1e-9)
    assert c.runs[0].error_after > 0.2              # still predicted slower: the run is beyond this hardware


def test_a_factor_left_at_its_bound_is_pinned_not_fitted(tmp_path, capsys):
    """A run twice as fast as the defaults: GEMM, attention and NVLink all stop at their hardware bounds (the
    kernels' ceilings, the datasheet's 450 GB/s), so the runs did not determine them: the file and the summary say
    they are pinned there. Before, all three were listed as fitted."""
    from search.calibration.calibrate import upper_bounds
    sh, log, pred = write_run(tmp_path, factor=0.5)
    out = tmp_path / "calib.json"
    assert main(["calibrate", "--run", sh, log, "--cluster", CLUSTER, "-o", str(out)]) == 0
    summary = capsys.readouterr().out.splitlines()[0]
    c = load_calibration(str(out)).gpus["h100"]
    assert c.intra_node_gbps == pytest.approx(DEFAULT["intra_node_gbps"] * math.exp(upper_bounds("h100")[2]))
    assert c.intra_node_gbps == pytest.approx(450.0)                 # H100 SXM's NVLink per direction, the datasheet
    assert c.pinned == ["gemm", "attention", "intra"] and "intra" not in c.fitted
    assert summary.endswith("(fitted: memory_reserve; pinned at its bound: gemm, attention, intra)"), summary
    # a slower run moves every factor inside its bounds: all fitted, none pinned
    sh, log, _ = write_run(tmp_path, factor=1.25, name="slow")
    assert main(["calibrate", "--run", sh, log, "--cluster", CLUSTER, "-o", str(out)]) == 0
    c = load_calibration(str(out)).gpus["h100"]
    assert c.pinned == [] and c.fitted[:3] == ["gemm", "attention", "intra"]
    assert "pinned" not in capsys.readouterr().out


# ----- which run is the log of (issue 32: any log was "fitted" to any script) ----------------------------------
MOE_ARGS = ("--num-layers 4 --hidden-size 1024 --num-attention-heads 16 --group-query-attention --num-query-groups 4 "
            "--seq-length 2048 --max-position-embeddings 2048 --micro-batch-size 1 --global-batch-size 64 --bf16 "
            "--swiglu --normalization RMSNorm --position-embedding-type rope --num-experts 8 --moe-router-topk 2 "
            "--moe-ffn-hidden-size 512 --ffn-hidden-size 3072 --expert-model-parallel-size 2 --vocab-size 32000 "
            "--transformer-impl transformer_engine --use-distributed-optimizer --disable-bias-linear "
            "--untie-embeddings-and-output-weights")


def moe_flops_by_hand(B=64) -> float:
    """Megatron-LM core_v0.16.1 transformer_flops for MOE_ARGS, written out: 3 x 2 x per token (2 of 8 SwiGLU
    experts of width 512 on all 4 layers + GQA attention (16 heads, 4 groups of 64) with the causal half + logits
    over the padded vocabulary 32000)."""
    h, s, L, f, V, q, k = 1024, 2048, 4, 512, 32000, 1024, 256
    per_token = 6 * h * f * 2 * 3 * L + 6 * (h * (q + 2 * k) + q * s + q * h) * L + 6 * h * V
    return B * s * per_token


def test_an_moe_log_is_its_scripts_log(tmp_path, capsys):
    """A log whose throughput is Megatron-LM's MoE FLOP count (by hand) calibrates its MoE script; the dense count
    called every MoE log "another model". The arguments block's expert count must match too."""
    sh = tmp_path / "moe.sh"
    sh.write_text("#!/bin/bash\ntorchrun --nproc-per-node 8 --nnodes 1 pretrain_gpt.py \\\n    " + MOE_ARGS + "\n")
    imp = read_megatron(sh.read_text(), str(sh), cluster=parse_cluster(CLUSTER))
    assert megatron_flops(imp.plan, imp.config.model.padded_vocab_size) == pytest.approx(moe_flops_by_hand(), rel=1e-12)
    ms = 1.2 * price(Run("", imp.plan, imp.config.attention, "megatron-lm", None), imp.plan.cluster).iteration_ms
    printed = {"num_layers": 4, "hidden_size": 1024, "num_attention_heads": 16, "seq_length": 2048,
               "num_experts": 8, "world_size": 8, "global_batch_size": 64}
    log = tmp_path / "moe.log"
    log.write_text(megatron_log(ms, moe_flops_by_hand(), 8, 64, printed))
    assert main(["calibrate", "--run", str(sh), str(log), "--cluster", CLUSTER, "-o", str(tmp_path / "c.json")]) == 0
    assert abs(load_calibration(str(tmp_path / "c.json")).gpus["h100"].runs[0].error_after) < 0.01
    capsys.readouterr()
    _refused(tmp_path, capsys, megatron_log(ms, moe_flops_by_hand(), 8, 64, {**printed, "num_experts": 16}),
             "the log's num_experts is 16", str(sh))
    _refused(tmp_path, capsys, megatron_log(ms, moe_flops_by_hand(), 8, 64, {**printed, "num_experts": "None"}),
             "the log's num_experts is None", str(sh))


def _strip_arguments(text: str) -> str:
    return "\n".join(ln for ln in text.splitlines() if not ln.startswith("  ") and "arguments" not in ln) + "\n"


def test_a_log_that_does_not_say_which_run_it_is_is_refused_naming_what_is_missing(tmp_path, capsys):
    sh, log, pred = write_run(tmp_path)
    good = open(log).read()
    # no arguments block and no --log-throughput: nothing ties it to the script's model or cluster
    bare = re.sub(r" throughput per GPU \(TFLOP/s/GPU\): [0-9.]+ \|", "", _strip_arguments(good))
    _refused(tmp_path, capsys, bare, "no model (arguments num_layers, hidden_size, num_attention_heads, seq_length, or "
             "the throughput per GPU of --log-throughput); no cluster (argument world_size", sh)
    # a 2020-style log: no global batch size anywhere (and no throughput)
    old = re.sub(r" global batch size: +\d+ \|", "", bare)
    _refused(tmp_path, capsys, old, "no global batch size", sh)
    # the throughput alone names model and cluster: accepted
    assert main(["calibrate", "--run", sh, str(_write(tmp_path, _strip_arguments(good))), "--cluster", CLUSTER,
                 "-o", str(tmp_path / "ok.json")]) == 0
    # a BERT-large log (its printed shape) against this GPT script
    bert = megatron_log(1000.0, 1e15, 8, 64, {"num_layers": 24, "hidden_size": 1024, "num_attention_heads": 16,
                                              "seq_length": 512, "world_size": 8, "global_batch_size": 64})
    _refused(tmp_path, capsys, bert, "the log's num_layers is 24 but", sh)


def _write(tmp_path, text: str):
    p = tmp_path / "x.log"
    p.write_text(text)
    return p


# ----- bad logs of every reader: one line, exit 2, nothing written (a corpus, not a list of known cases) ----------
def _megatron_variants(good: str) -> list[tuple[str, str, str]]:
    """(id, log text, text the line names): the good log with one field broken."""
    it = r"(elapsed time per iteration \(ms\): )[0-9.]+"
    out = []
    for bad in ("0.0", "-5.0", "abc", "1e999", ""):
        out.append((f"time={bad!r}", re.sub(it, rf"\g<1>{bad}", good), "elapsed time per iteration"))
    for bad in ("0", "-64", "x"):
        out.append((f"gbs={bad!r}", re.sub(r"(global batch size: +)\d+", rf"\g<1>{bad}", good), "global batch size"))
    for bad in ("-1.0", "nope"):
        out.append((f"tput={bad!r}", re.sub(r"(throughput per GPU \(TFLOP/s/GPU\): )[0-9.]+", rf"\g<1>{bad}", good),
                    "throughput per GPU"))
    out.append(("reserved=-1", re.sub(r"(max reserved: )[0-9.]+", r"\g<1>-1.00", good), "max reserved"))
    out.append(("reserved=x", re.sub(r"(max reserved: )[0-9.]+", r"\g<1>lots", good), "max reserved"))
    out.append(("nan-count=x", good.replace("number of nan iterations:   0", "number of nan iterations: many"),
                "number of nan iterations"))
    return out


def _jsonl_variants(plan) -> list[tuple[str, str, str]]:
    gbs = plan.global_batch_size
    rec = {"kind": "train", "iteration": 5, "loss": 5.0, "grad_norm": 1.0, "lr": 1e-4, "iteration_time_ms": 500.0,
           "tokens_per_s": 1.0, "tflops_per_gpu": plan.model.training_flops_per_sample() * gbs / 0.5 / 8 / 1e12,
           "stage_max_memory_mib": [1000.0]}
    run = {**RUN, "plan_digest": plan.digest()}
    out = []
    for key, bads in (("iteration_time_ms", (0, 0.0, -1.0, None, "500", True, [500.0], 1e400)),
                      ("tflops_per_gpu", (-1.0, None, "x", {})),
                      ("loss", (None, "nan", float("inf"))),
                      ("stage_max_memory_mib", (5, "1000", {"0": 1.0}, [1.0, "a"], [-1.0], [None], [True]))):
        for bad in bads:
            text = json.dumps(run) + "\n" + json.dumps({**rec, key: bad}) + "\n" + json.dumps({**rec, "iteration": 10}) \
                + "\n"
            out.append((f"{key}={bad!r}", text, "stage_max_memory_mib" if key == "stage_max_memory_mib" else key))
    out.append(("run-digest", json.dumps({**run, "plan_digest": 7}) + "\n" + json.dumps(rec) + "\n", "plan_digest"))
    out.append(("run-device", json.dumps({**run, "device": "tpu"}) + "\n" + json.dumps(rec) + "\n", "device"))
    out.append(("list", "[1, 2]\n", "no 'elapsed time per iteration (ms)' line"))
    out.append(("list-line", json.dumps(run) + "\n[1, 2]\n", "not a JSON record"))
    return out


def _stdout_variants(plan) -> list[tuple[str, str, str]]:
    head = f" plan {plan.digest()}: m on 8 GPUs (NVIDIA H100 80GB HBM3), global batch 64, priced for 1x8-h100: 1.0 ms/it\n"
    line = (" iteration {it:>6}/20 | loss 5.000000 | grad norm 1.0000 | lr 1.000e-04 | {ms} ms/it | 1,000 tokens/s | "
            "{tf} TFLOP/s per GPU | max mem/stage MiB {mem}\n")
    ok = dict(ms="500.0", tf="100.000", mem="1000")
    out = []
    for key, bads in (("ms", ("0.0", "-3.0", "x", "inf")), ("tf", ("-1.000", "y")), ("mem", ("-5", "a / 3"))):
        for bad in bads:
            text = head + line.format(it=5, **{**ok, key: bad}) + line.format(it=10, **ok)
            out.append((f"stdout-{key}={bad!r}", text, {"ms": "ms/it", "tf": "TFLOP/s", "mem": "max mem/stage"}[key]))
    out.append(("stdout-cut", head + line.format(it=5, **ok)[:60], "cut off"))
    out.append(("stdout-no-run-line", line.format(it=5, **ok) + line.format(it=10, **ok), "no run record"))
    return out


def test_bad_logs_of_every_reader_are_one_line_exit_2(tmp_path, capsys):
    """Zero times (a ZeroDivisionError in the fit), a memory field that is no list (TypeError), negative numbers,
    text, NaN/inf, JSON of the wrong type, a cut line: each refused by its reader in one line naming the field."""
    sh, log, _ = write_run(tmp_path)
    plan = imported().plan
    (tmp_path / "plan.json").write_text(plan.to_json())
    cases = [(i, t, n, sh) for i, t, n in _megatron_variants(open(log).read())]
    cases += [(i, t, n, str(tmp_path / "plan.json")) for i, t, n in _jsonl_variants(plan) + _stdout_variants(plan)]
    assert len(cases) >= 45
    failures = []
    for case_id, text, needle, config in cases:
        bad = tmp_path / "bad.log"
        bad.write_text(text)
        out = tmp_path / "calib.json"
        out.unlink(missing_ok=True)
        rc = main(["calibrate", "--run", config, str(bad), "--cluster", CLUSTER, "-o", str(out)])
        err = capsys.readouterr().err
        if rc != 2 or needle not in err or len(err.strip().splitlines()) != 1 or out.exists():
            failures.append(f"{case_id}: exit {rc}: {err.strip()[-300:]}")
    assert not failures, "\n".join(failures)


def test_aceso_train_console_output_reads_back(tmp_path):
    """The lines train_log.py prints (the run line, then one per interval), as a user saves them with tee."""
    from search.calibration.aceso_log import read_train_stdout

    plan = imported().plan
    text = "".join(t for _, t, _ in _stdout_variants(plan)[:0]) + (
        f"torchrun ...\n plan {plan.digest()}: m on 2 CPU processes (cpu), global batch 8, priced for 1x2-cpu: "
        "10.6 ms/it\n"
        " iteration      5/20 | loss 5.965669 | grad norm 2.0454 | lr 2.714e-03 | 620.3 ms/it | 825 tokens/s | "
        "0.001 TFLOP/s per process | max mem/stage MiB 456\n"
        " iteration     10/20 | loss 5.541829 | grad norm 1.7774 | lr 1.735e-03 | 200.2 ms/it | 2,558 tokens/s | "
        "0.002 TFLOP/s per process | max mem/stage MiB 457 / 460\n"
        " iteration     15/20 | loss 5.365474 | grad norm 1.1242 | lr 6.183e-04 | 190.0 ms/it | 1,299 tokens/s | "
        "0.002 TFLOP/s per process | max mem/stage MiB 457\n")
    run = read_train_stdout(text, "t.log")
    assert run.iteration_ms == pytest.approx(195.1) and run.intervals == 3
    assert run.memory_mb is None                   # a CPU run: max RSS is not what the cost model prices
    assert run.run == {"plan_digest": plan.digest(), "device": "cpu", "device_name": "cpu"}


def test_aceso_train_console_output_of_today_reads_back():
    """The iteration line as train_log.py prints it since tokens/s per GPU and MFU (samples/s, tokens/s per GPU or
    process, MFU on a GPU run), after the runtime's ``[build]`` lines: it was refused as "cut off or edited"."""
    from search.calibration.aceso_log import read_train_stdout

    plan = imported().plan
    text = (" [build] check: m, 1 stage(s) on 8 cuda process(es), ...\n [build] groups: pp 1 stage(s), tp 8, dp 1\n"
            f" plan {plan.digest()}: m on 8 GPUs (NVIDIA H100 80GB HBM3), global batch 8, no prediction\n"
            " iteration     10/30 | loss 5.965669 | grad norm 2.0454 | lr 2.714e-03 | 620.3 ms/it | 12.90 samples/s | "
            "26,419 tokens/s per GPU | 401.250 TFLOP/s per GPU | MFU 40.6% | max mem/stage MiB 61234\n"
            " iteration     20/30 | loss 5.541829 | grad norm 1.7774 | lr 1.735e-03 | 600.0 ms/it | 13.33 samples/s | "
            "27,306 tokens/s per GPU | 414.800 TFLOP/s per GPU | MFU 41.9% | max mem/stage MiB 61240\n"
            " iteration     30/30 | loss 5.365474 | grad norm 1.1242 | lr 6.183e-04 | 590.0 ms/it | 13.56 samples/s | "
            "27,769 tokens/s per process | 421.830 TFLOP/s per GPU | MFU 42.7% | max mem/stage MiB 61236\n")
    run = read_train_stdout(text, "t.log")
    assert run.iteration_ms == pytest.approx(595.0) and run.intervals == 3     # the median after the first
    assert run.memory_mb == pytest.approx(61240) and run.run["device"] == "cuda"
