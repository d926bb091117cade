"""Tier markers by folder, and the shared reference database location."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
REFERENCE_DB = ROOT.parent / "shared" / "aceso-reference-db"
TIERS = ("unit", "runtime", "distributed", "gpu")


def pytest_collection_modifyitems(config, items):
    for item in items:
        parts = Path(str(item.fspath)).relative_to(ROOT / "tests").parts
        if parts and parts[0] in TIERS:
            item.add_marker(getattr(pytest.mark, parts[0]))


@pytest.fixture(scope="session")
def reference_db() -> Path:
    """``../shared/aceso-reference-db`` (the Aceso artifact's published database); skip if absent."""
    if not (REFERENCE_DB / "miniset").is_dir():
        pytest.skip(f"Aceso reference database not found at {REFERENCE_DB} (it lives in ../shared beside the repo)")
    return REFERENCE_DB
