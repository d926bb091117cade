"""Tier markers by folder, and the shared reference database location."""

from __future__ import annotations

import gc
import os
import sys
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


def pytest_collection_finish(session):
    """One torch thread in this process and in the processes the tests start (``OMP_NUM_THREADS=1``, as the ranks
    of ``testing.spawn`` and ``aceso launch`` already run). The tests' models are tiny: two OpenMP threads per op
    only spin-wait for each other (on 2 shared cores test_plans.py's 2-rank stock references took 10 s of CPU on
    two threads, 0.75 s on one). A user's own OMP_NUM_THREADS is kept. Set after collection, so the in-process
    numpy of the torch-free tests is left as it was."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    # What collection imported (torch, megatron-core, the test modules: ~430k objects) moves to the collector's
    # permanent generation: each full collection the tests' allocations start walked all of it again (0.3-0.7 s
    # apiece on 2 shared cores); what the tests make is collected as before. The ranks' forkserver does the same
    # (aceso_megatron/testing/frozen.py).
    gc.freeze()


@pytest.fixture(scope="session")
def reference_db() -> Path:
    """``../shared/aceso-reference-db`` (the Aceso artifact's published database); skip if absent."""
    if not (REFERENCE_DB / "miniset").is_dir():
        pytest.skip(f"Aceso reference database not found at {REFERENCE_DB} (it lives in ../shared beside the repo)")
    return REFERENCE_DB
