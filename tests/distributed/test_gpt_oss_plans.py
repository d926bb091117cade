"""GPT-OSS's layer (attention sinks, clamped quick GEGLU with its offset; tests/runtime/test_gpt_oss_runtime.py's tiny
model, 4 layers) across stages on gloo against a single-process stock megatron-core ``GPTModel``: cut mid-layer into
tp 2 | tp 1 dp 2 (the tp-2 stage holds 2 of each layer's 4 sinks and half of each gated fc1's gate and linear rows),
also with sequence parallelism and the distributed optimizer, with off-by-one sinks, and with routed experts and
their biases (ep 2 on the second stage); loss and every gradient, 3
clipped optimizer steps and the weights after them, as ``test_plans.py``. The control runs the same plan with the
clamp off in the runtime, compared with the same stock model: it fails on the loss and fc1's gradients.

A checkpoint written at tp 2 | tp 1 dp 2 resumes at tp 1 dp 2 | tp 1 dp 2 with the same next-step losses as the run
that wrote it, its sinks put back whole (megatron-core's ``dist_checkpointing`` re-shards them along the heads, and
the gated fc1 as SwiGLU's ``[gate_t; up_t]``)."""

from __future__ import annotations

import torch

from aceso_megatron.testing import make_batches, run_plans, scheduled_steps, spawn
from tests.distributed.test_modern_plans import TC, plan, st
from tests.distributed.test_plans import SEED, STEPS, compare, reference_process  # noqa: F401 (fixture)
from tests.distributed.test_resume_modern import ITERS, SAVE_AT, SCHEDULE
from tests.distributed.test_resume_modern import TC as CKPT_TC
from tests.runtime.test_gpt_oss_runtime import OFF_BY_ONE, OSS, OSS_MOE

OSS4 = OSS.model_copy(update={"name": "tiny-gpt-oss-4", "num_layers": 4})
# routed experts with their biases (patches/expert_bias_out_of_place): tp 2 sp (expert tp 1) | tp 1 dp 2 ep 2
OSS_MOE4 = OSS_MOE.model_copy(update={"name": "tiny-gpt-oss-moe-4", "num_layers": 4})
CUT = (st(2, 1, 0, 3, ["selective", "none", "full"]), st(1, 2, 3, 8, ["none", "selective", "none", "full", "none"]))
SP = (st(2, 1, 0, 3, ["none", "selective", "none"], sp=True), st(1, 2, 3, 8))


def test_gpt_oss_across_stages_matches_single_process(tmp_path, reference_process):  # noqa: F811
    names = ["learnable tp 2 | tp 1 dp 2", "learnable tp 2 sp | tp 1 dp 2, distributed optimizer",
             "off-by-one tp 2 | tp 1 dp 2", "biased experts tp 2 sp | tp 1 dp 2 ep 2"]
    raws = [plan(OSS4, *CUT), plan(OSS4, *SP, distributed_optimizer=True),
            plan(OFF_BY_ONE.model_copy(update={"num_layers": 4}), *CUT),
            plan(OSS_MOE4, {**SP[0], "etp": 1}, {**SP[1], "ep": 2})]
    control = plan(OSS4.model_copy(update={"activation_func_clamp_value": None}), *CUT)
    out = tmp_path / "results.pt"
    spawn(4, run_plans, [*raws, control], str(out), SEED, STEPS, TC)
    *got, off = torch.load(out)
    failures = compare(names, raws, got)
    assert not failures, "\n".join(failures)
    assert any(k.endswith("core_attention.softmax_offset") for k in got[0]["grads"])
    assert any(".experts." in k and k.endswith("linear_fc2.bias") for k in got[3]["grads"])   # the experts' biases
    failures = compare(["clamp off in the runtime"], raws[:1], [off])   # against the stock clamped model
    assert any("loss of step 1" in f for f in failures), failures
    assert any("linear_fc1.weight" in f for f in failures), failures


TP2 = plan(OSS4, st(2, 1, 0, 3), st(1, 2, 3, 8))
TP1 = plan(OSS4, st(1, 2, 0, 5), st(1, 2, 5, 8))


def _fresh(raw, rank: int, world_size: int):
    """A runtime of ``raw`` with its learning-rate scheduler."""
    from aceso_megatron.training.engine import build_runtime
    from aceso_megatron.training.train import build_scheduler

    rt = build_runtime(raw, rank, world_size, seed=SEED, train_config=CKPT_TC)
    return rt, build_scheduler(SCHEDULE, rt.optimizer)


def _offsets(rt) -> dict[str, torch.Tensor]:
    return {k: v for k, v in rt.full_params().items() if k.endswith("softmax_offset")}


def _resume(rank: int, world_size: int, ckpt: str, out: str) -> None:
    from aceso_megatron.training import checkpoint

    batches = make_batches(OSS4, 2, 4 * ITERS, SEED)
    res = {}
    rt, sch = _fresh(TP2, rank, world_size)
    scheduled_steps(rt, sch, batches, range(SAVE_AT), 2)
    checkpoint.save(ckpt, SAVE_AT, rt, sch)
    res["saved"] = _offsets(rt)
    res["tp2"] = scheduled_steps(rt, sch, batches, range(SAVE_AT, ITERS), 2)
    rt, sch = _fresh(TP1, rank, world_size)
    res["loaded_at"] = checkpoint.load(ckpt, rt, sch)
    res["loaded"] = _offsets(rt)
    res["tp1"] = scheduled_steps(rt, sch, batches, range(SAVE_AT, ITERS), 2)
    if rank == 0:
        torch.save(res, out)


def test_checkpoint_saved_at_tp2_resumes_at_tp1(tmp_path):
    out = tmp_path / "res.pt"
    spawn(4, _resume, str(tmp_path / "ckpt"), str(out))
    res = torch.load(out)
    assert res["loaded_at"] == (SAVE_AT, False)
    assert sorted(res["loaded"]) == sorted(res["saved"]) and len(res["saved"]) == OSS4.num_layers
    for k, v in res["saved"].items():
        assert v.shape == (OSS4.num_attention_heads,) and torch.equal(res["loaded"][k], v), k
    for a, b in zip(res["tp1"], res["tp2"]):
        assert abs(a - b) <= 1e-5 * abs(b), (res["tp1"], res["tp2"])
