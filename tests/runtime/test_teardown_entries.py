"""Every other entry point that builds the runtime releases it as ``aceso train`` does (``training/teardown.py``):
the profiler's optimizer probe (``profiler.optim.optimizer_step``), the distributed tests' rank entry and worker
(``testing._entry`` running ``testing.run_plans``) and the two benches that build runtimes
(``bench/predict_vs_measure.py``'s ``measure``, ``bench/runtime_overhead.py``'s ``worker``). Each runs in one
fresh gloo process; weak references to what each runtime built (the DDP wrapper, the optimizer, a chunk) must be
dead when the entry returns, with no garbage collection by the caller -- and a runtime already dead when the next
one of the same process is built. ``_entry`` must also leave no process group and no megatron-core scratch buffer.
Before, each dropped its runtime to the garbage collector, where megatron-core's DDP gradient hooks kept it in a
cycle (past any collection with the distributed optimizer) to interpreter finalization (pytorch/pytorch#179291).
``tests/distributed/test_profile_e2e.py`` checks a launched ``aceso profile``'s ranks at exit."""

from __future__ import annotations

import json
import weakref

import pytest

from aceso_megatron.testing import run_fresh
from tests.conftest import ROOT
from tests.runtime.test_teardown import TINY, _plan


class _Watch:
    """``engine.build_runtime`` wrapped: weak references to each runtime's DDP, optimizer and first chunk, and at
    each build which of the earlier runtimes' objects are still alive."""

    def __init__(self):
        from aceso_megatron.training import engine

        self.refs, self.alive_at_build, self._build = [], [], engine.build_runtime
        engine.build_runtime = self

    def __call__(self, *args, **kwargs):
        self.alive_at_build.append(self.alive())
        rt = self._build(*args, **kwargs)
        self.refs.append({"ddp": weakref.ref(rt.models[0]), "optimizer": weakref.ref(rt.optimizer),
                          "chunk": weakref.ref(rt.chunks[0])})
        return rt

    def alive(self) -> list[str]:
        return sorted(f"{i}:{k}" for i, refs in enumerate(self.refs) for k, r in refs.items() if r() is not None)


def _groups_left() -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state

    return {"initialized": dist.is_initialized(), "memory_buffer": parallel_state._GLOBAL_MEMORY_BUFFER is not None}


def _write(out: str, watch: _Watch, **more) -> int:
    with open(out, "w") as f:
        json.dump({"built": len(watch.refs), "alive_at_build": watch.alive_at_build, "alive": watch.alive(),
                   **more}, f)
    return 0


def _optimizer_probe(out: str) -> int:
    """The profiler's optimizer probe inside a 1-rank gloo group (as an ``aceso profile`` worker runs it)."""
    import torch.distributed as dist

    from aceso_megatron.profiler.optim import optimizer_step

    watch = _Watch()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    got = optimizer_step(TINY, 1, 0, "cpu", warmup=1, repeats=2)
    rc = _write(out, watch, us_per_param=got["us_per_param"])
    dist.destroy_process_group()
    return rc


def _entry_of(fn, args: tuple, out: str) -> int:
    """``testing._entry`` (what ``spawn`` runs on each rank) of ``fn`` at rank 0 of 1."""
    from aceso_megatron.parallel.distenv import free_port
    from aceso_megatron.testing import _entry

    watch = _Watch()
    _entry(0, 1, free_port(), fn, args)
    return _write(out, watch, **_groups_left())


def _run_plans(tmp: str, out: str) -> int:
    from aceso_megatron.testing import run_plans
    from aceso_megatron.training.engine import TrainConfig

    plans = [json.loads(_plan(d).to_json()) for d in (True, False)]
    return _entry_of(run_plans, (plans, f"{tmp}/results.pt", 1, 2, TrainConfig(lr=1e-3)), out)


def _predict_vs_measure(tmp: str, out: str) -> int:
    from tests.unit.bench_modules import load

    bench = load("predict_vs_measure")
    plans = [json.loads(_plan(d).to_json()) for d in (True, False)]
    return _entry_of(bench.measure, (plans, 2, 1, 1, f"{tmp}/measured.json"), out)


def _runtime_overhead(tmp: str, out: str) -> int:
    from tests.unit.bench_modules import load

    bench = load("runtime_overhead")   # pp 1, tp 1, dp 1, --modern (the distributed optimizer), 2 steps
    return _entry_of(bench.worker, (1, 1, 1, True, 2, "cpu", f"{tmp}/times.pt"), out)


def test_the_profilers_optimizer_probe_releases_its_runtime(tmp_path):
    run_fresh(_optimizer_probe, str(tmp_path / "out.json"), cwd=ROOT)
    got = json.loads((tmp_path / "out.json").read_text())
    assert got["built"] == 1 and got["us_per_param"] > 0
    assert got["alive"] == []


@pytest.mark.parametrize("entry", [_run_plans, _predict_vs_measure, _runtime_overhead],
                         ids=["testing.run_plans", "bench.predict_vs_measure", "bench.runtime_overhead"])
def test_a_rank_entry_releases_each_runtime_and_destroys_the_groups(tmp_path, entry):
    run_fresh(entry, str(tmp_path), str(tmp_path / "out.json"), cwd=ROOT)
    got = json.loads((tmp_path / "out.json").read_text())
    assert got["built"] == (1 if entry is _runtime_overhead else 2)
    assert got["alive_at_build"] == [[]] * got["built"]   # the plan before dead when the next is built
    assert got["alive"] == []
    assert not got["initialized"] and not got["memory_buffer"]
