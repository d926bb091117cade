"""Bad input of the runtime as one line (exit 2), for the subcommands, the pre-flight and the workers alike.

Patches raise their own ``patches._base.PatchError``; ``bad_input_from_patches`` turns it into an ``AcesoError`` (one
line, exit 2) here, so ``patches/`` knows only megatron-core.

A worker under ``aceso launch`` reports its bad input with ``report_bad_input``: into the file named by
``ACESO_ERROR_FILE`` (the first rank to fail wins), which ``aceso launch`` prints as its own one-line error with
exit 2 instead of torchrun's failure report; without that variable rank 0 prints it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from patches._base import PatchError
from search.io.errors import AcesoError


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
