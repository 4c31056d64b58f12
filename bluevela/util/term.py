"""Showing values that come from Slurm or from users (job names, drain reasons, process names)
on someone else's terminal: as data, never as rich markup, emoji codes or control sequences.

Any user can name a job `[/oops]` (rich raises MarkupError on it, so `bv status` breaks for
everyone) or `[link=...]`/`:emoji:`/`ESC ] ...` (which would restyle or retitle an operator's
terminal). Every such value goes through `printable` (control and bidi characters become
visible escapes) and reaches rich only as a `rich.text.Text` (never parsed as markup).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.text import Text

# C0/C1 controls, DEL, and the invisible characters that reorder or hide text (bidi overrides,
# zero-width, BOM).
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200b-\u200f\u202a-\u202e\u2060-\u2069\ufeff]")
_NAMED = {"\t": "\\t", "\n": "\\n", "\r": "\\r"}


def _escape(m: re.Match[str]) -> str:
    c = m.group()
    if c in _NAMED:
        return _NAMED[c]
    return f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}"


def printable(value: object) -> str:
    """`value` as one line of visible text: control characters become `\\n`, `\\x1b`, ..."""
    text = "" if value is None else str(value)
    return _UNSAFE.sub(_escape, text)


def rich_text(value: object, style: str = "") -> Text:
    """A rich `Text` showing `printable(value)` literally (no markup, emoji or highlighting)."""
    from rich.text import Text

    return Text(printable(value), style=style)
