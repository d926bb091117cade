"""The runtime's build as ordered, logged steps (``training/build_steps.py``), on 4 gloo ranks of a 2-stage plan
(tp 2 | 1, dp 1 | 2, tied embeddings): ``aceso train``'s console shows one ``[build]`` line per step, from rank 0
only, in the order ``engine.build_runtime`` runs them, each saying what that run did -- checked against the plan
(hand-derived lines) and against the built runtime itself (the patches applied, the wrapper and optimizer classes).
"""

from __future__ import annotations

import importlib
import re

from search.spec.model import ModelSpec
from search.spec.plan import ParallelPlan, StageSpec

# the build order (docs/runtime.md "Build steps"), written out here rather than read from the code under test
ORDER = ["check", "patches", "fast paths", "precision", "groups", "chunks", "wrap", "optimizer", "schedule",
         "checkpoint"]
TINY = ModelSpec(name="tiny-gpt", family="gpt", num_layers=2, hidden_size=64, num_attention_heads=4,
                 ffn_hidden_size=128, seq_length=32, vocab_size=363, params_dtype="fp32", add_bias_linear=False)


def two_stage(distributed_optimizer: bool) -> ParallelPlan:
    return ParallelPlan(model=TINY, micro_batch_size=2, global_batch_size=8,
                        distributed_optimizer=distributed_optimizer, stages=[
                            StageSpec(num_gpus=2, tp=2, dp=1, start_unit=0, end_unit=1, recompute=["none"]),
                            StageSpec(num_gpus=2, tp=1, dp=2, start_unit=1, end_unit=4, recompute=["none"] * 3)])


def _train(rank: int, world_size: int, argv: list[str]) -> None:
    """One rank of ``aceso train ARGV`` after its process group exists (``train.train``: what the command runs)."""
    from aceso_megatron.training.args import train_parser
    from aceso_megatron.training.train import train
    from search.spec.plan import load_plan

    args = train_parser().parse_args(argv)
    train(args, load_plan(args.plan), rank)


def build_lines(out: str) -> list[tuple[str, str]]:
    """``(step, text)`` of every ``[build]`` line of a console output, in order."""
    return [m.groups() for m in re.finditer(r"^ \[build\] ([a-z ]+): (.*)$", out, re.M)]


def test_train_console_shows_the_build_steps_in_order_from_rank_0(tmp_path, capfd):
    from megatron.core.optimizer import distrib_optimizer

    from aceso_megatron.testing import spawn

    (tmp_path / "two.json").write_text(two_stage(True).to_json())
    run = [str(tmp_path / "two.json"), "--cpu", "--mock-data", "--log-interval", "1", "--seed", "5",
           "--data-cache-path", str(tmp_path / "cache"), "--lr-decay-iters", "2"]
    capfd.readouterr()
    spawn(4, _train, [*run, "--train-iters", "1", "--save", str(tmp_path / "ckpt")])
    first = capfd.readouterr().out
    spawn(4, _train, [*run, "--train-iters", "2", "--load", str(tmp_path / "ckpt")])
    resumed = capfd.readouterr().out

    for out, step in ((first, 1), (resumed, 2)):
        assert [name for name, _ in build_lines(out)] == ORDER, out   # each once: 4 ranks, only rank 0 logs
        assert out.index(" [build] checkpoint: ") < out.index(f" iteration      {step}/")
    steps = dict(build_lines(first))
    assert steps["check"].startswith("tiny-gpt, 2 stage(s) on 4 cpu process(es), global batch 8 = 4 micro-batch(es) "
                                     "of 2")
    torch_adam = not distrib_optimizer.HAVE_APEX_OR_TE     # the distributed optimizer on torch's Adam needs a patch
    assert steps["patches"] == "cpu_mode" + (", dist_opt_torch_adam" if torch_adam else "")
    assert steps["fast paths"].startswith("local layer specs, fp32, fused: nothing")
    assert steps["precision"] == "fp32 parameters, gradients reduced in fp32, low-precision recipe: none"
    assert steps["groups"] == "pp 2 stage(s), tp 2|1, dp 1|2, embedding copies on stages 0, 1"
    assert steps["chunks"].startswith("1 per stage, units 0-1|1-4, initialised with std 0.02 (seed 5)")
    assert steps["wrap"].startswith("megatron-core DDP per chunk over dp 1|2, summing gradients")
    assert steps["optimizer"].startswith("distributed Adam over dp 1|2 (megatron-core), lr ")
    assert steps["schedule"].startswith("megatron-core's 1F1B over 2 stage(s), 4 micro-batch(es)")
    assert steps["checkpoint"].startswith("none loaded (no --load)")
    assert dict(build_lines(resumed))["checkpoint"] == (f"weights, optimizer, scheduler, RNG states loaded from "
                                                        f"{tmp_path / 'ckpt'} at iteration 1")


PATCHES = ("cpu_mode", "moe_router_without_te", "mla_mtp_tp_group", "mla_without_te", "qkv_gather_tp_group", "fsdp_cpu",
           "dist_opt_torch_adam", "shared_embedding_bucket")


def _build_and_compare(rank: int, world_size: int, raw: dict) -> None:
    """Build the runtime with the step lines captured; rank 0 checks each line against what was built."""
    import logging

    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.optimizer import DistributedOptimizer
    from megatron.core.optimizer.optimizer import ChainedOptimizer

    from aceso_megatron.training import build_steps
    from aceso_megatron.training.engine import build_runtime

    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda r: records.append(r.getMessage())
    build_steps.log.addHandler(handler)
    build_steps.log.setLevel(logging.INFO)
    rt = build_runtime(raw, rank, world_size, seed=3)
    if rank != 0:
        assert records == []
        return
    steps = dict(line.split(": ", 1) for line in records)
    assert list(steps) == ORDER[:-1]
    applied = [n for n in PATCHES if importlib.import_module(f"patches.{n}").is_applied()]
    assert steps["patches"] == ", ".join(applied)
    assert "shared_embedding_bucket" in applied   # tied embeddings on 2 stages, no distributed optimizer
    assert all(isinstance(m, DistributedDataParallel) for m in rt.models) and steps["wrap"].startswith(
        "megatron-core DDP")
    opt = rt.optimizer.chained_optimizers if isinstance(rt.optimizer, ChainedOptimizer) else [rt.optimizer]
    assert not any(isinstance(o, DistributedOptimizer) for o in opt) and steps["optimizer"].startswith("Adam ")
    assert rt.groups.tp.size() == 2 and rt.groups.dp.size() == 1 and "tp 2|1, dp 1|2" in steps["groups"]


def test_each_step_line_says_what_was_built():
    from aceso_megatron.testing import spawn

    spawn(4, _build_and_compare, two_stage(False).model_dump())
