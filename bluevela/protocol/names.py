"""Names and free text from the wire, fit to print or to send as one word."""

from __future__ import annotations

import functools
import re

NAME_MAX = 64


@functools.lru_cache(maxsize=8)
def _unsafe(extra: str) -> re.Pattern[str]:
    return re.compile(f"[^A-Za-z0-9_.:\\-{re.escape(extra)}]")


def safe_name(text: object, limit: int = NAME_MAX, *, replace: str = "?",
              extra: str = "") -> str:
    """A name fit to print, or (``replace=""``) to send as one word of a datagram: ASCII
    letters, digits, ``-_.:`` and `extra` kept, anything else (terminal escapes, newlines,
    spaces, ``/``) shown as `replace` or dropped; at most `limit` characters, then ``...``;
    never empty. `extra` is for words that are not names (a code position keeps the ``<>`` of
    ``<module>``)."""
    unsafe = _unsafe(extra)
    raw = str(text)
    if not replace:  # dropped characters take no room
        raw = unsafe.sub("", raw)
    out = unsafe.sub(replace, raw[:limit])  # one C pass: the supervisor names every beat's node
    return (out + "...") if len(raw) > limit else (out or "?")


def printable(text: object, limit: int = 300) -> str:
    """Free text from the wire (an agent's reason), fit for one line of the job output: runs
    of whitespace as one space, anything but printable ASCII as ``?``; at most `limit`."""
    raw = " ".join(str(text).split())
    out = "".join(c if c.isascii() and c.isprintable() else "?" for c in raw[:limit])
    return (out + "...") if len(raw) > limit else out
