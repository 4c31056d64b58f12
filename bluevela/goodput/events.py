"""Goodput events: what the in-job supervisor saw happen to each launch, for the ledger. This
module is the record they make (its fields, bounds and checks: `fold`, `validate`,
`merge_records`, `read_events_file`); the checkpoint datagram the ranks send is
bluevela/protocol/messages.py (`CkptMsg`).

Four places touch them (docs/resilience.md, "Where the time went: goodput events"):

1. The ranks. `bluevela.runtime.checkpoint_saved(step)` / `checkpointing(step)` send ONE
   signed UDP datagram per checkpoint to the supervisor's beat socket (the same address and
   key as the heartbeat, `BV_HEARTBEAT` / `BV_JOB_SECRET`), non-blocking, never raising:

       bvck1 <rank> <step> <pid> <seq> <start_age_ms> <end_age_ms> <mac>

   (ages: how long before the send the save started and ended; `mac` as for beats, over the
   rest of the line). A dead or absent supervisor costs the loop one failed `sendto`. The
   checkpoint store (bluevela/ckpt) also sends a save's background phase (`bvcb1`, folded
   into `ckpt_bg` lines: a launch's `bgs`) and its resume (`bvcr1`, a `resume` line).
2. The supervisor (bluevela/launch/events_log.py, `EventLog`, as the job's user) appends one
   JSON line per event to its events file, in a directory the epilog can trust
   (bluevela/goodput/events_dir.py), bounded as the epilog reads it (MAX_FILE_BYTES,
   MAX_LINES), with room kept for the lines that close a launch (CLOSE_RESERVE).
3. The copy (bluevela/launch/events_copy.py): every line also goes to the agent of a second
   node of the step, which keeps it in its own node's events directory, so the record
   outlives the batch node.
4. The epilog (root; bluevela/goodput/events_epilog.py) reads those files as hostile input and
   folds them into one bounded record (`read_events_file`, every copy merged with
   `merge_records`) that goes into the node's epilog report under `goodput_events`. The
   ledger (bluevela/report/goodput.py) checks the record again with `validate()` and clamps
   it to the job's allocation before using it.

Standard library only: the supervisor, the hooks, the archive and the report import it.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from bluevela.goodput.outcome import LossKind, StepEnd
from bluevela.protocol.messages import MAX_STEP
from bluevela.protocol.names import NAME_MAX, safe_name

MAX_CKPTS = 4096  # per launch kept one by one in the record; later saves are summed
MAX_RANKS = 1 << 20  # ranks counted in a checkpoint store's record (protocol.messages.MAX_RANK)
MAX_LAUNCHES = 64
MAX_GROWS = MAX_LAUNCHES  # nodes grown into the job (one grow per launch at most)
# The writer's bounds are the reader's: the supervisor never writes a file the epilog refuses.
MAX_LINES = 65536
MAX_FILE_BYTES = 2 << 20
MAX_CAUSE = 600
MAX_NODES = 1024  # node names listed per launch (a bigger job keeps the count)
# The longest `end` line (cause of MAX_CAUSE characters JSON-escaped at worst 12 bytes each,
# MAX_NODES names of NAME_MAX+3 characters quoted, listed again with their loss kind, and the
# hung rank's node) and `requeue` line: the room the writer keeps free while a launch is
# open, so the events that close it always fit.
_KIND_MAX = max(len(k.value) for k in LossKind) + 3  # quoted, and a comma
END_LINE_MAX = (400 + 12 * MAX_CAUSE + MAX_NODES * (NAME_MAX + 3 + 3)
                + (MAX_NODES + 1) * (NAME_MAX + 3 + 3 + _KIND_MAX))
REQUEUE_LINE_MAX = 64
CLOSE_RESERVE = END_LINE_MAX + REQUEUE_LINE_MAX
# Unix times must fall between these (2001 .. 2286): anything else is not a clock reading.
T_MIN, T_MAX = 1e9, 1e10


# --------------------------------------------------------------------------------------------
# The record (the epilog, as root; the ledger again)


class EventsError(ValueError):
    """An events file or record that does not pass the checks (one-line reason)."""


def _t(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise EventsError(f"{where} is not a number")
    v = float(value)
    if not (math.isfinite(v) and T_MIN <= v <= T_MAX):
        raise EventsError(f"{where} is not a unix time")
    return v


def _opt_t(value: Any, where: str) -> float | None:
    return None if value is None else _t(value, where)


def _int(value: Any, where: str, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise EventsError(f"{where} is not an integer in [{lo}, {hi}]")
    return value


def _nodes(value: Any, where: str) -> list[str]:
    if not isinstance(value, list) or len(value) > MAX_NODES:
        raise EventsError(f"{where} is not a list of at most {MAX_NODES} names")
    out = []
    for n in value:
        if not isinstance(n, str) or safe_name(n) != n:
            raise EventsError(f"{where} holds a name that is not a node name")
        out.append(n)
    return out


def _loss_kinds(value: Any, where: str) -> dict[str, str]:
    """node -> `LossKind` value: why each node left the step (the hung rank's node too)."""
    if not isinstance(value, dict) or len(value) > MAX_NODES + 1:
        raise EventsError(f"{where} is not an object of at most {MAX_NODES + 1} nodes")
    for node, kind in value.items():
        if not isinstance(node, str) or safe_name(node) != node:
            raise EventsError(f"{where} holds a name that is not a node name")
        if kind not in _LOSS_KINDS:
            raise EventsError(f"{where} holds an unknown loss kind")
    return dict(value)


# The words a record written before the kinds existed (no `loss_kinds`) gave each reason: the
# start of the text in ``<node> lost (<text>)``. Read here only, in `legacy_loss_kinds`.
_LEGACY_PREFIXES = (("its agent's connection closed", LossKind.CLOSED),
                    ("silent for", LossKind.SILENT),
                    ("its agent never connected", LossKind.NEVER_CONNECTED),
                    ("did not answer the abort", LossKind.NO_ABORT_ANSWER),
                    ("its agent broke the protocol", LossKind.PROTOCOL))
_LEGACY_HANG = re.compile(r"^hang: rank [0-9]+ on (\S+)")


def legacy_loss_kinds(cause: str, nodes: list[str]) -> dict[str, str]:
    """The loss kinds of an end written by an older bv, which kept only the text: each lost
    node's reason by the prefix its words had then (``<node> lost (silent for ...)``), and
    the node a hang named (``hang: rank R on <node> stopped first``) as hung. A reason of
    no known prefix gives that node no kind. The one place the words are read."""
    out: dict[str, str] = {}
    m = _LEGACY_HANG.match(cause)
    if m and safe_name(m.group(1)) == m.group(1):
        out[m.group(1)] = LossKind.HUNG.value
    for node in nodes:
        said = re.search(rf"(?:^|; ){re.escape(node)} lost \((.*)", cause)
        why = said.group(1) if said else ""
        kind = next((k for prefix, k in _LEGACY_PREFIXES if why.startswith(prefix)), None)
        if kind is not None:
            out[node] = kind.value
    return out


def fold(lines: list[dict[str, Any]]) -> dict[str, Any]:
    """The event lines of one Slurm attempt -> one record (the shape `validate` checks)."""
    rec: dict[str, Any] = {"v": 1, "launches": []}
    by: dict[int, dict[str, Any]] = {}
    for i, ev in enumerate(lines):
        if not isinstance(ev, dict):
            raise EventsError(f"line {i + 1} is not an object")
        kind = ev.get("e")
        where = f"line {i + 1} ({safe_name(kind, 16)})"
        if kind in ("job", "requeue", "gone", "grow"):
            _fold_attempt_line(rec, kind, ev, where)
            continue
        n = ev.get("launch")
        if kind == "launch":
            if len(by) >= MAX_LAUNCHES or not isinstance(n, int) or n in by:
                raise EventsError(f"{where}: a launch number repeated or too many launches")
            by[n] = {"launch": n, "attempt": ev.get("attempt"), "start": ev.get("t"),
                     "n_nodes": ev.get("n_nodes"), "nodes": ev.get("nodes"),
                     "spares": ev.get("spares"), "first_progress": None, "ckpts": {},
                     "ckpt_more": [0, 0.0], "end": None, "_over": {}, "bgs": {},
                     "bg_more": [0, 0.0], "resume": None}
            rec["launches"].append(by[n])
            continue
        if not isinstance(n, int) or n not in by:
            raise EventsError(f"{where}: an event of no launch")
        _fold_launch_line(by[n], kind, ev, where)
    for la in rec["launches"]:
        la["ckpts"] = sorted(la["ckpts"].values(), key=lambda c: (c[2], c[0]))
        over = la.pop("_over").values()
        la["ckpt_more"] = [la["ckpt_more"][0] + len(over),
                           la["ckpt_more"][1] + sum(max(0.0, c[2] - c[1]) for c in over)]
        bgs = sorted(la.pop("bgs").values(), key=lambda b: (b[2], b[0]))
        if bgs:
            la["bgs"] = bgs
        if la["bg_more"][0] == 0:
            del la["bg_more"]
        if la["resume"] is None:
            del la["resume"]
    return validate(rec)


def _fold_attempt_line(rec: dict[str, Any], kind: str, ev: dict[str, Any], where: str) -> None:
    """A line of the Slurm attempt (not of one launch): `job`, `requeue`, `gone` (a copy's
    keeper saw the supervisor's connection end) or `grow` (nodes that joined the job through
    a helper job, `bv-grow-JOB`, whose id their prolog ran under)."""
    if kind == "grow":
        grows = rec.setdefault("grows", [])
        if len(grows) >= MAX_GROWS:
            raise EventsError(f"{where}: more than {MAX_GROWS} grows")
        grows.append({k: ev.get(k) for k in ("t", "helper", "nodes")})
    elif kind == "job":
        if "host" in rec:
            raise EventsError(f"{where}: a second job line")
        rec["host"] = ev.get("host")
        rec["job"] = ev.get("job")
        rec["restart"] = ev.get("restart")
        rec["opened"] = ev.get("t")
        rec["slurm"] = {k: ev.get(k) for k in ("submit", "start", "time_limit_s")}
    else:
        rec[kind] = ev.get("t")


def _fold_launch_line(la: dict[str, Any], kind: Any, ev: dict[str, Any], where: str) -> None:
    """A line of one launch: its first `progress`, a `ckpt` (a save), `ckpt_more`, its `end`."""
    if kind == "progress":
        la["first_progress"] = la["first_progress"] or ev.get("t")
    elif kind == "ckpt":
        # One line per save (a later line of the same step widens it); the first
        # MAX_CKPTS saves of a launch are kept one by one, the rest summed in ckpt_more.
        step = _int(ev.get("step"), f"{where} step", -1, MAX_STEP)
        t0, t1 = _t(ev.get("t0"), where), _t(ev.get("t1"), where)
        ck = la["ckpts"] if step in la["ckpts"] or len(la["ckpts"]) < MAX_CKPTS \
            else la["_over"]
        have = ck.get(step)
        ck[step] = [step, t0, t1] if have is None else \
            [step, min(have[1], t0), max(have[2], t1)]
    elif kind == "ckpt_bg":
        _fold_bg(la, ev, where)
    elif kind == "resume":
        # The first resume of a launch is the one its training went on from.
        la["resume"] = la["resume"] or {k: ev.get(k) for k in RESUME_KEYS}
    elif kind == "ckpt_more":
        t0, t1 = _t(ev.get("t0"), where), _t(ev.get("t1"), where)
        la["ckpt_more"] = [la["ckpt_more"][0] + 1, la["ckpt_more"][1] + max(0.0, t1 - t0)]
    elif kind == "end":
        la["end"] = {k: ev.get(k) for k in ("kind", "cause", "nodes", "loss_kinds", "failed",
                                             "detected", "gone")}
    else:
        raise EventsError(f"{where}: unknown event")


TIERS = ("local", "partner", "shared")  # the checkpoint store's places, fastest first
RESUME_KEYS = ("step", "t0", "t1", *TIERS, "skipped")


def _fold_bg(la: dict[str, Any], ev: dict[str, Any], where: str) -> None:
    """A save's background phase (the checkpoint store's writes off the training path):
    [step, start, end, ranks, ranks complete node-local, at the partner, in shared storage].
    A later line of the same step (a late rank, the drain at the end) is cumulative: the
    widest span, the largest counts. Past MAX_CKPTS steps they are summed in `bg_more`."""
    step = _int(ev.get("step"), f"{where} step", -1, MAX_STEP)
    t0, t1 = _t(ev.get("t0"), where), _t(ev.get("t1"), where)
    counts = [_int(ev.get(k), f"{where} {k}", 0, MAX_RANKS) for k in ("ranks", *TIERS)]
    have = la["bgs"].get(step)
    if have is None and len(la["bgs"]) >= MAX_CKPTS:
        la["bg_more"] = [la["bg_more"][0] + 1, la["bg_more"][1] + max(0.0, t1 - t0)]
        return
    la["bgs"][step] = [step, t0, t1, *counts] if have is None else \
        [step, min(have[1], t0), max(have[2], t1),
         *(max(a, b) for a, b in zip(have[3:], counts, strict=True))]


def validate(rec: Any) -> dict[str, Any]:
    """Check a folded record (from the epilog, or read back from the archive) field by field;
    returns a clean copy. Raises EventsError with a one-line reason."""
    if not isinstance(rec, dict) or rec.get("v") != 1:
        raise EventsError("not a version-1 goodput record")
    host = rec.get("host")
    if not isinstance(host, str) or safe_name(host) != host:
        raise EventsError("host is not a node name")
    out: dict[str, Any] = {
        "v": 1, "host": host, "job": _int(rec.get("job"), "job", 0, 10**12),
        "restart": _int(rec.get("restart"), "restart", 0, 65535),
        "opened": _t(rec.get("opened"), "opened"),
        "slurm": _valid_slurm(rec.get("slurm") or {}),
        "requeue": _opt_t(rec.get("requeue"), "requeue"), "launches": []}
    if rec.get("gone") is not None:
        out["gone"] = _t(rec["gone"], "gone")
    if rec.get("copy_on") is not None:
        on = rec["copy_on"]
        if not isinstance(on, str) or safe_name(on) != on:
            raise EventsError("copy_on is not a node name")
        out["copy_on"] = on
    if rec.get("grows") is not None:
        out["grows"] = _valid_grows(rec["grows"])
    launches = rec.get("launches")
    if not isinstance(launches, list) or len(launches) > MAX_LAUNCHES:
        raise EventsError(f"launches is not a list of at most {MAX_LAUNCHES}")
    out["launches"] = [_valid_launch(la, f"launch {i + 1}") for i, la in enumerate(launches)]
    return out


def _valid_grows(grows: Any) -> list[dict[str, Any]]:
    """The nodes grown into the job: [{t, helper (the helper job's id), nodes}]."""
    if not isinstance(grows, list) or len(grows) > MAX_GROWS:
        raise EventsError(f"grows is not a list of at most {MAX_GROWS}")
    out = []
    for i, g in enumerate(grows):
        w = f"grow {i + 1}"
        if not isinstance(g, dict):
            raise EventsError(f"{w} is not an object")
        out.append({"t": _t(g.get("t"), f"{w} t"),
                    "helper": _int(g.get("helper"), f"{w} helper", 1, 10**12),
                    "nodes": _nodes(g.get("nodes"), f"{w} nodes")})
    return out


def _valid_slurm(slurm: Any) -> dict[str, Any]:
    if not isinstance(slurm, dict):
        raise EventsError("slurm is not an object")
    limit = slurm.get("time_limit_s")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int | float)
                              or not 0 <= limit <= 366 * 86400):
        raise EventsError("time_limit_s is out of range")
    return {"submit": _opt_t(slurm.get("submit"), "slurm.submit"),
            "start": _opt_t(slurm.get("start"), "slurm.start"),
            "time_limit_s": None if limit is None else float(limit)}


def _valid_launch(la: Any, w: str) -> dict[str, Any]:
    if not isinstance(la, dict):
        raise EventsError(f"{w} is not an object")
    ckpts = la.get("ckpts")
    if not isinstance(ckpts, list) or len(ckpts) > MAX_CKPTS:
        raise EventsError(f"{w}: ckpts is not a list of at most {MAX_CKPTS}")
    clean_ck = []
    for c in ckpts:
        if not isinstance(c, list) or len(c) != 3:
            raise EventsError(f"{w}: a checkpoint is not [step, start, end]")
        step = _int(c[0], f"{w} checkpoint step", -1, MAX_STEP)
        t0, t1 = _t(c[1], f"{w} checkpoint start"), _t(c[2], f"{w} checkpoint end")
        if t1 < t0:
            raise EventsError(f"{w}: a checkpoint ends before it starts")
        clean_ck.append([step, t0, t1])
    more = _valid_more(la.get("ckpt_more"), f"{w}: ckpt_more")
    out = {
        "launch": _int(la.get("launch"), f"{w} launch", 1, 10**6),
        "attempt": _int(la.get("attempt"), f"{w} attempt", 1, 10**6),
        "start": _t(la.get("start"), f"{w} start"),
        "n_nodes": _int(la.get("n_nodes"), f"{w} n_nodes", 1, 10**6),
        "nodes": _nodes(la.get("nodes"), f"{w} nodes"),
        "spares": _int(la.get("spares"), f"{w} spares", 0, 10**6),
        "first_progress": _opt_t(la.get("first_progress"), f"{w} first_progress"),
        "ckpts": clean_ck,
        "ckpt_more": more,
        "end": None if la.get("end") is None else _valid_end(la["end"], w)}
    # The checkpoint store's records (bluevela/ckpt), only where a launch has them.
    if la.get("bgs"):
        out["bgs"] = _valid_bgs(la["bgs"], w)
    if la.get("bg_more") and la["bg_more"] != [0, 0.0]:
        out["bg_more"] = _valid_more(la["bg_more"], f"{w}: bg_more")
    if la.get("resume") is not None:
        out["resume"] = _valid_resume(la["resume"], w)
    return out


def _valid_more(more: Any, w: str) -> list[Any]:
    more = more or [0, 0.0]
    if (not isinstance(more, list) or len(more) != 2
            or not isinstance(more[1], int | float) or not 0 <= more[1] <= 1e9):
        raise EventsError(f"{w} is not [count, seconds]")
    return [_int(more[0], w, 0, 10**9), float(more[1])]


def _valid_bgs(bgs: Any, w: str) -> list[list[Any]]:
    """[[step, start, end, ranks, local, partner, shared]], each count at most `ranks`."""
    if not isinstance(bgs, list) or len(bgs) > MAX_CKPTS:
        raise EventsError(f"{w}: bgs is not a list of at most {MAX_CKPTS}")
    out = []
    for b in bgs:
        if not isinstance(b, list) or len(b) != 7:
            raise EventsError(f"{w}: a background phase is not [step, start, end, ranks, "
                              "local, partner, shared]")
        step = _int(b[0], f"{w} background step", -1, MAX_STEP)
        t0, t1 = _t(b[1], f"{w} background start"), _t(b[2], f"{w} background end")
        if t1 < t0:
            raise EventsError(f"{w}: a background phase ends before it starts")
        ranks = _int(b[3], f"{w} background ranks", 1, MAX_RANKS)
        out.append([step, t0, t1, ranks,
                    *(_int(c, f"{w} background {k}", 0, ranks)
                      for c, k in zip(b[4:], TIERS, strict=True))])
    return out


def _valid_resume(r: Any, w: str) -> dict[str, Any]:
    """{step, t0, t1, local, partner, shared, skipped}: ranks per tier, copies skipped."""
    if not isinstance(r, dict):
        raise EventsError(f"{w}: resume is not an object")
    t0, t1 = _t(r.get("t0"), f"{w} resume start"), _t(r.get("t1"), f"{w} resume end")
    if t1 < t0:
        raise EventsError(f"{w}: a resume ends before it starts")
    return {"step": _int(r.get("step"), f"{w} resume step", -1, MAX_STEP), "t0": t0, "t1": t1,
            **{k: _int(r.get(k), f"{w} resume {k}", 0, MAX_RANKS) for k in (*TIERS, "skipped")}}


_STEP_ENDS = frozenset(e.value for e in StepEnd)
_LOSS_KINDS = frozenset(k.value for k in LossKind)


def _valid_end(end: Any, w: str) -> dict[str, Any]:
    if not isinstance(end, dict) or end.get("kind") not in _STEP_ENDS:
        raise EventsError(f"{w}: end is not an object with a known kind")
    cause = end.get("cause")
    if not isinstance(cause, str) or len(cause) > MAX_CAUSE:
        raise EventsError(f"{w}: cause is not a short text")
    nodes = _nodes(end.get("nodes") or [], f"{w} end nodes")
    kinds = end.get("loss_kinds")
    return {"kind": end["kind"],
            "cause": "".join(c if c.isprintable() else "?" for c in cause),
            "nodes": nodes,
            "loss_kinds": legacy_loss_kinds(cause, nodes) if kinds is None
            else _loss_kinds(kinds, f"{w} loss_kinds"),
            "failed": _opt_t(end.get("failed"), f"{w} failed"),
            "detected": _opt_t(end.get("detected"), f"{w} detected"),
            "gone": _t(end.get("gone"), f"{w} gone")}


def merge_records(a: dict[str, Any] | None, b: dict[str, Any]) -> dict[str, Any]:
    """Two validated records of the same Slurm attempt (the supervisor's file and a copy, or
    two copies) as one: every event once. Both are the same line sequence, one maybe cut
    short, so a launch is the one that knows more (its end, more saves), saves are united by
    step, times that only one knows are kept. Idempotent: merge(a, a) == a."""
    if a is None:
        return b
    out = dict(a)
    out["slurm"] = {k: a["slurm"].get(k) if a["slurm"].get(k) is not None
                    else b["slurm"].get(k) for k in a["slurm"]}
    out["requeue"] = a["requeue"] if a["requeue"] is not None else b["requeue"]
    for key in ("gone", "copy_on"):
        if out.get(key) is None and b.get(key) is not None:
            out[key] = b[key]
    if a.get("grows") or b.get("grows"):
        by = {g["helper"]: g for g in [*(b.get("grows") or []), *(a.get("grows") or [])]}
        out["grows"] = sorted(by.values(), key=lambda g: (g["t"], g["helper"]))[:MAX_GROWS]
    mine = {la["launch"]: la for la in a["launches"]}
    merged = []
    for la in b["launches"]:
        have = mine.pop(la["launch"], None)
        if have is None:
            merged.append(la)
            continue
        best = dict(have if have["end"] is not None or la["end"] is None else la)
        steps = {c[0]: c for c in have["ckpts"]}
        for c in la["ckpts"]:
            h = steps.get(c[0])
            steps[c[0]] = c if h is None else [c[0], min(h[1], c[1]), max(h[2], c[2])]
        best["ckpts"] = sorted(steps.values(), key=lambda c: (c[2], c[0]))[:MAX_CKPTS]
        fp = [x for x in (have["first_progress"], la["first_progress"]) if x is not None]
        best["first_progress"] = min(fp) if fp else None
        best["ckpt_more"] = max(have["ckpt_more"], la["ckpt_more"])
        if have.get("bgs") or la.get("bgs"):
            bg: dict[int, list[Any]] = {g[0]: g for g in have.get("bgs") or []}
            for g in la.get("bgs") or []:
                h = bg.get(g[0])
                bg[g[0]] = g if h is None else [g[0], min(h[1], g[1]), max(h[2], g[2]),
                                                *(max(x, y) for x, y in zip(h[3:], g[3:],
                                                                            strict=True))]
            best["bgs"] = sorted(bg.values(), key=lambda g: (g[2], g[0]))[:MAX_CKPTS]
        for key in ("bg_more", "resume"):
            if best.get(key) is None and (have.get(key) or la.get(key)) is not None:
                best[key] = have.get(key) or la.get(key)
        merged.append(best)
    merged.extend(mine.values())
    out["launches"] = sorted(merged, key=lambda la: la["launch"])[:MAX_LAUNCHES]
    return out


def read_events_file(data: bytes) -> dict[str, Any]:
    """Parse one events file's bytes (JSON lines) into a validated record."""
    if len(data) > MAX_FILE_BYTES:
        raise EventsError(f"larger than {MAX_FILE_BYTES} bytes")
    lines: list[dict[str, Any]] = []
    for n, raw in enumerate(data.split(b"\n"), 1):
        if not raw.strip():
            continue
        if len(lines) >= MAX_LINES:
            raise EventsError(f"more than {MAX_LINES} lines")
        try:
            obj = json.loads(raw)
        except (ValueError, RecursionError) as exc:
            if n == data.count(b"\n") + 1:  # a last line cut by a killed writer: skipped
                break
            raise EventsError(f"line {n} is not JSON") from exc
        lines.append(obj)
    return fold(lines)
