"""Resumable progress of a profiling run: results appended one line per measurement, skipped on restart.

The partial file (``<DB>.partial.jsonl``) starts with a header line holding the run's settings (model
fingerprint, dtype, device, world size, repeats); each further line is ``{"key": ..., "result": ...}``,
written and flushed (fsync) by rank 0 as soon as a measurement finishes, so a run killed at any moment loses at
most the measurement in flight. A restart with the same settings reads the finished keys and skips them; a
partial file made with other settings is refused (``--fresh`` starts over). A torn last line (killed while
writing) is ignored. When the database is written, the partial file is removed.

The progress bar (rich, rank 0 only, on stderr) counts measurements and shows the time left.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from search.io.errors import AcesoError


def partial_path(db_path: str | Path) -> Path:
    p = Path(db_path)
    return p.with_name(p.name + ".partial.jsonl")


class PartialFile:
    """Rank 0's append-only record of finished measurements."""

    def __init__(self, path: Path, header: dict, fresh: bool = False):
        self.path, self.header = path, header
        self.done: dict[str, dict] = {}
        if path.exists() and not fresh:
            self._read()
        else:
            self._start()

    def _start(self) -> None:
        with open(self.path, "w") as f:
            f.write(json.dumps({"header": self.header}) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def _read(self) -> None:
        lines = self.path.read_text().splitlines()
        try:
            head = json.loads(lines[0])["header"] if lines else None
        except (json.JSONDecodeError, KeyError, TypeError):
            head = None
        if head != self.header:
            diff = sorted(k for k in set(self.header) | set(head or {}) if (head or {}).get(k) != self.header.get(k))
            raise AcesoError(f"{self.path}: an unfinished profile made with other settings ({', '.join(diff[:4])});"
                             " rerun with the same options, or add --fresh to start over")
        for ln in lines[1:]:
            try:
                rec = json.loads(ln)
                self.done[rec["key"]] = rec["result"]
            except (json.JSONDecodeError, KeyError, TypeError):
                continue   # a line torn by a kill
        if lines and not self.path.read_text().endswith("\n"):
            with open(self.path, "a") as f:   # terminate a torn line so the next record starts cleanly
                f.write("\n")

    def add(self, key: str, result: dict) -> None:
        self.done[key] = result
        with open(self.path, "a") as f:
            f.write(json.dumps({"key": key, "result": result}) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def remove(self) -> None:
        if self.path.exists():
            self.path.unlink()


class Progress:
    """A rich progress bar with the time left (no-op when ``enabled`` is false)."""

    def __init__(self, total: int, skipped: int, enabled: bool, show_resume: bool = True):
        self._bar = None
        if skipped and show_resume:
            print(f"resuming: {skipped} of {total} measurements already done, skipping them", file=sys.stderr,
                  flush=True)
        if not enabled:
            return
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )
        from rich.progress import Progress as RichProgress

        console = Console(file=sys.stderr)
        self._bar = RichProgress(TextColumn("[bold]profile[/] {task.description}"), BarColumn(),
                                 MofNCompleteColumn(), TimeElapsedColumn(), TextColumn("left"),
                                 TimeRemainingColumn(), console=console, transient=False)
        self._bar.start()
        self._task = self._bar.add_task("", total=total, completed=skipped)

    def update(self, description: str, advance: int = 0) -> None:
        if self._bar is not None:
            self._bar.update(self._task, description=description, advance=advance)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
