"""Deprecated Megatron-LM spellings, read as the releases' ``validate_args`` rewrites them (core_v0.16.1 to
core_v0.19.0, megatron/training/arguments.py), so that the import prices what the run runs instead of listing the
old flag as unpriced:

- ``--enable-cuda-graph`` is ``--cuda-graph-impl local`` and ``--external-cuda-graph`` is ``--cuda-graph-impl
  transformer_engine`` (0.19.0 arguments.py:593-613; 0.16.1 :434-454): neither with ``--cuda-graph-impl``, and
  not both (``validate_args`` asserts each).

(``--disable-align-grad-reduce`` needs no rewrite: it is the same parser field as ``--no-align-grad-reduce``,
``cmdline._aliases``; the hybrid pattern's old spellings are ``hybrid_pattern.current_spelling``.)
"""

from __future__ import annotations

from search.io.errors import AcesoError

IMPL = "--cuda-graph-impl"
GRAPH_SWITCHES = {"--enable-cuda-graph": "local", "--external-cuda-graph": "transformer_engine"}


def current_flags(argv: list[str]) -> list[str]:
    """``argv`` with the deprecated CUDA-graph switches written as ``--cuda-graph-impl`` (module docstring)."""
    names = [w.split("=", 1)[0] for w in argv]
    given = [n for n in GRAPH_SWITCHES if n in names]
    if not given:
        return argv
    if len(given) > 1:
        raise AcesoError("--enable-cuda-graph and --external-cuda-graph cannot be enabled at the same time "
                         "(Megatron-LM's validate_args asserts it); give --cuda-graph-impl local or transformer_engine")
    if IMPL in names:
        raise AcesoError(f"{given[0]} with {IMPL}: Megatron-LM's validate_args asserts they are not used together; "
                         f"give {IMPL} alone")
    out = []
    for w, n in zip(argv, names):
        out += [IMPL, GRAPH_SWITCHES[n]] if n in GRAPH_SWITCHES else [w]
    return out
