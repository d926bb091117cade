"""setup.py's runtime extra by environment markers: Python 3.11 gets torch 2.13.0 (its CPU wheel) and megatron-core
0.16.1; Python 3.12 keeps what the environment has -- an NGC 26.x container's torch and megatron-core 0.19.x
satisfy it, nothing is downgraded -- and never resolves to 0.17 / 0.18, which the runtime does not support. The
requirement strings are read from setup.py itself and evaluated with ``packaging`` (pip's own rules)."""

from __future__ import annotations

import ast

import pytest

from tests.conftest import ROOT

requirements = pytest.importorskip("packaging.requirements")


def runtime_extra() -> list:
    tree = ast.parse((ROOT / "setup.py").read_text())
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup")
    extras = ast.literal_eval(next(k.value for k in call.keywords if k.arg == "extras_require"))
    return [requirements.Requirement(r) for r in extras["runtime"]]


def accepts(python: str, name: str, version: str) -> bool:
    """Whether ``name==version`` satisfies every runtime requirement of ``name`` that applies on ``python``."""
    env = {"python_version": python, "python_full_version": f"{python}.1"}
    reqs = [r for r in runtime_extra() if r.name == name and (r.marker is None or r.marker.evaluate(env))]
    assert reqs, (python, name)
    return all(r.specifier.contains(version, prereleases=True) for r in reqs)


def test_python_311_gets_the_cpu_torch_and_megatron_core_0_16():
    assert accepts("3.11", "torch", "2.13.0") and not accepts("3.11", "torch", "2.14.1")
    assert accepts("3.11", "megatron-core", "0.16.1")
    assert not any(accepts("3.11", "megatron-core", v) for v in ("0.17.0", "0.19.2"))


def test_python_312_keeps_an_ngc_stack():
    for torch in ("2.14.1", "2.13.0", "2.10.0"):
        assert accepts("3.12", "torch", torch)
    for mcore in ("0.19.0", "0.19.2", "0.16.1"):
        assert accepts("3.12", "megatron-core", mcore)
    for unsupported in ("0.17.0", "0.18.2", "0.20.0"):
        assert not accepts("3.12", "megatron-core", unsupported)
