"""The one pre-flight (``search.targets.preflight``) against the runtime it speaks for (issue 25): what ``aceso validate``
accepts, the CPU runtime runs, and what it refuses, the runtime would have failed on late.

The cases that need megatron-core (custom layers cut mid-layer or with split recompute, wrong-typed ``megatron``
fields, a transformer-engine spec on CPU) run the bad-input corpus's checks (one line, exit 2, nothing written)
here, in the runtime tier. The property: seeded random one-process plans over tiny models with and without
custom layers and megatron blocks; validate says yes exactly when the runtime builds the plan and runs a step."""

from __future__ import annotations

import json
import random

import pytest

from search.cli import main
from tests.tiny_models import GPT
from tests.unit.test_bad_inputs import C, run_case

PARALLEL = GPT.model_copy(update={"layer_spec": "tests.custom_specs:parallel_block"})
QK = GPT.model_copy(update={"layer_spec": "tests.custom_specs:qk_norm_squared_relu",
                            "megatron": {"qk_layernorm": True}})
TE_SPEC = GPT.model_copy(update={"layer_spec": "megatron.core.models.gpt.gpt_layer_specs:"
                                               "get_gpt_layer_with_transformer_engine_spec"})
CUDA_STREAM = GPT.model_copy(update={"layer_spec": "tests.custom_specs:cuda_stream"})
WRONG_TYPE = GPT.model_copy(update={"megatron": {"layernorm_epsilon": "small"}})
MODELS = {"stock": GPT, "parallel-block": PARALLEL, "qk-norm": QK, "te-spec": TE_SPEC, "wrong-type": WRONG_TYPE}


def plan(model, *spans, mb=2, gbs=4) -> dict:
    return {"model": model.model_dump(), "micro_batch_size": mb, "global_batch_size": gbs,
            "stages": [{"num_gpus": 1, "tp": 1, "dp": 1, "start_unit": lo, "end_unit": hi, "recompute": rc}
                       for lo, hi, rc in spans]}


CASES = [
    C("validate-whole-layer-cut", "validate p.json", "runs whole",
      **{"p.json": plan(PARALLEL, (0, 1, ["none"]), (1, 4, ["none"] * 3))}),
    C("validate-whole-layer-split-recompute", "validate p.json", "give all its units none or all full",
      **{"p.json": plan(PARALLEL, (0, 4, ["selective", "none", "full", "full"]))}),
    C("validate-megatron-wrong-type", "validate p.json", "layernorm_epsilon",
      **{"p.json": plan(WRONG_TYPE, (0, 4, ["none"] * 4))}),
    C("validate-te-spec-on-cpu", "validate p.json --cluster 1x1-cpu", "needs transformer-engine",
      **{"p.json": plan(TE_SPEC, (0, 4, ["none"] * 4))}),
    # torch's CPU wheel: "RuntimeError: torch.cuda.Stream requires CUDA support"; its CUDA build without a GPU:
    # "AcceleratorError: CUDA error: ..." -- the line names the spec and the fix either way
    C("validate-cuda-module-on-cpu", "validate p.json --cluster 1x1-cpu", "cuda_stream): a decoder layer cannot be "
      "built on CPU (",
      **{"p.json": plan(CUDA_STREAM, (0, 4, ["none"] * 4))}),
    C("launch-cuda-module-on-cpu", "launch p.json --cpu --dry-run -- --mock-data --train-iters 2", "needs CUDA, which a CPU run does not have",
      **{"p.json": plan(CUDA_STREAM, (0, 4, ["none"] * 4))}),
]


def test_cuda_module_is_the_gpus_to_build(tmp_path, capsys):
    """The same plan for GPUs, checked on this CPU machine (aceso validate on a laptop), is not refused: the
    workers on the GPUs build it; and a stock or CPU-buildable custom spec passes the CPU build check."""
    p = tmp_path / "p.json"
    p.write_text(json.dumps(plan(CUDA_STREAM, (0, 4, ["none"] * 4))))
    assert main(["validate", str(p)]) == 0, capsys.readouterr().err
    for model in (GPT, QK, PARALLEL):
        p.write_text(json.dumps(plan(model, (0, 4, ["none"] * 4))))
        assert main(["validate", str(p), "--cluster", "1x1-cpu"]) == 0, capsys.readouterr().err


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_runtime_faults_are_refused_by_validate(case, tmp_path):
    rc, out, err, unchanged = run_case(case, tmp_path)
    assert rc == 2 and case.needle in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1 and out == "" and unchanged, err


@pytest.fixture(scope="module")
def single_process():
    from aceso_megatron.testing import free_port
    from aceso_megatron.testing.reference import init_single_process

    init_single_process(free_port())


def _random_plans(n: int, seed: int = 25):
    rng = random.Random(seed)
    for _ in range(n):
        name = rng.choice(sorted(MODELS))
        cut = rng.choice([None, 1, 2])          # one stage, or two stages cut after unit 1 (mid-layer) or 2
        rc = [rng.choice(["none", "selective", "full"]) for _ in range(4)]
        spans = [(0, 4, rc)] if cut is None else [(0, cut, rc[:cut]), (cut, 4, rc[cut:])]
        yield name, plan(MODELS[name], *spans)


def _runs(raw: dict) -> tuple[bool, str]:
    """Whether the CPU runtime builds every stage of ``raw`` and runs a forward/backward step on it (each stage
    as a one-stage plan of its units in this one process; a cut plan's stages must each build and run)."""
    from aceso_megatron.testing import make_batches
    from aceso_megatron.training.engine import build_runtime

    try:
        rt = build_runtime(raw, 0, 1, seed=1) if len(raw["stages"]) == 1 else None
        if rt is None:     # two stages need two processes; the runtime's own pre-process checks decide
            from aceso_megatron.model.layers import check_model
            from search.spec.plan import ParallelPlan

            check_model(ParallelPlan.model_validate(raw), "cpu")
            return True, ""
        batches = make_batches(rt.plan.model, rt.plan.micro_batch_size, rt.plan.global_batch_size, 1)
        rt.forward_backward(iter(batches))
        return True, ""
    except Exception as e:  # noqa: BLE001 - any failure of the runtime is a "no"
        return False, f"{type(e).__name__}: {e}"


def test_validate_says_yes_exactly_when_the_cpu_runtime_runs_a_step(tmp_path, capsys, single_process):
    seen = set()
    for k, (name, raw) in enumerate(_random_plans(10)):
        path = tmp_path / f"p{k}.json"
        path.write_text(json.dumps(raw))
        yes = main(["validate", str(path), "--cluster", f"1x{len(raw['stages'])}-cpu"]) == 0
        err = capsys.readouterr().err
        runs, why = _runs(raw)
        assert yes == runs, (name, raw["stages"], err, why)
        seen.add(yes)
    assert seen == {True, False}        # the sample holds both answers


def test_the_search_emits_only_plans_the_runtime_runs(capsys):
    """The search's output check (``search_cmd.runnable``, the one pre-flight): a heterogeneous plan with selective
    recompute on units of a layer that runs whole is left out for the next best (issue 25's 13B parallel-attention
    case), and with nothing runnable the search is one line naming why."""
    from search.cli.search_cmd import runnable
    from search.io.errors import AcesoError
    from search.spec.plan import ParallelPlan

    bad = ParallelPlan.model_validate(plan(PARALLEL, (0, 4, ["selective", "selective", "none", "none"])))
    good = ParallelPlan.model_validate(plan(PARALLEL, (0, 4, ["full", "full", "none", "none"])))
    best, kept = runnable([("heterogeneous", bad), ("megatron-lm", good)], keep=1)
    assert best == "megatron-lm" and kept == [good]
    assert "left out plan(s) the runtime would refuse" in capsys.readouterr().err
    with pytest.raises(AcesoError, match="no plan the runtime runs: .*runs whole"):
        runnable([("heterogeneous", bad)], keep=1)


def test_a_gpu_plan_with_a_te_spec_is_not_refused_on_a_machine_without_te(tmp_path, capsys):
    """Planning for GPUs on a laptop: the transformer-engine spec cannot be built here, which says nothing about the
    GPUs; validate accepts the plan and says what it could not check (on CPU it refuses, above)."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the spec is checked for real")
    (tmp_path / "p.json").write_text(json.dumps(plan(TE_SPEC, (0, 4, ["none"] * 4))))
    assert main(["validate", str(tmp_path / "p.json"), "--cluster", "1x1-h100"]) == 0
    assert "not fully checked" in capsys.readouterr().out
    assert main(["validate", str(tmp_path / "p.json"), "--cluster", "1x1-h100", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["runtime_checked"] is False


def _moe_model():
    from search.layers.moe_spec import MoESpec
    from tests.tiny_models import LLAMA
    return LLAMA.model_copy(update={"moe": MoESpec(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32)})


def _cpu_plans() -> dict:
    """Plans for ``N`` CPU processes: each is valid as a plan; some the CPU runtime refuses."""
    from search.spec.cluster import parse_cluster
    from search.spec.plan import uniform_plan
    from tests.tiny_models import GPT, LLAMA

    moe = _moe_model()

    def moe_plan(tp, dp, ep, etp, model=moe, **settings):
        raw = json.loads(uniform_plan(model, 1, tp, dp, 2 * dp, 4 * dp, cluster=parse_cluster(f"1x{tp * dp}-cpu"),
                                      sequence_parallel=tp > 1).to_json())
        raw["stages"][0].update(ep=ep, etp=etp)
        raw["settings"]["moe"] = settings or None
        return raw

    def dense(model, tp, dp, cp=1, **fields):
        raw = json.loads(uniform_plan(model, 1, tp, dp, 2 * dp, 4 * dp, cluster=parse_cluster(f"1x{tp * dp * cp}-cpu"),
                                      cp=cp, sequence_parallel=tp > 1).to_json())
        raw["settings"].update(fields)
        return raw
    return {
        "moe-etp2-alltoall": moe_plan(2, 1, 1, 2),                       # launch's workers refused it 30 s in
        "moe-etp2-allgather": moe_plan(2, 1, 1, 2, token_dispatcher="allgather"),
        "moe-ep2-alltoall": moe_plan(1, 2, 2, 1),
        "moe-flex": moe_plan(1, 2, 2, 1, token_dispatcher="flex"),
        # the EP overlap needs a bf16 / fp16 model (megatron-core asserts it; the plan schema too)
        "moe-ep-overlap": moe_plan(1, 2, 2, 1, model=moe.model_copy(update={"params_dtype": "bf16"}),
                                   overlap_ep_comm=True),
        "dense-llama-tp2": dense(LLAMA, 2, 1),
        "dense-gpt-cp2": dense(GPT, 1, 1, cp=2),
        "dense-tp-comm-overlap": dense(LLAMA, 2, 1, tp_comm_overlap=True),
        "fsdp-no-shard": dense(LLAMA, 1, 2, distributed_optimizer=False,
                               megatron_fsdp={"data_parallel_sharding_strategy": "no_shard"}),
        "fsdp-optim-grads": dense(LLAMA, 1, 2, distributed_optimizer=False,
                                  megatron_fsdp={"data_parallel_sharding_strategy": "optim_grads"}),
    }


def test_validate_answers_what_launch_and_its_workers_do_on_cpu(tmp_path, capsys):
    """For each plan: ``aceso validate`` on its CPU cluster, ``aceso launch --cpu --dry-run`` (its pre-flight, no
    process started) and the check every worker runs before its process group (the one pre-flight on this machine,
    ``here=True``: ``training.engine.check_plan`` with this CPU's environment) give one verdict. Before, validate and
    launch passed the expert-tp-2 alltoall plan that every worker then refused."""
    from search.io.errors import AcesoError
    from search.spec.plan import ParallelPlan
    from search.targets.preflight import preflight

    verdicts = {}
    for name, raw in _cpu_plans().items():
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(raw))
        v = main(["validate", str(path)]) == 0         # a runtime plan: the aceso target
        v_err = capsys.readouterr().err
        lch = main(["launch", str(path), "--cpu", "--dry-run", "--", "--mock-data", "--train-iters", "2"]) == 0
        l_err = capsys.readouterr().err
        try:
            preflight(ParallelPlan.model_validate(raw), "cpu", here=True)   # what train.py runs first
            w, w_err = True, ""
        except AcesoError as e:
            w, w_err = False, str(e)
        assert v == lch == w, (name, v_err, l_err, w_err)
        if not v:
            assert v_err.strip().split("error: ", 1)[1].endswith(w_err), (name, v_err, w_err)
        verdicts[name] = v
    assert verdicts["moe-etp2-alltoall"] is False and verdicts["moe-etp2-allgather"] is True
    assert set(verdicts.values()) == {True, False}


def test_the_runtime_entry_gives_the_pre_flights_line(tmp_path, capsys):
    """Issue 35: the runtime's entry check (``training.engine.check_plan``, which ``build_runtime`` runs before any
    group) asks the one pre-flight: for each CPU plan it refuses exactly what ``aceso validate`` and ``aceso launch
    --cpu`` refuse, with the same line, written once (``search.targets.runtime_rules``). Before, it had its own copies and
    passed a plan whose settings the runtime does not run (Muon, SHARP, the 2026 stack), training it without them."""
    from aceso_megatron.model.fast_path import Environment
    from aceso_megatron.training.engine import check_plan
    from search.io.errors import AcesoError

    plans = dict(_cpu_plans())
    base = plans["dense-llama-tp2"]
    for name, field in (("muon", {"optimizer": "muon"}), ("sharp", {"data_parallel": {"sharp": True}}),
                        ("stack", {"stack": {"cross_entropy_fusion": "te"}}),
                        ("offload", {"activation_offload": {"num_layers": 1}})):
        plans[name] = {**base, "settings": {**base["settings"], **field}}
    for name, raw in plans.items():
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(raw))
        ok_v = main(["validate", str(path)]) == 0
        v_err = capsys.readouterr().err.strip()
        ok_l = main(["launch", str(path), "--cpu", "--dry-run", "--", "--mock-data", "--train-iters", "2"]) == 0
        l_err = capsys.readouterr().err.strip()
        try:
            check_plan(raw, sum(st["num_gpus"] for st in raw["stages"]), Environment.detect("cpu"))
            ok_e, e_line = True, ""
        except AcesoError as e:
            ok_e, e_line = False, str(e)
        assert ok_v == ok_l == ok_e, (name, v_err, l_err, e_line)
        if not ok_e:
            assert v_err.endswith(e_line) and l_err.endswith(e_line) and "\n" not in e_line, (name, v_err, e_line)
    for name in ("muon", "sharp", "stack", "offload", "moe-etp2-alltoall"):
        with pytest.raises(AcesoError):
            check_plan(plans[name], 2, Environment.detect("cpu"))


def test_the_fp16_row_refuses_what_the_runtime_engine_refuses():
    """Issue 32: the capability table's fp16 row (torch-free: validate, the search's output check, launch) against
    the runtime's own check on the GPUs (``training.engine.check_plan``): the same verdict for an fp16 plan on
    every GPU with bf16; a CPU runs fp16 plans (as fp32), and Megatron-LM runs them (it scales fp16 losses)."""
    from aceso_megatron.model.fast_path import Environment
    from aceso_megatron.training.engine import check_plan
    from search.targets.capabilities import Device, plan_refusal
    from search.spec.cluster import parse_cluster
    from search.io.errors import AcesoError
    from search.spec.plan import ParallelPlan

    for gpu in ("a100", "h100", "b200", "gb200"):
        fp16 = {**plan(GPT.model_copy(update={"params_dtype": "fp16"}), (0, 4, ["none"] * 4)),
                "cluster": parse_cluster(f"1x1-{gpu}").model_dump()}
        with pytest.raises(AcesoError, match=r"model.params_dtype fp16 \(aceso search --precision fp16\): the aceso runtime has no fp16 loss scaling"):
            check_plan(fp16, 1, Environment(cuda=True))
        p = ParallelPlan.model_validate(fp16)
        assert "the aceso runtime has no fp16 loss scaling yet" in plan_refusal(p, "aceso", Device.of("cuda"))
        assert plan_refusal(p, "aceso", Device.of("cpu")) is None and check_plan(fp16, 1, Environment(cuda=False))
        assert plan_refusal(p, "megatron-lm", Device.of("cuda")) is None
        bf16 = {**fp16, "model": GPT.model_copy(update={"params_dtype": "bf16"}).model_dump()}
        check_plan(bf16, 1, Environment(cuda=True))
        assert plan_refusal(ParallelPlan.model_validate(bf16), "aceso", Device.of("cuda")) is None


def test_hybrid_plans_need_megatron_core_019(tmp_path, capsys):
    """A hybrid model (Mamba-2, attention, MoE, MLP) passes the pre-flight where megatron-core has ``HybridModel``
    (0.19: the runtime runs it, tests/distributed/test_hybrid_plans.py) and is refused in one line, exit 2, before
    any process group where it has not (0.16.1)."""
    from patches.compat import have_hybrid
    from tests.tiny_models import HYBRID

    p = tmp_path / "p.json"
    raw = plan(HYBRID, (0, HYBRID.num_units, ["none"] * HYBRID.num_units))
    p.write_text(json.dumps({**raw, "moe": {"token_dispatcher": "alltoall", "grouped_gemm": False,
                                            "permute_fusion": False}}))
    rc = main(["validate", str(p), "--cluster", "1x1-cpu"])
    err = capsys.readouterr().err
    if have_hybrid():
        assert rc == 0, err
    else:
        assert rc == 2 and len(err.strip().splitlines()) == 1, err
        assert "hybrid_layer_pattern: the aceso runtime runs hybrid models on megatron-core >= 0.19" in err
        assert "Traceback" not in err


def test_a_gpu_plan_is_not_held_to_this_machines_megatron_core(tmp_path, capsys):
    """A hybrid MoE model's plan for GPUs, checked on a machine without CUDA, gets the capability table's verdict
    (``planner_checks``: what a planner-only install answers, and what the dense hybrid's plan gets, whose runtime
    checks do not run), whatever megatron-core is installed here: the GPUs run their own (NGC 26.x: 0.19), and the
    workers check it. Before, on megatron-core 0.16.1 (the Python 3.11 stack) it was refused, "runs hybrid models on
    megatron-core >= 0.19 ... this is 0.16.1", and ``aceso search`` of nemotron-3-nano for any GPU cluster exited
    2 ("the search found no plan the runtime runs") while nemotron-h-8b's search returned its plan."""
    import torch

    from search.spec.plan import ParallelPlan
    from search.targets.preflight import planner_checks
    from tests.tiny_models import HYBRID

    if torch.cuda.is_available():
        pytest.skip("a machine with CUDA checks a GPU plan as one it may run")
    p = tmp_path / "p.json"
    raw = plan(HYBRID, (0, HYBRID.num_units, ["none"] * HYBRID.num_units))
    raw = {**raw, "moe": {"token_dispatcher": "alltoall", "grouped_gemm": False, "permute_fusion": False}}
    p.write_text(json.dumps(raw))
    planner_checks(ParallelPlan.model_validate(raw), "cuda", "aceso")    # the table runs it (raises if not)
    rc = main(["validate", str(p), "--cluster", "1x1-h100"])
    out, err = capsys.readouterr()
    assert rc == 0 and "valid plan" in out, err


def test_the_shared_mtp_layer_needs_megatron_core_017(tmp_path, capsys):
    """Two MTP depths of one shared layer (``mtp_use_repeated_layer``) pass the pre-flight where megatron-core has
    the flag (0.19: the runtime builds it, tests/distributed/test_moe_mla_mtp.py) and are refused in one line naming
    the version, exit 2, before any process group where it has not (0.16.1)."""
    from patches.compat import at_least, version
    from tests.tiny_models import LLAMA

    m = LLAMA.model_copy(update={"mtp_num_layers": 2, "mtp_use_repeated_layer": True})
    p = tmp_path / "p.json"
    p.write_text(json.dumps(plan(m, (0, m.num_units, ["none"] * m.num_units))))
    rc = main(["validate", str(p), "--cluster", "1x1-cpu"])
    err = capsys.readouterr().err
    if at_least("0.17"):
        assert rc == 0, err
    else:
        assert rc == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
        assert f"model.mtp_use_repeated_layer: megatron-core {version()} has no shared MTP layer" in err, err
