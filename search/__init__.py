"""aceso-megatron planner: torch-free schemas, cost model and search.

Imports only the standard library, pydantic, numpy and (for output) rich. ``tests/unit/test_torch_free.py``
proves it by importing this package with ``torch`` and ``megatron`` blocked.
"""

__version__ = "0.1.0"
