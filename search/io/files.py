"""Reading input files and writing output files so that bad paths are one line and faults leave nothing broken.

Writing (``-o``, ``--trace``, ``--slurm``, ...):

- ``check_output`` runs before any work: it refuses an empty path, a folder, a missing or unwritable folder
  (a read-only folder or filesystem, ``/proc``) by creating and removing a probe file there.
- a regular file (or a new one) is written to a temporary file beside it and renamed over it, so a crash, a full
  disk or Ctrl-C never leaves a half-written file; a symbolic link to a regular file keeps being a link (the
  file it points to is replaced).
- anything that is not a regular file is never replaced: character devices (``/dev/null``), FIFOs, sockets and
  the ``/dev/stdout``, ``/dev/fd/N``, ``/proc/self/fd/N`` links are opened and written in place.
- ``write_outputs`` writes several files as one: all are staged before any is renamed into place, so a failing
  second file (``--trace /dev/full``) leaves the first (the plan) unwritten too.

Every failure is an ``AcesoError`` naming the path given (never the temporary file) and ending in "nothing was
written". Reading: ``read_text`` refuses folders and files over ``MAX_INPUT_BYTES`` (``/dev/zero``) with one line.
"""

from __future__ import annotations

import errno
import os
import re
import stat
import sys
import tempfile
from pathlib import Path

from search.io.errors import AcesoError

MAX_INPUT_BYTES = 1 << 30     # 1 GiB: far above any plan, spec or profile database
_FD_LINK = re.compile(r"^/(dev/(stdin|stdout|stderr|fd/\d+)|proc/(self|thread-self|\d+)/fd/\d+)$")


# ----- reading ----------------------------------------------------------------------------------------------------
def read_text(path: str | Path, label: str | None = None, missing: str = "no such file",
              corrupt: str = "not a text file") -> str:
    """The file's text (UTF-8); a missing, unreadable, oversized or binary file is one ``AcesoError`` line."""
    label = label or str(path)
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_INPUT_BYTES + 1)
    except FileNotFoundError:
        raise AcesoError(f"{label}: {missing}") from None
    except IsADirectoryError:
        raise AcesoError(f"{label}: is a folder; give a file") from None
    except OSError as e:
        raise AcesoError(f"{label}: cannot read it ({_reason(e)})") from None
    if len(data) > MAX_INPUT_BYTES:
        raise AcesoError(f"{label}: larger than {MAX_INPUT_BYTES >> 20} MiB; not an input file of aceso")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise AcesoError(f"{label}: {corrupt} (not UTF-8 text at byte {e.start})") from None


# ----- writing ----------------------------------------------------------------------------------------------------
def _reason(e: OSError) -> str:
    return e.strerror or errno.errorcode.get(e.errno or 0, type(e).__name__)


def is_stdout(dest: str | None) -> bool:
    return dest in (None, "-")


def _through_fd_link(path: str) -> bool:
    """Whether ``path`` is, or links through, ``/dev/stdout``-style descriptor links (write those in place)."""
    p = os.path.abspath(path)
    for _ in range(40):
        if _FD_LINK.match(p):
            return True
        if not os.path.islink(p):
            return False
        p = os.path.normpath(os.path.join(os.path.dirname(p), os.readlink(p)))
    return False


def _in_place(path: str) -> bool:
    """Write without temp + rename: the target exists and is not a regular file, or is a descriptor link."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return _through_fd_link(path)
    return not stat.S_ISREG(mode) or _through_fd_link(path)


def check_output(dest: str | None, flag: str = "-o") -> None:
    """Refuse a target that cannot be written, before any work is done (``-`` / None: stdout, always fine)."""
    if is_stdout(dest):
        return
    if not dest or not dest.strip():
        raise AcesoError(f"{flag} {dest!r}: empty path; give a file name, or - for stdout")
    if os.path.isdir(dest):
        raise AcesoError(f"{flag} {dest}: is a folder; give a file name (e.g. {os.path.join(dest, 'out.json')})")
    if _in_place(dest):
        if os.path.exists(dest) and not os.access(dest, os.W_OK):
            raise AcesoError(f"{flag} {dest}: not writable; choose another path")
        return
    target = os.path.realpath(dest)
    folder = os.path.dirname(target) or "."
    if not os.path.isdir(folder):
        shown = os.path.dirname(dest) or "."
        raise AcesoError(f"{flag} {dest}: folder {shown} does not exist; create it first")
    try:
        fd, probe = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(target)}.", suffix=".probe")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise AcesoError(f"{flag} {dest}: cannot write in folder {os.path.dirname(dest) or '.'} ({_reason(e)}); "
                         "choose another path") from None


def check_output_folder(path: str | None, flag: str) -> None:
    """Refuse a folder the run will create or write into (``--save``, ``--tensorboard-dir``) that it cannot: an
    empty path, a path that is or runs through a file, or a place without write permission; nothing is created."""
    if path is None:
        return
    if not path.strip():
        raise AcesoError(f"{flag} {path!r}: empty path; give a folder")
    if os.path.exists(path):
        if not os.path.isdir(path):
            raise AcesoError(f"{flag} {path}: not a folder (a file is there); give a folder")
        if not os.access(path, os.W_OK | os.X_OK):
            raise AcesoError(f"{flag} {path}: the folder is not writable; choose another one")
        return
    parent = os.path.normpath(path)
    while True:                           # the nearest part of the path that exists decides
        parent = os.path.dirname(parent) or "."
        if os.path.exists(parent) or parent in (".", os.sep):
            break
    if not os.path.isdir(parent):
        raise AcesoError(f"{flag} {path}: {parent} is a file, not a folder, so nothing can be made under it; give a "
                         "folder path")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise AcesoError(f"{flag} {path}: cannot create it in {parent} (not writable); choose another folder")


class _Staged:
    """One output prepared for commit: a written temporary file to rename, or text to write in place."""

    def __init__(self, text: str, dest: str, flag: str) -> None:
        self.text, self.dest, self.flag, self.tmp = text, dest, flag, None
        self.in_place = _in_place(dest)
        if not self.in_place:
            self.target = os.path.realpath(dest)
            self.tmp = self._write_temp()

    def _write_temp(self) -> str:
        folder = os.path.dirname(self.target) or "."
        try:
            fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(self.target)}.", suffix=".tmp")
        except OSError as e:
            raise self.error(e) from None
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(self.text)
            if os.path.exists(self.target):   # keep the replaced file's permissions
                os.chmod(tmp, stat.S_IMODE(os.stat(self.target).st_mode))
            else:
                umask = os.umask(0)
                os.umask(umask)
                os.chmod(tmp, 0o666 & ~umask)
        except BaseException as e:
            _unlink(tmp)
            if isinstance(e, OSError):
                raise self.error(e) from None
            raise
        return tmp

    def error(self, e: OSError) -> AcesoError:
        return AcesoError(f"{self.flag} {self.dest}: cannot write it ({_reason(e)}); nothing was written")

    def write_in_place(self) -> None:
        try:
            with open(self.dest, "w", encoding="utf-8") as f:
                f.write(self.text)
        except OSError as e:
            raise self.error(e) from None

    def commit(self) -> None:
        try:
            os.replace(self.tmp, self.target)
        except OSError as e:
            raise self.error(e) from None
        self.tmp = None

    def discard(self) -> None:
        if self.tmp:
            _unlink(self.tmp)
            self.tmp = None


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def write_outputs(items: list[tuple[str, str | None, str]]) -> None:
    """Write ``(text, dest, flag)`` items as one: every regular file is staged, then the in-place targets are
    written, then the staged files are renamed into place; on any failure the staged files are removed."""
    staged: list[_Staged] = []
    try:
        files = [(t, d, f) for t, d, f in items if not is_stdout(d)]
        for text, dest, flag in files:
            check_output(dest, flag)
            staged.append(_Staged(text, dest, flag))
        for s in staged:
            if s.in_place:
                s.write_in_place()
        for s in staged:
            if not s.in_place:
                s.commit()
    finally:
        for s in staged:
            s.discard()
    for text, dest, _ in items:
        if is_stdout(dest):
            sys.stdout.write(text)
            sys.stdout.flush()


def write_output(text: str, dest: str | None, flag: str = "-o") -> None:
    """Write ``text`` to ``dest`` (``-`` or None: stdout) as described in the module docstring."""
    write_outputs([(text, dest, flag)])
