"""Shared helpers for patches: the megatron-core version check and a record of applied swaps.

Every patch module in ``patches/`` declares ``TESTED_VERSIONS`` and calls ``check_version`` in ``apply()``, so an
untested megatron-core release is refused with one clear line instead of failing somewhere deep inside it.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

ALLOW_UNTESTED_ENV = "ACESO_ALLOW_UNTESTED_MEGATRON"


class PatchError(RuntimeError):
    """A patch refuses to apply; ``str(err)`` is one line saying why and what to do (the runtime's CLI exits 2)."""


def megatron_version() -> str:
    """The installed megatron-core release, e.g. "0.19.2". Its ``__version__`` carries ``+<git sha>`` (from 0.17 on)
    when the package's folder is inside any git checkout -- a source install in a container, or a virtual
    environment made inside a repository -- which is no other release: the local part is dropped."""
    from megatron.core import package_info

    return package_info.__version__.split("+", 1)[0]


def module_exists(module: str) -> bool:
    """Whether ``module`` can be imported (its parents are imported to find it; nothing else is)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def check_version(patch: str, tested: tuple[str, ...]) -> None:
    """Refuse to patch a megatron-core version the patch was not tested on (override with the env variable)."""
    version = megatron_version()
    if version in tested or os.environ.get(ALLOW_UNTESTED_ENV) == "1":
        return
    raise PatchError(
        f"patch {patch} was tested on megatron-core {', '.join(tested)} but {version} is installed; "
        f"install a tested version or set {ALLOW_UNTESTED_ENV}=1 to try anyway"
    )


def may_apply(patch: str, tested: tuple[str, ...], swaps: "Swaps", refusal) -> bool:
    """The start of a kernel patch's ``apply()``: False when it is applied already; ``PatchError`` with
    ``refusal()``'s line, or for an untested megatron-core; True: go on."""
    if swaps.active:
        return False
    why = refusal()
    if why:
        raise PatchError(why)
    check_version(patch, tested)
    return True


class Swaps:
    """Remembers (object, attribute, original value) so ``revert()`` can restore them in reverse order."""

    def __init__(self) -> None:
        self._saved: list[tuple[Any, str, Any]] = []

    @property
    def active(self) -> bool:
        return bool(self._saved)

    def set(self, obj: Any, name: str, value: Any) -> None:
        self._saved.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    def restore(self) -> None:
        while self._saved:
            obj, name, value = self._saved.pop()
            setattr(obj, name, value)
