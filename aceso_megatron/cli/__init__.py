"""The runtime's ``aceso`` subcommands: ``profile``, ``train``, ``launch``, ``data``.

The planner's dispatcher (``search.cli``) finds them through the ``aceso.subcommands`` entry points in setup.py
and imports a module only when its subcommand (or the full help) is needed. Each module keeps the dispatcher's
contract: a docstring (its first line is the help), ``add_arguments(parser)`` and ``run(args) -> int``; importing
one imports no torch. Patches raise their own ``patches._base.PatchError``; ``bad_input_from_patches`` turns it into an
``AcesoError`` (one line, exit 2) here, so ``patches/`` knows only megatron-core.

A worker under ``aceso launch`` reports its bad input with ``report_bad_input``: into the file named by
``ACESO_ERROR_FILE`` (the first rank to fail wins), which ``aceso launch`` prints as its own one-line error with
exit 2 instead of torchrun's failure report; without that variable rank 0 prints it.

Importing this package silences the import-time notices of torch's CUDA build on a CPU machine
(``patches.compat.quiet_cuda_build_notices``): every runtime subcommand and the pre-flight are reached through it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from patches._base import PatchError
from patches.compat import quiet_cuda_build_notices
from search.io.errors import AcesoError

# before any subcommand imports torch: torch's CUDA build on a CPU machine would print a notice (patches.compat)
quiet_cuda_build_notices()


@contextmanager
def bad_input_from_patches() -> Iterator[None]:
    """A patch that refuses to apply (e.g. an untested megatron-core) is bad input: one line, exit 2."""
    try:
        yield
    except PatchError as e:
        raise AcesoError(str(e)) from None


ERROR_FILE_ENV = "ACESO_ERROR_FILE"


def report_bad_input(err: AcesoError, command: str, rank: int, env: str = ERROR_FILE_ENV) -> None:
    """One line for the whole job: into ``$ACESO_ERROR_FILE`` (atomically, first writer wins), else on rank 0."""
    path = os.environ.get(env)
    if not path:
        if rank == 0:
            print(f"{command}: error: {err}", file=sys.stderr, flush=True)
        return
    tmp = f"{path}.{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            f.write(str(err))
        os.link(tmp, path)          # fails if another rank was first
    except OSError:
        pass
    finally:
        try:
            os.unlink(tmp)
        except OSError:
            pass
