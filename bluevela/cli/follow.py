"""Progress for `--wait`: a live rich line on a terminal, plain lines on state changes otherwise.

The line holds Slurm's values (state, reason, node names): shown as data (`rich_text`), never
parsed as markup.
"""

from __future__ import annotations

import time
from types import TracebackType
from typing import Any

import click

from bluevela.slurm.client import JobInfo
from bluevela.util.term import printable, rich_text


class Follower:
    def __init__(self, job_id: int, *, live: bool, console: Any = None) -> None:
        """`console`: the rich Console for the live line (default: one on stderr)."""
        self.job_id = job_id
        self.live = live
        self._console = console
        self._last: tuple[str, tuple[str, ...]] | None = None
        self._start = time.monotonic()
        self._live: Any = None

    def __enter__(self) -> Follower:
        if self.live:
            from rich.console import Console
            from rich.live import Live

            self._live = Live(console=self._console or Console(stderr=True),
                              refresh_per_second=4, transient=True)
            self._live.__enter__()
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._live is not None:
            self._live.__exit__(et, ev, tb)

    def update(self, info: JobInfo) -> None:
        elapsed = time.monotonic() - self._start
        key = (info.state_name, info.nodes)
        line = printable(f"job {self.job_id}: {info.state_name}"
                         + (f" on {','.join(info.nodes)}" if info.nodes else "")
                         + (f" ({info.reason})" if info.reason else "")
                         + (f" restarts={info.restarts}" if info.restarts else ""))
        if self._live is not None:
            from rich.spinner import Spinner

            self._live.update(Spinner("dots", text=rich_text(f"{line}  [{elapsed:.0f}s]")))
            if key != self._last:
                self._live.console.print(rich_text(line))
        elif key != self._last:
            click.echo(f"[{elapsed:6.1f}s] {line}", err=True)
        self._last = key
