"""The bench scripts (bench/*.py, not a package) loaded as modules for the tests that check them, with bench/ on
sys.path for the modules they import from each other."""

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def load(name: str, as_name: str | None = None):
    """bench/``name``.py as a fresh module (``as_name``: its module name, default ``name``)."""
    if str(ROOT / "bench") not in sys.path:
        sys.path.insert(0, str(ROOT / "bench"))
    spec = importlib.util.spec_from_file_location(as_name or name, ROOT / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
