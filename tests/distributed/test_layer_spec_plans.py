"""A user's own layer spec under heterogeneous plans on gloo (3 ranks), against a single-process stock megatron-core
``GPTModel`` / ``T5Model`` built with the same spec (``tests.custom_specs``).

For each plan: the loss and every full-model gradient of one forward/backward equal the reference (fp32, relative
error <= 1e-5), and so do the losses of 3 clipped optimizer steps and the weights after them (<= 1e-4); entries
whose exact gradient is zero (key biases, see ``key_bias``) are held to absolute bounds instead; the ``megatron``
block's fields are in the config of every stage and every unit layer on every rank. A checkpoint written under one
plan (QK-norm parameters and the MLP's extra projection included) loads under another with the same weights.
"""

from __future__ import annotations

import pytest
import torch

from aceso_megatron.testing import make_batches, spawn
from aceso_megatron.testing.reference import stock_run
from aceso_megatron.training.engine import TrainConfig
from search.spec.plan import ParallelPlan
from tests.tiny_models import GPT, T5

SEED, STEPS, WORLD = 5, 3, 3
TC = TrainConfig(lr=1e-3, clip_grad=0.3)
TOL, TOL_WEIGHTS = 1e-5, 1e-4
BLOCK = {"qk_layernorm": True, "layernorm_epsilon": 1e-6, "softmax_scale": 0.3, "init_method_std": 0.05}
QK = GPT.model_copy(update={"layer_spec": "tests.custom_specs:qk_norm_squared_relu", "megatron": BLOCK})
QK_STOCK = GPT.model_copy(update={"megatron": BLOCK})
PARALLEL = GPT.model_copy(update={"layer_spec": "tests.custom_specs:parallel_block", "megatron": BLOCK})
T5_CUSTOM = T5.model_copy(update={"layer_spec": {"encoder": "tests.custom_specs:t5_encoder",
                                                 "decoder": "tests.custom_specs:t5_decoder"}, "megatron": BLOCK})


def st(tp, dp, lo, hi, rc=None):
    return {"num_gpus": tp * dp, "tp": tp, "dp": dp, "start_unit": lo, "end_unit": hi,
            "recompute": rc or ["none"] * (hi - lo)}


def plan(model, *stages, mb=2, gbs=4):
    return {"model": model.model_dump(), "micro_batch_size": mb, "global_batch_size": gbs, "stages": list(stages)}


PLANS = {
    "qk tp 2->1, attn_dropout, selective custom MLP": plan(
        QK, st(2, 1, 0, 3, ["attn_dropout", "selective", "full"]), st(1, 1, 3, 4, ["selective"])),
    "qk dp 1->2": plan(QK, st(1, 1, 0, 1, ["full"]), st(1, 2, 1, 4, ["selective", "none", "full"])),
    "stock qk_layernorm, sequence-parallel tp 2->1": plan(   # the docs' own example under SP (issue 25)
        QK_STOCK, {**st(2, 1, 0, 3, ["none", "selective", "full"]), "sequence_parallel": True}, st(1, 1, 3, 4)),
    "parallel block (whole layers) tp 2->1": plan(PARALLEL, st(2, 1, 0, 2, ["full", "full"]), st(1, 1, 2, 4)),
    "t5 custom tp 2->1, boundary cross|mlp": plan(
        T5_CUSTOM, st(2, 1, 0, 6, ["full", "selective", "attn_dropout", "none", "selective", "full"]),
        st(1, 1, 6, 10, ["none", "selective", "full", "none"])),
}
CKPT_FROM, CKPT_TO = PLANS["qk tp 2->1, attn_dropout, selective custom MLP"], PLANS["qk dp 1->2"]


def _scheduler(rt):
    """The runtime's own learning-rate scheduler (checkpoints carry it; resume checks it against the command line)."""
    from types import SimpleNamespace

    from aceso_megatron.training.schedule import build_scheduler
    args = SimpleNamespace(lr=1e-3, min_lr=0.0, lr_decay_iters=None, train_iters=STEPS, lr_warmup_iters=0,
                           lr_decay_style="constant", weight_decay=0.0)
    return build_scheduler(args, rt.optimizer)


def _configs(rt) -> list[dict]:
    cfgs = [rt.stage_module.config] + [u.layer.config for u in rt.stage_module.units]
    return [{k: getattr(c, k) for k in BLOCK} for c in cfgs]


def worker(rank: int, world_size: int, out: str, ckpt: str) -> None:
    import torch.distributed as dist

    from aceso_megatron.parallel.grads import clip_grad_norm
    from aceso_megatron.training import checkpoint
    from aceso_megatron.training.engine import build_runtime

    results = []
    for raw in PLANS.values():
        rt = build_runtime(raw, rank, world_size, seed=SEED, train_config=TC)
        batches = make_batches(rt.plan.model, rt.plan.micro_batch_size, rt.plan.global_batch_size, SEED)
        losses = [rt.forward_backward(iter(batches))]
        grads = rt.full_grads()
        norm = clip_grad_norm(rt, TC.clip_grad)
        rt.optimizer.step()
        losses += [rt.train_step(iter(batches)) for _ in range(STEPS - 1)]
        configs = [None] * world_size
        dist.all_gather_object(configs, _configs(rt))
        results.append({"losses": losses, "grads": grads, "grad_norm": norm, "params": rt.full_params(),
                        "configs": configs})
        if raw is CKPT_FROM:
            checkpoint.save(ckpt, STEPS, rt, _scheduler(rt))
            saved = results[-1]["params"]
        dist.barrier()
    rt = build_runtime(CKPT_TO, rank, world_size, seed=SEED + 1, train_config=TC)
    assert checkpoint.load(ckpt, rt, _scheduler(rt))[0] == STEPS
    loaded = rt.full_params()
    if rank == 0:
        torch.save({"plans": results, "saved": saved, "loaded": loaded}, out)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    d = tmp_path_factory.mktemp("layer-specs")
    spawn(WORLD, worker, str(d / "out.pt"), str(d / "ckpt"))
    return torch.load(d / "out.pt")


@pytest.fixture(scope="module")
def reference_process():
    from aceso_megatron.testing import free_port
    from aceso_megatron.testing.reference import init_single_process

    init_single_process(free_port())


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def key_bias(name: str, n: int, model, names) -> torch.Tensor:
    """Entries of a parameter whose exact gradient is zero: a bias added to every key shifts each query's scores by
    one constant, which the softmax cancels (the key-norm bias; without a key norm, the key slices of the QKV / KV
    biases, laid out per query group as [q heads, k, v] / [k, v]). Their computed gradients are rounding noise,
    which Adam turns into steps of random sign; they are compared separately, absolutely."""
    mask = torch.zeros(n, dtype=torch.bool)
    d, g = model.head_dim, model.groups
    if name.endswith("k_layernorm.bias"):
        mask[:] = True
    elif name.endswith(("linear_qkv.bias", "linear_kv.bias")) and name.rsplit(".", 2)[0] + ".k_layernorm.bias" \
            not in names:
        q = model.num_attention_heads // g * d if name.endswith("linear_qkv.bias") else 0
        for j in range(g):
            lo = j * (n // g) + q
            mask[lo:lo + d] = True
    return mask


def compare(name, what, got, want, model, tol) -> list[str]:
    out = []
    scale = max(float(g.norm()) for g in want.values())
    for k, g in want.items():
        a, b = got[k].flatten(), g.flatten()
        zero = key_bias(k, b.numel(), model, want) if b.dim() == 1 else torch.zeros(b.numel(), dtype=torch.bool)
        if what == "grads" and zero.any() and float(b[zero].abs().max()) > 1e-6 * scale:
            out.append(f"{name}: the reference gradient of {k}'s key entries is not zero")
        keep = ~zero
        err = rel(a[keep], b[keep]) if keep.any() else 0.0
        noise = float((a[zero] - b[zero]).abs().max()) if zero.any() else 0.0
        if err > tol or noise > (1e-6 * scale if what == "grads" else 3 * STEPS * TC.lr):
            out.append(f"{name}: {what[:-1]} {k} rel err {err:.2e}, key entries {noise:.1e}")
    return out


def test_custom_specs_under_plans_equal_the_stock_model(results, reference_process):
    failures = []
    for (name, raw), got in zip(PLANS.items(), results["plans"]):
        want = stock_run(raw, SEED, TC, STEPS)
        model = ParallelPlan.model_validate(raw).model
        assert got["grad_norm"] > TC.clip_grad, f"{name}: clipping inactive"
        assert set(got["params"]) == set(want["params"]), f"{name}: parameter sets differ"
        for what, tol in (("grads", TOL), ("params", TOL_WEIGHTS)):
            failures += compare(name, what, got[what], want[what], model, tol)
        failures += [f"{name}: loss of step {i + 1} {a} != {b}" for i, (a, b) in enumerate(zip(got["losses"],
                     want["losses"])) if abs(a - b) > TOL * abs(b)]
    assert not failures, "\n".join(failures)


def test_megatron_fields_reach_every_stage_and_unit(results):
    for name, got in zip(PLANS, results["plans"]):
        per_rank = got["configs"]
        assert len(per_rank) == WORLD and all(len(cfgs) > 1 for cfgs in per_rank), name
        assert all(c == BLOCK for cfgs in per_rank for c in cfgs), f"{name}: {per_rank}"


def test_checkpoint_of_custom_modules_resumes_under_another_plan(results):
    saved, loaded = results["saved"], results["loaded"]
    assert {"decoder.layers.0.mlp.linear_in.weight", "decoder.layers.1.self_attention.k_layernorm.weight"} <= set(saved)
    assert set(saved) == set(loaded)
    for k, v in saved.items():
        assert torch.equal(v, loaded[k]), k
