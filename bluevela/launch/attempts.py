"""The attempt banner: the one place that writes it and parses it.

The in-job supervisor prints, before each launch (a Slurm requeue or a relaunch inside the
allocation), one line
    ==== bv attempt <N> job <JOBID> nodes <nodelist> previous: <cause> ====
and, when an attempt ends with a known cause,
    ==== bv attempt <N> ended: <cause> ====
(docs/resilience.md; agreed in the issue-10 contract). `banner` and `end_line` write them,
`BANNER` and `END` read them back (`bv logs --attempt N`, `bv status`, and the supervisor's
own count of earlier attempts, `read_history`). Text before the first banner belongs to
attempt 1. Pure functions over text: no Slurm, no files.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

PREFIX = "==== bv attempt "
BANNER = re.compile(
    r"^==== bv attempt (?P<n>\d+) job (?P<job>\S+) nodes (?P<nodes>\S*) previous: (?P<prev>.*) ====$",
    re.M,
)
END = re.compile(r"^==== bv attempt (?P<n>\d+) ended: (?P<cause>.*) ====$", re.M)
# What came after an attempt, typed (issue 33): `bv status` reads these fields, never the
# end line's words. Written by the supervisor after the end line (`record_line`).
RECORD = re.compile(r"^==== bv attempt (?P<n>\d+) record: (?P<json>\{.*\}) ====$", re.M)
NEXT_KINDS = ("exit", "relaunch", "requeue")  # the job ended here / a step in this allocation
# / bv asked Slurm to requeue it
# The same without `^`: a pattern that starts with its literal lets `re` skip to each
# "==== bv attempt " at C speed (8x faster on a 20 MB output of 8,192 ranks, docs/scale.md);
# `_lines` keeps the matches that start a line.
_BANNER_ANY = re.compile(BANNER.pattern[1:], re.M)
_END_ANY = re.compile(END.pattern[1:], re.M)
_RECORD_ANY = re.compile(RECORD.pattern[1:], re.M)


def _lines(pattern: re.Pattern[str], text: str) -> list[re.Match[str]]:
    """`pattern.finditer(text)` of its `^`-anchored twin: the matches at a line's start."""
    return [m for m in pattern.finditer(text) if m.start() == 0 or text[m.start() - 1] == "\n"]


def one_line(text: str) -> str:
    return " ".join(text.split())


def compress(nodes: Sequence[str]) -> str:
    """A node list as Slurm writes it (``node[1,3]``); joined by commas without hostlist."""
    try:
        import hostlist

        return str(hostlist.collect_hostlist(list(nodes)))
    except Exception:  # noqa: BLE001 - a display nicety only
        return ",".join(nodes)


def expand(nodelist: str) -> list[str]:
    import hostlist

    return list(hostlist.expand_hostlist(nodelist))


def banner(attempt: int, job: str, nodes: Sequence[str], previous: str) -> str:
    """The per-attempt banner `bv logs --attempt N` splits on (N: 1-based, file order)."""
    return f"{PREFIX}{attempt} job {job} nodes {compress(nodes)} previous: {one_line(previous)} ===="


def end_line(attempt: int, cause: str) -> str:
    return f"{PREFIX}{attempt} ended: {one_line(cause)} ===="


def record_line(attempt: int, nxt: str, grown: Sequence[str] = (),
                grow_s: float | None = None) -> str:
    """The attempt's typed record: what came next (`NEXT_KINDS`), and the node(s) grown for
    the next attempt with the seconds the grow took."""
    if nxt not in NEXT_KINDS:
        raise ValueError(f"next must be one of {', '.join(NEXT_KINDS)}, not {nxt!r}")
    rec = {"next": nxt, "grown": compress(grown) if grown else None,
           "grow_s": round(grow_s, 1) if grown and grow_s is not None else None}
    return f"{PREFIX}{attempt} record: {json.dumps(rec, separators=(',', ':'))} ===="


def parse_record(text: str) -> dict[str, object] | None:
    """The fields of a record line's JSON when they are well formed, else None (an old output
    without records, or a line that is not bv's: then the end line's words are read)."""
    try:
        rec = json.loads(text)
    except ValueError:
        return None
    if not isinstance(rec, dict) or rec.get("next") not in NEXT_KINDS:
        return None
    grown, grow_s = rec.get("grown"), rec.get("grow_s")
    if not (grown is None or (isinstance(grown, str) and grown)):
        return None
    if grown is None:
        grow_s = None
    elif isinstance(grow_s, bool) or not isinstance(grow_s, (int, float)) or grow_s < 0:
        return None
    return {"next": rec["next"], "grown": grown,
            "grow_s": float(grow_s) if grow_s is not None else None}


@dataclass(frozen=True)
class History:
    """What earlier attempts left in the job output."""

    attempts: int = 0  # banners seen
    last_end: str | None = None  # the end line's cause after the last banner, if any


def read_history(lines: Iterable[bytes]) -> History:
    attempts, last_end = 0, None
    for raw in lines:
        if not raw.startswith(PREFIX.encode()):
            continue
        text = raw.decode("utf-8", "replace").rstrip("\r\n")
        if BANNER.match(text):
            attempts, last_end = attempts + 1, None
        elif (m := END.match(text)) is not None:
            last_end = m.group("cause")
    return History(attempts, last_end)


def previous_cause(history: History | None) -> str:
    if history is None or history.attempts == 0:
        return "none"
    if history.last_end is not None:
        return history.last_end
    return ("ended without a bv end line (Slurm ended the allocation: node failure of the "
            "batch node, time limit or cancel)")


@dataclass(frozen=True)
class AttemptText:
    """One attempt's slice of the output file."""

    attempt: int  # 1-based, in file order
    nodes: str  # as the banner wrote it ('' before the first banner)
    previous: str  # the banner's `previous:` cause ('' when there was no banner)
    ended: str  # the end line's cause ('' when the attempt printed none)
    text: str


def split_attempts(text: str) -> list[AttemptText]:
    """The attempts in file order. A file without banners is one attempt."""
    banners = _lines(_BANNER_ANY, text)
    if not banners:
        return [AttemptText(1, "", "", _ended(text), text)]
    out: list[AttemptText] = []
    for i, m in enumerate(banners):
        start = 0 if i == 0 else m.start()  # text before the first banner is attempt 1's
        end = banners[i + 1].start() if i + 1 < len(banners) else len(text)
        chunk = text[start:end]
        out.append(AttemptText(i + 1, m.group("nodes"), m.group("prev"), _ended(chunk), chunk))
    return out


def _ended(chunk: str) -> str:
    found = _lines(_END_ANY, chunk)
    return found[-1].group("cause") if found else ""


def attempt_causes(text: str) -> dict[int, str]:
    """Why each attempt ended, by attempt number: its end line, else the next banner's
    `previous:` text. The last attempt maps only when it printed an end line."""
    parts = split_attempts(text)
    causes: dict[int, str] = {}
    for i, part in enumerate(parts):
        nxt = parts[i + 1].previous if i + 1 < len(parts) else ""
        cause = part.ended or nxt
        if cause:
            causes[part.attempt] = cause
    return causes


GROWN = re.compile(r"\(grown (?P<node>\S+) in (?P<s>\d+(?:\.\d+)?) s, same job, no Slurm requeue\)")
# A new Slurm allocation follows the attempt (bv's requeue, or Slurm's own); otherwise the next
# attempt is a relaunch inside the same allocation (spare, shrink, grow, hang in place).
REQUEUED = re.compile(r"requeued by bv|requeued by Slurm")


def _record(chunk: str) -> dict[str, object] | None:
    found = _lines(_RECORD_ANY, chunk)
    return parse_record(found[-1].group("json")) if found else None


def bv_attempts(text: str) -> list[dict[str, object]]:
    """Each bv attempt of the output (banners: Slurm restarts AND relaunches inside the
    allocation) as plain data for `bv status`: its nodes, why it ended, whether the next one
    came through a Slurm requeue, and the node grown for the next one with the time the grow
    took (issue 19). From the attempt's typed record (`record_line`); an attempt without one
    (an output of an older bv, or a supervisor that died) is read from its end line's words."""
    out: list[dict[str, object]] = []
    causes = attempt_causes(text)
    parts = split_attempts(text)
    for part in parts:
        cause = causes.get(part.attempt, "")
        rec = _record(part.text)
        if rec is not None:
            # After an exit, a later attempt can only be Slurm's own restart of the job.
            later = part.attempt < len(parts)
            out.append({"attempt": part.attempt, "nodes": part.nodes, "ended": cause,
                        "slurm_requeue": rec["next"] == "requeue"
                        or (rec["next"] == "exit" and later),
                        "grown": rec["grown"], "grow_s": rec["grow_s"]})
            continue
        grown = GROWN.search(cause)
        out.append({"attempt": part.attempt, "nodes": part.nodes, "ended": cause,
                    "slurm_requeue": bool(REQUEUED.search(cause)),
                    "grown": grown.group("node") if grown else None,
                    "grow_s": float(grown.group("s")) if grown else None})
    return out
