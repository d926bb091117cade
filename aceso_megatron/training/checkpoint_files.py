"""Is a saved checkpoint readable? The files of ``iter_N`` checked without loading it, so that a damaged file is one
line naming it and ``--load`` (exit 2), not a traceback from deep inside torch on every rank.

A checkpoint folder (``checkpoint.py``) holds ``metadata.json`` (dist_checkpointing's backend, JSON),
``common.pt`` (megatron-core 0.16.1; 0.19 keeps the common state as a ``common_state`` item of the torch_dist files
and writes none: ``dist_checkpointing.serialization.load_common_state_dict``) and ``extra_rank_NNNNN.pt`` (``torch.save``: zip archives), torch DCP's ``.metadata`` (a pickle
of where every tensor lies) and the ``__R_I.distcp`` files (``torch.save`` archives one after another, at the
offsets ``.metadata`` records).

- ``damaged_file(folder)``, torch-free, before any process starts (``aceso launch`` and every worker run it from
  ``check_train_args``): a file missing, ``metadata.json`` not JSON, a ``.pt`` file not a zip archive or with a
  member whose CRC does not match. The ``.distcp`` files are not read here (a GPU checkpoint's are large).
- ``damaged_index(folder)``, with torch and cheap, in the worker before its process group: ``.metadata``
  unpickles and every item it records lies within its ``.distcp`` file.
- ``damaged_item(folder)``, only after a load failed: each item's bytes are an intact archive (CRC), to name the
  file instead of torch's ``EOFError``. A load failure it cannot trace to a file is not called a damaged checkpoint.
"""

from __future__ import annotations

import io
import json
import zipfile
from pathlib import Path

MARKER = "latest_checkpointed_iteration.txt"   # Megatron-LM's name for the file naming the latest checkpoint


def _zip_damage(data: bytes | Path) -> str | None:
    """Why ``data`` (bytes or a file) is not an intact zip archive (torch.save's format), or None."""
    try:
        with zipfile.ZipFile(io.BytesIO(data) if isinstance(data, bytes) else data) as z:
            bad = z.testzip()
    except (zipfile.BadZipFile, OSError, EOFError, ValueError, RuntimeError) as e:
        return f"is not a torch.save archive ({type(e).__name__}: {str(e)[:60]})"
    return f"has a member ({bad}) that fails its CRC check" if bad is not None else None


def damaged_file(folder: Path) -> tuple[Path, str] | None:
    """The first file of checkpoint ``folder`` that cannot be read back, and why; None when all can (torch-free;
    the ``.distcp`` tensor files are not opened)."""
    meta = folder / "metadata.json"
    for required in (meta, folder / ".metadata"):
        if not required.is_file():
            return required, "is missing"
    try:
        if not isinstance(json.loads(meta.read_text()), dict):
            return meta, "is not dist_checkpointing's JSON object"
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        return meta, f"is not JSON ({type(e).__name__})"
    extras = sorted(folder.glob("extra_rank_*.pt"))
    if not extras:
        return folder / "extra_rank_00000.pt", "is missing"
    common = [folder / "common.pt"] if (folder / "common.pt").is_file() else []    # else in .metadata (0.19)
    for f in [*common, *extras]:
        if (why := _zip_damage(f)) is not None:
            return f, why
    return None


def _storage(folder: Path):
    """torch DCP's record of where each item lies (``.metadata``), or (path, why) when it cannot be read."""
    import pickle

    from torch.distributed.checkpoint import FileSystemReader

    try:
        meta = FileSystemReader(str(folder)).read_metadata()
    except (OSError, EOFError, pickle.UnpicklingError, AttributeError, ValueError, TypeError, RuntimeError) as e:
        return folder / ".metadata", f"cannot be read ({type(e).__name__})"
    if not (folder / "common.pt").is_file() and not any(k.startswith("common_state") for k in meta.state_dict_metadata):
        return folder / "common.pt", "is missing (and .metadata records no common_state item)"
    return meta.storage_data


def _items_by_file(storage) -> dict[str, list]:
    by_file: dict[str, list] = {}
    for info in storage.values():
        by_file.setdefault(info.relative_path, []).append(info)
    return {name: sorted(items, key=lambda i: i.offset) for name, items in sorted(by_file.items())}


def damaged_index(folder: Path) -> tuple[Path, str] | None:
    """With torch, cheap (no tensor read): ``.metadata`` unpickles and every item it records lies within its
    ``.distcp`` file (a file cut short or missing); the worker runs it before any process group."""
    storage = _storage(folder)
    if isinstance(storage, tuple):
        return storage
    for name, items in _items_by_file(storage).items():
        path = folder / name
        if not path.is_file():
            return path, "is missing"
        size, end = path.stat().st_size, items[-1].offset + items[-1].length
        if end > size:
            return path, f"is cut short ({size} bytes, an item ends at byte {end})"
    return None


def damaged_item(folder: Path) -> tuple[Path, str] | None:
    """The first ``.distcp`` file holding an item whose bytes are not an intact archive (CRC), and why; None when
    every item is intact. Reads the whole checkpoint: run it only once a load has failed."""
    if (found := damaged_index(folder)) is not None:
        return found
    for name, items in _items_by_file(_storage(folder)).items():
        data = (folder / name).read_bytes()
        for info in items:
            if (why := _zip_damage(data[info.offset:info.offset + info.length])) is not None:
                return folder / name, f"has a damaged item at byte {info.offset} (it {why})"
    return None


def marked_folder(root: str) -> tuple[int, Path] | None:
    """(iteration, ``iter_N`` folder) the marker of ``root`` names; None without a readable marker."""
    marker = Path(root) / MARKER
    text = marker.read_text(errors="replace").strip() if marker.is_file() else ""
    return (int(text), Path(root) / f"iter_{int(text):07d}") if text.isdigit() else None


def damage_message(root: str, iteration: int, found: tuple[Path, str]) -> str:
    path, why = found
    return (f"--load {root}: iteration {iteration}'s {path.name} {why}: the checkpoint is damaged; restore "
            f"{path}, or write the iteration of an intact checkpoint into {Path(root) / MARKER}")
