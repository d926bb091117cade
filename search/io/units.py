"""The one memory unit of aceso: binary, labelled so (docs/inputs.md, "Units").

Memory is MiB (2^20 bytes) in every computation, JSON field (``*_mib``) and command-line flag
(``--memory-limit-mib``), and GiB (2^30 bytes) where a picture or a summary line wants a bigger number; the text
says "MiB"/"GiB", never "MB"/"GB" (those stay for bandwidths, GB/s, which are decimal as in every datasheet).
Files written before the unit was fixed used ``*_mb`` names for the same MiB values and a decimal ``memory_gb``
for a GPU: they still read (``mib_alias`` on pydantic fields, ``legacy_keys`` on plain dicts,
``gib_from_legacy_gb`` for the GPU). Torch-free.
"""

from __future__ import annotations

MIB = float(2**20)
GIB = float(2**30)


def mib_alias(name: str) -> dict:
    """Field keywords for a MiB field whose python name is ``name`` (``*_mb``): written as ``*_mib``, read as both."""
    return {"alias": mib_name(name)}


def mib_name(key: str) -> str:
    """``stage_memory_mb`` -> ``stage_memory_mib`` (a MiB key's name in files); other keys unchanged."""
    return key[:-3] + "_mib" if key.endswith("_mb") else key


def legacy_keys(row: dict) -> dict:
    """A dict read from a file, with old ``*_mb`` keys under their ``*_mib`` names (same values)."""
    return {mib_name(k) if k.endswith("_mb") and mib_name(k) not in row else k: v for k, v in row.items()}


def gib_from_legacy_gb(data):
    """pydantic before-validator: an old GPU entry's decimal ``memory_gb`` as ``memory_gib``."""
    if isinstance(data, dict) and "memory_gb" in data and "memory_gib" not in data:
        data = dict(data)
        gb = data.pop("memory_gb")
        data["memory_gib"] = gb * 1e9 / GIB if isinstance(gb, int | float) and not isinstance(gb, bool) else gb
    return data


def gib(mib: float, digits: int = 1) -> str:
    """``20000`` MiB -> ``"19.5 GiB"``."""
    return f"{mib / 1024:.{digits}f} GiB"


def mib(value: float) -> str:
    """``20000.4`` -> ``"20000 MiB"``."""
    return f"{value:.0f} MiB"
