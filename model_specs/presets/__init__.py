"""Model presets as data (``*.json`` here), torch-free: the planner reads them through this package only.

Its own package so that the planner (``search.spec.presets``) depends on the presets' data and not on
``model_specs``'s builders, which import the planner (tests/unit/test_import_cycles.py).
"""

from __future__ import annotations

import json
from importlib import resources


def preset_names() -> list[str]:
    folder = resources.files(__name__)
    return sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".json"))


def preset_data(name: str) -> dict:
    """The raw preset dict; ``KeyError`` if there is none."""
    f = resources.files(__name__) / f"{name}.json"
    if not f.is_file():
        raise KeyError(name)
    return json.loads(f.read_text())
