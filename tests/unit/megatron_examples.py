"""Where each Megatron-LM release's ``examples/`` launch scripts are read from in the tests, and what each must give.

They are Megatron-LM's code, so the project does not store them: ``ACESO_MEGATRON_LM_EXAMPLES`` names an
``examples/`` folder, with ``{tag}`` standing for the release (``/src/{tag}/examples``: every release's; a path
without ``{tag}`` is core_v0.16.1's, as before), else ``../shared/megatron-lm-{tag}/examples`` beside the checkout is
used; a release without either skips the tests that read it, saying so (``git archive TAG examples | tar -x``).
What each script must give is ours: ``data/megatron_examples/expected.json`` for core_v0.16.1, and for a later
release ``expected_<TAG>.json`` with the scripts whose outcome differs from core_v0.16.1's (or are new); the others
give core_v0.16.1's outcome.
"""

from __future__ import annotations

import json
import os

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "data", "megatron_examples")
BASE = "core_v0.16.1"
EXPECTED = json.load(open(os.path.join(DATA, "expected.json")))
SHARED = os.path.join(HERE, "..", "..", "..", "shared", "megatron-lm-{tag}", "examples")


def expected(tag: str = BASE) -> dict[str, str]:
    """Script -> ``ok`` or the start of its one-line refusal, under ``tag`` (core_v0.16.1's, with ``tag``'s own)."""
    path = os.path.join(DATA, f"expected_{tag}.json")
    own = json.load(open(path)) if tag != BASE and os.path.exists(path) else {}
    return {**EXPECTED, **own}


def examples_root(tag: str = BASE) -> str | None:
    env = os.environ.get("ACESO_MEGATRON_LM_EXAMPLES")
    if env:
        root = env.replace("{tag}", tag) if "{tag}" in env else (env if tag == BASE else None)
    else:
        root = SHARED.format(tag=tag)
    return root if root and os.path.isdir(root) else None


def example_text(rel: str, tag: str = BASE) -> str:
    root = examples_root(tag)
    if root is None:
        pytest.skip(f"Megatron-LM {tag} examples/ not at hand: set ACESO_MEGATRON_LM_EXAMPLES to a checkout's "
                    f"examples/ ({{tag}} for the release, e.g. /src/{{tag}}/examples), or put it at "
                    f"../shared/megatron-lm-{tag}/examples")
    with open(os.path.join(root, rel)) as f:
        return f.read()
