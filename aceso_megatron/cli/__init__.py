"""The runtime's ``aceso`` subcommands: ``profile``, ``train``, ``launch``, ``data``.

The planner's dispatcher (``search.cli``) finds them through the ``aceso.subcommands`` entry points in setup.py
and imports a module only when its subcommand (or the full help) is needed. Each module keeps the dispatcher's
contract: a docstring (its first line is the help), ``add_arguments(parser)`` and ``run(args) -> int``; importing
one imports no torch. Patches raise their own ``patches._base.PatchError``; ``bad_input_from_patches`` turns it into an
``AcesoError`` (one line, exit 2) here, so ``patches/`` knows only megatron-core.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from patches._base import PatchError
from search.errors import AcesoError


@contextmanager
def bad_input_from_patches() -> Iterator[None]:
    """A patch that refuses to apply (e.g. an untested megatron-core) is bad input: one line, exit 2."""
    try:
        yield
    except PatchError as e:
        raise AcesoError(str(e)) from None
