"""``aceso train``'s teardown (``training/teardown.py``) in one gloo process: when ``main`` returns, the megatron-core
DDP wrapper, the optimizer, the model chunk and a process group the run built are gone -- weak references to them
dead without a garbage collection by the caller -- megatron-core's global scratch buffer is dropped and no process
group is left. Before the teardown the distributed optimizer's fp32 shard views kept DDP's gradient accumulators
(and the hooks closing over the DDP) alive past any collection, and with them every process group, until
interpreter finalization (pytorch/pytorch#179291); with plain Adam they lived until a collection."""

from __future__ import annotations

import json
import weakref

import pytest

from aceso_megatron.testing import run_fresh
from search.spec.model import ModelSpec
from search.spec.plan import ParallelPlan, StageSpec
from tests.conftest import ROOT

TINY = ModelSpec(name="tiny-gpt", family="gpt", num_layers=2, hidden_size=64, num_attention_heads=4,
                 ffn_hidden_size=128, seq_length=32, vocab_size=363, params_dtype="fp32", add_bias_linear=False)


def _plan(distributed_optimizer: bool) -> ParallelPlan:
    return ParallelPlan(model=TINY, micro_batch_size=2, global_batch_size=8,
                        distributed_optimizer=distributed_optimizer, overlap_grad_reduce=distributed_optimizer,
                        overlap_param_gather=distributed_optimizer,
                        stages=[StageSpec(num_gpus=1, tp=1, dp=1, start_unit=0, end_unit=4, recompute=["none"] * 4)])


def _train_and_watch(argv: list[str], out: str) -> int:
    """``python -m aceso_megatron.training.train ARGV`` with weak references to what its runtime built; writes
    which of them are alive after ``main`` returned, and what is left of the groups."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from aceso_megatron.training import engine, train

    refs, build = {}, engine.build_runtime

    def watched(*args, **kwargs):
        rt = build(*args, **kwargs)
        refs.update(runtime=weakref.ref(rt), ddp=weakref.ref(rt.models[0]), optimizer=weakref.ref(rt.optimizer),
                    chunk=weakref.ref(rt.chunks[0]), dp_group=weakref.ref(rt.groups.pg_collection.dp),
                    hooks=len(rt.models[0].grad_accs))
        return rt

    engine.build_runtime = watched
    rc = train.main(argv)
    alive = {k: r() is not None for k, r in refs.items() if k != "hooks"}
    with open(out, "w") as f:
        json.dump({"rc": rc, "alive": alive, "hooks": refs["hooks"], "initialized": dist.is_initialized(),
                   "memory_buffer": parallel_state._GLOBAL_MEMORY_BUFFER is not None}, f)
    return 0


@pytest.mark.parametrize("distributed_optimizer", [False, True], ids=["adam", "distributed-optimizer"])
def test_nothing_the_run_built_outlives_train(tmp_path, distributed_optimizer):
    (tmp_path / "plan.json").write_text(_plan(distributed_optimizer).to_json())
    argv = [str(tmp_path / "plan.json"), "--cpu", "--mock-data", "--train-iters", "2", "--log-interval", "1",
            "--data-cache-path", str(tmp_path / "cache")]
    if distributed_optimizer:   # dist_checkpointing's save too
        argv += ["--save", str(tmp_path / "ckpt"), "--save-interval", "1"]
    run_fresh(_train_and_watch, argv, str(tmp_path / "out.json"), cwd=ROOT)
    got = json.loads((tmp_path / "out.json").read_text())
    assert got["rc"] == 0 and got["hooks"] > 0   # the DDP had registered its gradient hooks
    assert got["alive"] == {"runtime": False, "ddp": False, "optimizer": False, "chunk": False, "dp_group": False}
    assert not got["initialized"] and not got["memory_buffer"]
    if distributed_optimizer:
        assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
