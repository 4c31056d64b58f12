"""Printing helpers shared by the commands: JSON, and rich tables on a terminal."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import Any

import click


def emit_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, sort_keys=True, default=str))


def is_tty() -> bool:
    return sys.stdout.isatty()


def table(title: str | None, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """A rich table on a terminal; tab-separated plain lines otherwise (for grep/awk)."""
    if not is_tty():
        click.echo("\t".join(columns))
        for row in rows:
            click.echo("\t".join("" if c is None else str(c) for c in row))
        return
    from rich.console import Console
    from rich.table import Table

    t = Table(title=title)
    for c in columns:
        t.add_column(c)
    for row in rows:
        t.add_row(*("" if c is None else str(c) for c in row))
    Console().print(t)
