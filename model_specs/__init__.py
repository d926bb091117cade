"""Model architectures: presets as data files (``presets/*.json``), torch-free.

``model_specs.builders`` (torch, megatron-core) turns a ``search.spec.model.ModelSpec`` into megatron-core
``TransformerConfig``/``ModuleSpec`` objects, and ``model_specs.extensions`` imports and checks a user's own
``layer_spec`` and ``megatron`` block; importing this package imports neither.
"""

from __future__ import annotations

import json
from importlib import resources


def preset_names() -> list[str]:
    folder = resources.files(__name__) / "presets"
    return sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".json"))


def preset_data(name: str) -> dict:
    """The raw preset dict; ``KeyError`` if there is none."""
    f = resources.files(__name__) / "presets" / f"{name}.json"
    if not f.is_file():
        raise KeyError(name)
    return json.loads(f.read_text())
