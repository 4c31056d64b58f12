"""A spooled node report read back: bounded, never through a symlink, validated field by field.

`load_report` reads one entry that `spool.scan_spool` listed; `validate_report` checks and
normalises a parsed report (the hooks' own output, and what ingest archives without a spool).
A job's owner can write nothing here directly, but a report carries values that came from the
job (its name, its nodelist): every text is bounded, every number checked, and what is not a
number is kept apart (`nonnumeric`) rather than refused.

Report format (schema 1), one JSON object:
    schema: 1, kind: "node_report", phase: "prolog" | "epilog",
    job_id: int, node: str, restart: int (SLURM_JOB_RESTART_COUNT, 0..65535; absent: 0), user: str, partition: str, num_nodes: int,
    nodelist: str (a hostlist expression, `node[1-3]`; a list of names is accepted too),
    time: float (unix s, when written),
    exit_code: int | null, exit_signal: int | null, derived_exit_code: int | null  (epilog),
    health: {status, status_code, tier, duration_s, checks: [{name, status, status_code,
             summary, metrics: {<name>_<unit>: number}, duration_s,
             info: {<field>: str} (optional: text facts, e.g. the versions check's)}]},
    telemetry: {<name>_<unit>: number}  (per-job deltas in the epilog),
    drained: bool, drain_reason: str | null
"""

from __future__ import annotations

import functools
import json
import math
import os
import stat
from pathlib import Path
from typing import Any

from bluevela.archive.spool import (
    MAX_REPORT_BYTES,
    SCHEMA,
    ReportError,
    SpoolDir,
    SpoolEntry,
    safe_restart,
)
from bluevela.errors import UnsafeValueError
from bluevela.util.fs import read_bounded, safe_job_id, safe_node_name

_NAME_LIMIT = 64
_TIER_LIMIT = 32
_STATUS_CODES = {"OK": 0, "WARNING": 1, "CRITICAL": 2, "UNKNOWN": 3}

def load_report(spool: Path | SpoolDir, entry: SpoolEntry) -> dict[str, Any]:
    """Read and validate one spooled report (never through a symlink).

    Raises:
        ReportError: unreadable, not JSON, truncated, or not a valid schema-1 report.
        FileNotFoundError: the file vanished since the scan.
    """
    try:
        if isinstance(spool, SpoolDir):
            raw = _read(entry.name, MAX_REPORT_BYTES + 1, spool.fd)
        else:
            raw = _read(os.path.join(spool, entry.name), MAX_REPORT_BYTES + 1)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise ReportError(f"cannot read: {exc.strerror or exc}") from exc
    if len(raw) > MAX_REPORT_BYTES:
        raise ReportError(f"larger than {MAX_REPORT_BYTES} bytes")
    try:
        obj = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ReportError(f"not UTF-8: {exc.reason} at byte {exc.start}") from exc
    except json.JSONDecodeError as exc:
        raise ReportError(f"not valid JSON (truncated?): {exc.msg} at byte {exc.pos}") from exc
    return validate_report(obj, entry)


def _read(path: str, limit: int, dir_fd: int | None = None) -> bytes:
    """A regular file's bytes, never through a symlink (`util.fs.read_no_follow` without
    pathlib: this runs once per report, 20,000 times for a large job)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK,
                 dir_fd=dir_fd)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ReportError("not a regular file")
        return read_bounded(fd, limit)
    finally:
        os.close(fd)


def _num(value: Any, where: str, *, allow_none: bool = True) -> float | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ReportError(f"{where} must be a number, got {type(value).__name__}")
    out = float(value)
    if math.isinf(out):
        raise ReportError(f"{where} is infinite")
    return out


def _int(value: Any, where: str, *, lo: int = 0, hi: int = 2**31 - 1) -> int | None:
    if value is None:
        return None
    if isinstance(value, str) and value.isdigit() and len(value) < 12:
        value = int(value)  # a value passed through from the environment
    if isinstance(value, bool) or not isinstance(value, int):
        raise ReportError(f"{where} must be an integer or null, got {type(value).__name__}")
    if not lo <= value <= hi:
        raise ReportError(f"{where}={value} is out of range [{lo}, {hi}]")
    return value


def _text(value: Any, where: str, limit: int | None = None) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise ReportError(f"{where} must be a string, got {type(value).__name__}")
    if "\0" in value:
        raise ReportError(f"{where} contains a NUL byte")
    if limit is not None and len(value.encode()) > limit:
        raise ReportError(f"{where} is longer than {limit} bytes")
    return value


def _ident(value: Any, where: str, limit: int = _NAME_LIMIT) -> str:
    if value in _GOOD_NAMES:  # names repeat in every report: check each once
        return str(value)
    text = _text(value, where, limit)
    if not text or not text.isprintable():
        raise ReportError(f"{where} must be a non-empty printable name, got {value!r}")
    if limit == _NAME_LIMIT and len(_GOOD_NAMES) < 100_000:
        _GOOD_NAMES.add(text)
    return text


_GOOD_NAMES: set[str] = set()


def _status_code(obj: dict[str, Any], where: str) -> int | None:
    code = obj.get("status_code")
    if code is None and isinstance(obj.get("status"), str):
        code = _STATUS_CODES.get(obj["status"].upper())
        if code is None:
            raise ReportError(f"{where}.status {obj['status']!r} is not OK/WARNING/CRITICAL/UNKNOWN")
    return _int(code, f"{where}.status_code", lo=0, hi=3)


def _numbers(value: Any, where: str) -> tuple[dict[str, float | None], dict[str, Any]]:
    """Split a {name: value} mapping into numeric values and the rest (kept, not dropped)."""
    if value is None:
        return {}, {}
    if not isinstance(value, dict):
        raise ReportError(f"{where} must be an object")
    nums: dict[str, float | None] = {}
    other: dict[str, Any] = {}
    good = _GOOD_NAMES
    for k, v in value.items():
        if k not in good:
            _ident(k, f"{where} key")
        kind = type(v)
        if kind is float:
            if v == math.inf or v == -math.inf:
                raise ReportError(f"{where}.{k} is infinite")
            nums[k] = v
        elif kind is int or kind is bool:
            try:
                nums[k] = float(v)
            except OverflowError:
                raise ReportError(f"{where}.{k} is too large") from None
        elif v is None:
            nums[k] = None
        else:
            other[k] = v
    return nums, other


def validate_report(obj: Any, entry: SpoolEntry) -> dict[str, Any]:
    """Validate a decoded report against schema 1 and the file name it came from.

    Returns a normalized copy: `nodelist` a tuple of safe node names (shared between the
    reports of one job when given as a hostlist expression); `health.checks` with
    integer `status_code`s; numeric `metrics`/`telemetry` split from any non-numeric values
    (kept under `_nonnumeric`); every other unknown key kept as is.

    Raises:
        ReportError: with a one-line reason.
    """
    if not isinstance(obj, dict):
        raise ReportError("not a JSON object")
    if obj.get("schema") != SCHEMA or obj.get("kind") != "node_report":
        raise ReportError(f"not a schema-{SCHEMA} node_report (schema={obj.get('schema')!r}, "
                          f"kind={obj.get('kind')!r})")
    out: dict[str, Any] = dict(obj)
    job_id = obj.get("job_id")
    try:
        if not isinstance(job_id, int | str) or isinstance(job_id, bool) \
                or safe_job_id(job_id) != entry.job_id:
            raise UnsafeValueError("mismatch")
    except UnsafeValueError:
        raise ReportError(f"job_id {job_id!r} does not match the file name") from None
    out["job_id"] = entry.job_id
    if obj.get("node") != entry.node:
        raise ReportError(f"node {obj.get('node')!r} does not match the file name")
    if obj.get("phase") != entry.phase:
        raise ReportError(f"phase {obj.get('phase')!r} does not match the file name")
    try:
        restart = safe_restart(obj.get("restart"))
    except UnsafeValueError as exc:
        raise ReportError(str(exc)) from None
    if restart != entry.restart:
        raise ReportError(f"restart {restart} does not match the file name "
                          f"(restart {entry.restart})")
    out["restart"] = restart
    t = _num(obj.get("time"), "time", allow_none=False)
    if t is None or math.isnan(t):
        raise ReportError("time is missing or NaN")
    out["time"] = t
    out["user"] = _text(obj.get("user"), "user", 64)
    out["partition"] = _text(obj.get("partition"), "partition", 64)
    out["num_nodes"] = _int(obj.get("num_nodes"), "num_nodes", lo=0)
    out["nodelist"] = _nodelist(obj.get("nodelist"))
    for key in ("exit_code", "exit_signal", "derived_exit_code"):
        out[key] = _int(obj.get(key), key, lo=0)
    drained = obj.get("drained")
    if drained is not None and not isinstance(drained, bool):
        raise ReportError("drained must be true, false or null")
    out["drained"] = bool(drained)
    out["drain_reason"] = _text(obj.get("drain_reason"), "drain_reason")
    nonnumeric: dict[str, Any] = {}
    out["telemetry"], other = _numbers(obj.get("telemetry"), "telemetry")
    if other:
        nonnumeric["telemetry"] = other
    out["health"] = _health(obj.get("health"), nonnumeric)
    if nonnumeric:
        out["_nonnumeric"] = nonnumeric
    return out


def _nodelist(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):  # a hostlist expression, as in SLURM_JOB_NODELIST
        return _expand_nodelist(value)
    if not isinstance(value, list):
        raise ReportError("nodelist must be a list of node names or a hostlist expression")
    for n in value:
        if n not in _GOOD_NODES:
            if not isinstance(n, str):
                raise ReportError(f"nodelist entry {n!r} is not a string")
            try:
                _GOOD_NODES.add(safe_node_name(n))
            except UnsafeValueError as exc:
                raise ReportError(f"nodelist: {exc}") from exc
    return tuple(value)


# Every report of a job carries the same nodelist: expand and check it once, share the tuple.
_GOOD_NODES: set[str] = set()


@functools.lru_cache(maxsize=64)
def _expand_nodelist(value: str) -> tuple[str, ...]:
    import hostlist

    try:
        names = hostlist.expand_hostlist(value)
    except hostlist.BadHostlist as exc:
        raise ReportError(f"nodelist is not a hostlist: {exc}") from exc
    try:
        return tuple(safe_node_name(n) for n in names)
    except UnsafeValueError as exc:
        raise ReportError(f"nodelist: {exc}") from exc


def _health(value: Any, nonnumeric: dict[str, Any]) -> dict[str, Any] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ReportError("health must be an object or null")
    out = dict(value)
    out["status_code"] = _status_code(value, "health")
    out["tier"] = _text(value.get("tier"), "health.tier", _TIER_LIMIT)
    out["duration_s"] = _num(value.get("duration_s"), "health.duration_s")
    checks = value.get("checks") or []
    if not isinstance(checks, list):
        raise ReportError("health.checks must be a list")
    norm = []
    for i, check in enumerate(checks):
        where = f"health.checks[{i}]"
        if not isinstance(check, dict):
            raise ReportError(f"{where} must be an object")
        c = dict(check)
        c["name"] = _ident(check.get("name"), f"{where}.name")
        c["status_code"] = _status_code(check, where)
        c["summary"] = _text(check.get("summary"), f"{where}.summary")
        c["duration_s"] = _num(check.get("duration_s"), f"{where}.duration_s")
        c["metrics"], other = _numbers(check.get("metrics"), f"{where}.metrics")
        if other:
            nonnumeric.setdefault("checks", {})[str(i)] = other
        norm.append(c)
    out["checks"] = norm
    return out
