"""The software releases aceso prices: NVIDIA's NeMo / Megatron-Bridge containers and the megatron-core each ships.

A container ships one megatron-core, one transformer-engine and one cuDNN (NVIDIA-NeMo/Megatron-Bridge
``docs/releases/software-versions.md``, "Software Component Versions", at 2075a5b):

    container  megatron-core  transformer-engine  Megatron-Bridge  cuDNN
    25.09      0.14.0         2.7.0               0.1.0rc3         9.11.0.98
    25.11      0.15.0 (dev)   2.9                 0.2.0            9.13.1.26
    26.02      0.16.0 (main)  2.12                0.3.0            9.18.0.50
    26.04      0.17.0         2.14                0.4.0            9.20.0.48

The point releases 26.02.01 and 26.04.01 are not in that table: they ship the same components with Megatron-Bridge
0.3.1 / 0.4.1 (the recipe tags the published 26.02.01 / 26.04.01 rows cite, ``recipe.tag``), so they are listed
with their base release's megatron-core.

A release is named by its container (``26.04.01``) or by a megatron-core / Megatron-LM version (``0.17``,
``0.17.0``, ``core_v0.17.0``): the container that ships that megatron-core (the newest such, a point release over
its base); a megatron-core newer than every listed container (0.18, 0.19) is priced as the newest container and
says so. ``resolve`` returns the release and that note. The default is the newest container (``NEWEST``).

What depends on the release is the calibration (``search/costmodel/release_constants.py``: the kernel
efficiencies fitted on each release's published rows); a release without published rows takes the nearest older
release that has them, and says so.
"""

from __future__ import annotations

import re
from typing import NamedTuple

from search.io.errors import AcesoError


class Release(NamedTuple):
    """One NeMo / Megatron-Bridge container and the components it ships."""

    name: str           # the container: 25.09, 26.04.01
    megatron_core: str
    transformer_engine: str
    bridge: str
    cudnn: str


RELEASES: tuple[Release, ...] = (
    Release("25.09", "0.14.0", "2.7.0", "0.1.0rc3", "9.11.0.98"),
    Release("25.11", "0.15.0", "2.9", "0.2.0", "9.13.1.26"),
    Release("26.02", "0.16.0", "2.12", "0.3.0", "9.18.0.50"),
    Release("26.02.01", "0.16.0", "2.12", "0.3.1", "9.18.0.50"),
    Release("26.04", "0.17.0", "2.14", "0.4.0", "9.20.0.48"),
    Release("26.04.01", "0.17.0", "2.14", "0.4.1", "9.20.0.48"),
)
BY_NAME = {r.name: r for r in RELEASES}
NEWEST = RELEASES[-1].name
NAMES: tuple[str, ...] = tuple(r.name for r in RELEASES)


def _order(name: str) -> tuple[int, ...]:
    return tuple(int(x) for x in name.split("."))


def _minor(version: str) -> tuple[int, int] | None:
    """(major, minor) of a megatron-core / Megatron-LM version: ``0.17``, ``0.17.0``, ``core_v0.17.0``,
    ``v0.16.1``, ``0.15.0rc1``; None if the text is not one."""
    m = re.fullmatch(r"(?:core_)?v?(\d+)\.(\d+)(?:\.\d+)?(?:[a-z]+\d*)?", version.strip())
    return (int(m.group(1)), int(m.group(2))) if m else None


def for_megatron(version: str) -> tuple[str, str | None]:
    """(container, note) of a megatron-core / Megatron-LM version: the newest container shipping that minor
    version; a version newer than every container: the newest container, with a note; older: an error."""
    mm = _minor(version)
    if mm is None:
        raise AcesoError(f"release {version!r}: not a container ({', '.join(NAMES)}) or a megatron-core version "
                         "(0.14 ... 0.19, core_v0.16.1)")
    ships = [r.name for r in RELEASES if _minor(r.megatron_core) == mm]
    if ships:
        return ships[-1], None
    newest = RELEASES[-1]
    if mm > _minor(newest.megatron_core):
        return newest.name, (f"megatron-core {version} ships in no listed container: priced as the newest, "
                             f"{newest.name} (megatron-core {newest.megatron_core})")
    raise AcesoError(f"release {version!r}: megatron-core {mm[0]}.{mm[1]} is older than every container aceso "
                     f"prices (the oldest, {RELEASES[0].name}, ships {RELEASES[0].megatron_core}); give one of "
                     f"{', '.join(NAMES)}")


def resolve(release: str | None) -> tuple[str, str | None]:
    """(container, note) of what the user states: a container name, a megatron-core / Megatron-LM version, or None
    (the newest container)."""
    if release is None:
        return NEWEST, None
    text = release.strip()
    if text in BY_NAME:
        return text, None
    if re.fullmatch(r"\d\d\.\d\d(\.\d\d)?", text):
        older = [n for n in NAMES if _order(n) <= _order(text)]
        if not older:       # older than every container: the nearest is the oldest
            return NAMES[0], (f"container {text} is older than every container in the release table: priced as "
                              f"{NAMES[0]}, the oldest")
        return older[-1], f"container {text} is not in the release table: priced as {older[-1]}, the nearest older"
    return for_megatron(text)


def at_or_before(name: str, candidates) -> str | None:
    """The newest of ``candidates`` (container names) not newer than ``name``, or None."""
    older = [c for c in candidates if _order(c) <= _order(name)]
    return max(older, key=_order) if older else None


def megatron_core(release: str | None) -> tuple[int, int]:
    """(major, minor) of the megatron-core a stated release runs, for megatron-core's version rules: a container's
    (its row above, a point release its base's), a megatron-core / Megatron-LM version itself (``0.19``,
    ``core_v0.19.0``), None the newest container's."""
    name = NEWEST if release is None else release.strip()
    if re.fullmatch(r"\d\d\.\d\d(\.\d\d)?", name):          # a container, listed or not (its nearest older)
        return _minor(BY_NAME[resolve(name)[0]].megatron_core)
    return _minor(name) or _minor(BY_NAME[resolve(name)[0]].megatron_core)
