"""The test tiers share one pytest rootdir without packages per tier (``rootdir``-relative imports), so two test files
with one basename in two tiers break the collection of the whole suite ("import file mismatch"), which is what CI
runs. Found twice at merge time (test_model_rules, test_hybrid_model); this keeps it from coming back."""

from __future__ import annotations

from collections import defaultdict

from tests.conftest import ROOT


def test_no_two_test_files_share_a_basename():
    seen = defaultdict(list)
    for path in (ROOT / "tests").rglob("test_*.py"):
        seen[path.name].append(str(path.relative_to(ROOT)))
    clashes = {name: paths for name, paths in seen.items() if len(paths) > 1}
    assert not clashes, f"rename one of each: {clashes}"
