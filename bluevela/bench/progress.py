"""Watching a nightly run: rich progress bars on a terminal, plain timestamped lines otherwise.

Both implement `bluevela.bench.nightly.Events`.
"""

from __future__ import annotations

import logging
import sys
import time
from types import TracebackType
from typing import Any, TextIO

from bluevela.bench.result import Status
from bluevela.util.term import printable, rich_text

logger = logging.getLogger(__name__)


class PlainEvents:
    """One line per change, `[  12.3s] phase subject: text`, for logs and cron mail."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self._out = stream or sys.stderr
        self._t0 = time.monotonic()
        self._totals: dict[str, int] = {}
        self._done: dict[str, int] = {}

    def _line(self, text: str) -> None:
        self._out.write(f"[{time.monotonic() - self._t0:7.1f}s] {text}\n")
        self._out.flush()

    def phase(self, name: str, total: int) -> None:
        self._totals[name] = total
        self._done[name] = 0
        self._line(f"{name}: {total} job(s)")

    def grow(self, name: str, more: int) -> None:
        self._totals[name] = self._totals.get(name, 0) + more

    def job(self, name: str, subject: str, job_id: int, state: str) -> None:
        self._line(f"{name} {subject}: job {job_id} {state}")

    def done(self, name: str, subject: str, status: Status, message: str) -> None:
        self._done[name] = self._done.get(name, 0) + 1
        self._line(f"{name} {subject}: {status.name} ({self._done[name]}/"
                   f"{self._totals.get(name, 0)}) {message}")

    def note(self, message: str) -> None:
        self._line(message)


class RichEvents:
    """A progress bar per phase, and the notable lines printed above them."""

    def __init__(self, console: Any = None) -> None:
        """`console`: where to draw (default: a rich Console on stderr)."""
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            SpinnerColumn,
            TextColumn,
            TimeElapsedColumn,
        )

        self._console = console or Console(stderr=True)
        self._progress: Any = Progress(
            SpinnerColumn(), TextColumn("[bold]{task.description:<12}"), BarColumn(),
            MofNCompleteColumn(), TimeElapsedColumn(),
            # node names and job states: data, never markup
            TextColumn("{task.fields[last]}", markup=False),
            console=self._console, transient=False,
        )
        self._tasks: dict[str, Any] = {}

    def __enter__(self) -> RichEvents:
        self._progress.__enter__()
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._progress.__exit__(et, ev, tb)

    def phase(self, name: str, total: int) -> None:
        self._tasks[name] = self._progress.add_task(name, total=total, last="")

    def grow(self, name: str, more: int) -> None:
        task = self._tasks[name]
        total = self._progress.tasks[task].total or 0
        self._progress.update(task, total=total + more)

    def job(self, name: str, subject: str, job_id: int, state: str) -> None:
        self._progress.update(self._tasks[name], last=printable(f"{subject}: job {job_id} {state}"))

    def done(self, name: str, subject: str, status: Status, message: str) -> None:
        color = {Status.OK: "green", Status.WARNING: "yellow", Status.CRITICAL: "red",
                 Status.UNKNOWN: "grey50"}[status]
        self._progress.advance(self._tasks[name])
        self._progress.update(self._tasks[name], last=printable(f"{subject}: {status.name}"))
        if status is not Status.OK:
            line = rich_text(status.name, style=color)
            line.append_text(rich_text(f" {subject}: {message}"))
            self._progress.console.print(line, highlight=False)

    def note(self, message: str) -> None:
        self._progress.console.print(rich_text(message), highlight=False)
