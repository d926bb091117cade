"""Adam's state across optimizer kinds for a bf16 model, one process: the plain optimizer keeps its fp32 master
weights as ``optimizer.state.fp32_param.NAME`` (megatron-core's ``Float16OptimizerWithFloat16Params``), the
distributed one as ``optimizer.state.param.NAME``; ``training/optim_convert.py`` maps one to the other. A CPU run
trains in fp32 (``fast_path``), so the bf16 optimizers are built here with a bf16 fast path and stepped on fixed
gradients (no forward: CPU matmuls do not mix the dtypes); the loaded moments, master weights and step equal the
saving optimizer's bit for bit (``gather.full_optimizer_state``), in both directions."""

from __future__ import annotations

import pytest
import torch

from tests.tiny_models import GPT

MODEL = GPT.model_copy(update={"params_dtype": "bf16"})
STEPS = 2


def _plan(dist_opt: bool) -> dict:
    n = MODEL.num_units
    return {"model": MODEL.model_dump(), "micro_batch_size": 2, "global_batch_size": 4,
            "distributed_optimizer": dist_opt,
            "stages": [{"num_gpus": 1, "tp": 1, "dp": 1, "start_unit": 0, "end_unit": n, "recompute": ["none"] * n}]}


@pytest.fixture(scope="module")
def single_process():
    from aceso_megatron.testing import free_port
    from aceso_megatron.testing.reference import init_single_process

    init_single_process(free_port())


def _runtime(dist_opt: bool):
    from types import SimpleNamespace

    from aceso_megatron.model.fast_path import OFF, FastPath
    from aceso_megatron.training.engine import TrainConfig, build_runtime
    from aceso_megatron.training.train import build_scheduler

    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)   # the local specs' norms too, as transformer-engine's follow the config
    try:
        rt = build_runtime(_plan(dist_opt), 0, 1, seed=3, train_config=TrainConfig(lr=1e-2, clip_grad=0.0),
                           fast=FastPath("local", "bf16", dict(OFF)))
    finally:
        torch.set_default_dtype(default)
    schedule = SimpleNamespace(lr=1e-2, min_lr=1e-3, lr_warmup_iters=0, lr_decay_iters=None, train_iters=4,
                               lr_decay_style="constant", weight_decay=0.01)
    return rt, build_scheduler(schedule, rt.optimizer)


def _step(rt, scheduler, it: int) -> None:
    g = torch.Generator().manual_seed(it)
    for _, p in sorted(rt.named_parameters()):
        p.main_grad.copy_(torch.randn(p.shape, generator=g))
    rt.optimizer.step()
    scheduler.step(1)


@pytest.mark.parametrize("saved_dist", (True, False))
def test_bf16_master_weights_and_moments_convert(single_process, tmp_path, saved_dist):
    from megatron.core import dist_checkpointing

    from aceso_megatron.parallel.gather import OPTIMIZER_KEYS, full_optimizer_state
    from aceso_megatron.training import checkpoint

    rt, sch = _runtime(saved_dist)
    assert {p.dtype for _, p in rt.named_parameters()} == {torch.bfloat16}
    assert type(rt.optimizer.chained_optimizers[0]).__name__ == (
        "DistributedOptimizer" if saved_dist else "Float16OptimizerWithFloat16Params")
    for it in range(STEPS):
        _step(rt, sch, it)
    want = full_optimizer_state(rt)
    checkpoint.save(str(tmp_path), STEPS, rt, sch)
    keys = set(dist_checkpointing.load_tensors_metadata(str(tmp_path / f"iter_{STEPS:07d}")))
    master = "optimizer.state.param." if saved_dist else "optimizer.state.fp32_param."
    assert any(k.startswith(master) for k in keys), sorted(keys)[:5]
    rt, sch = _runtime(not saved_dist)
    assert checkpoint.load(str(tmp_path), rt, sch) == (STEPS, False)
    got = full_optimizer_state(rt)
    assert want["step"] == got["step"] == [float(STEPS)]
    for k in OPTIMIZER_KEYS:
        assert want[k].keys() == got[k].keys()
        for n in want[k]:
            assert got[k][n].dtype == torch.float32 and torch.equal(want[k][n], got[k][n]), (k, n)
    # the master weights are fp32, not the bf16 weights rounded: the conversion did not go through the model
    assert any(not torch.equal(t, t.bfloat16().float()) for t in got["param"].values())


def test_a_checkpoint_without_adam_state_is_refused_in_one_line(single_process, tmp_path):
    """A plain optimizer that never stepped saves no moments: converting them is refused on one line naming the
    missing tensor, and the weights alone still load."""
    from aceso_megatron.training import checkpoint
    from search.io.errors import AcesoError

    rt, sch = _runtime(False)
    checkpoint.save(str(tmp_path), 0, rt, sch)
    rt, sch = _runtime(True)
    with pytest.raises(AcesoError) as e:
        checkpoint.load(str(tmp_path), rt, sch)
    msg = str(e.value)
    assert msg.startswith(f"--load {tmp_path}: iteration 0 has no optimizer.state.") and "\n" not in msg, msg
    assert msg.endswith("to convert Adam's state from; add --no-load-optim to load the weights only"), msg
    assert checkpoint.load(str(tmp_path), rt, sch, load_optim=False) == (0, False)
