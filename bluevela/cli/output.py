"""Printing helpers shared by the commands: JSON, and rich tables on a terminal.

Cells and titles often hold values other users chose (job names, drain reasons): they are shown
as data through `bluevela.util.term` (never parsed as rich markup, control characters escaped).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import click

from bluevela.util.term import printable, rich_text

if TYPE_CHECKING:
    from rich.console import Console


def emit_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, sort_keys=True, default=str))


def is_tty() -> bool:
    return sys.stdout.isatty()


def table(title: str | None, columns: Sequence[str], rows: Sequence[Sequence[Any]], *,
          console: Console | None = None) -> None:
    """A rich table on a terminal (or on `console`); tab-separated plain lines otherwise (for
    grep/awk). A tab or newline inside a value is escaped, so one row stays one line."""
    if console is None and not is_tty():
        click.echo("\t".join(columns))
        for row in rows:
            click.echo("\t".join(printable(c) for c in row))
        return
    from rich.console import Console
    from rich.table import Table

    t = Table(title=None if title is None else rich_text(title))
    for c in columns:
        t.add_column(rich_text(c))
    for row in rows:
        t.add_row(*(rich_text(c) for c in row))
    (console or Console()).print(t)
