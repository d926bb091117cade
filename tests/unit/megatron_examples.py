"""Where Megatron-LM core_v0.16.1's ``examples/`` launch scripts are read from in the tests.

They are Megatron-LM's code, so the project does not store them: ``ACESO_MEGATRON_LM_EXAMPLES`` names an
``examples/`` folder of that tag (``git archive core_v0.16.1 examples | tar -x``), else
``../shared/megatron-lm-core_v0.16.1/examples`` beside the checkout is used; without either the tests that read
them skip, saying so. What each script must give is ours: ``data/megatron_examples/expected.json``.
"""

from __future__ import annotations

import json
import os

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
EXPECTED = json.load(open(os.path.join(HERE, "data", "megatron_examples", "expected.json")))
SHARED = os.path.join(HERE, "..", "..", "..", "shared", "megatron-lm-core_v0.16.1", "examples")


def examples_root() -> str | None:
    root = os.environ.get("ACESO_MEGATRON_LM_EXAMPLES") or SHARED
    return root if os.path.isdir(root) else None


def example_text(rel: str) -> str:
    root = examples_root()
    if root is None:
        pytest.skip("Megatron-LM core_v0.16.1 examples/ not at hand: set ACESO_MEGATRON_LM_EXAMPLES to a checkout's "
                    "examples/ (or put it at ../shared/megatron-lm-core_v0.16.1/examples)")
    with open(os.path.join(root, rel)) as f:
        return f.read()
