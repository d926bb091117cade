"""Every patch states the megatron-core versions it was tested on, docs/patches.md's table says the same, and the
installed megatron-core is one of them -- or megatron-core no longer needs the patch (``needed()`` False: it does
nothing there). The runtime and distributed tiers, run on each supported release, are the tests behind the versions.
"""

from __future__ import annotations

import importlib
import pkgutil
import re

import pytest

import patches
from patches import compat
from patches._base import megatron_version
from tests.conftest import ROOT

# patches only: not the shared helpers (_base), the compatibility module or a patch's private part (_mamba_ref:
# mamba_cpu's reference kernels, listed in its row)
MODULES = sorted(m.name for m in pkgutil.iter_modules(patches.__path__)
                 if not m.name.startswith("_") and m.name != "compat")


def _table_versions() -> dict[str, set[str]]:
    """patch name -> the versions its docs/patches.md row lists as tested."""
    out = {}
    for line in (ROOT / "docs" / "patches.md").read_text().splitlines():
        m = re.match(r"\| `patches/(\w+)\.py`[^|]* \|", line)   # a row may name its private part after it
        if m:
            tested = line.rstrip("|").split("|")[-2]
            out[m.group(1)] = set(re.findall(r"\b0\.\d+\.\d+\b", tested))
    return out


def test_every_patch_module_is_in_the_table_with_its_versions():
    table = _table_versions()
    assert sorted(table) == MODULES
    for name in MODULES:
        module = importlib.import_module(f"patches.{name}")
        assert module.NAME == name and callable(module.apply) and callable(module.revert)
        assert set(module.TESTED_VERSIONS) == table[name], name
        assert all(v in (module.__doc__ or "") for v in module.TESTED_VERSIONS), f"{name}: docstring"


@pytest.mark.parametrize("name", MODULES)
def test_the_installed_megatron_core_is_tested_or_not_in_need(name):
    module = importlib.import_module(f"patches.{name}")
    needed = getattr(module, "needed", lambda: True)()
    assert megatron_version() in module.TESTED_VERSIONS or not needed, (
        f"patches.{name}: megatron-core {megatron_version()} is installed but untested ({module.TESTED_VERSIONS})")


def test_the_installed_megatron_core_is_a_supported_release():
    v = megatron_version()
    assert any(v == s or v.startswith(f"{s}.") for s in compat.SUPPORTED), v
    assert compat.have_hybrid() == compat.at_least("0.19")


def test_a_source_install_is_its_release(monkeypatch):
    """megatron-core 0.19's ``__version__`` is "0.19.2+<git sha>" when its folder lies inside a git checkout (a
    container's source install; a venv made inside this repository, as .ci/py312-env makes one): the same release."""
    from megatron.core import package_info

    from patches._base import PatchError, check_version

    monkeypatch.delenv("ACESO_ALLOW_UNTESTED_MEGATRON", raising=False)
    monkeypatch.setattr(package_info, "__version__", "0.19.2+9633c78")
    check_version("cpu_mode", ("0.16.1", "0.19.2"))
    assert compat.version() == "0.19.2" and compat.at_least("0.19")
    monkeypatch.setattr(package_info, "__version__", "0.18.0+9633c78")
    with pytest.raises(PatchError, match="but 0.18.0 is installed"):
        check_version("cpu_mode", ("0.16.1", "0.19.2"))
