"""The spool: node reports written atomically by prolog/epilog hooks, read by ingest.

A report is one JSON file `<spool>/<job_id>.<node>.<phase>.json`, built only from a validated
job id, node name and phase (never from a value the job's owner controls), written through a
temporary file with O_EXCL|O_NOFOLLOW, fsynced, renamed, and the directory fsynced.

Report format (schema 1), one JSON object:
    schema: 1, kind: "node_report", phase: "prolog" | "epilog",
    job_id: int, node: str, user: str, partition: str, num_nodes: int, nodelist: [str],
    time: float (unix s, when written),
    exit_code: int | null, exit_signal: int | null, derived_exit_code: int | null  (epilog),
    health: {status, status_code, tier, duration_s, checks: [{name, status, status_code,
             summary, metrics: {<name>_<unit>: number}, duration_s}]},
    telemetry: {<name>_<unit>: number}  (per-job deltas in the epilog),
    drained: bool, drain_reason: str | null
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Literal

from bluevela.errors import UnsafeValueError
from bluevela.util.fs import atomic_write, ensure_dir, safe_job_id, safe_node_name

logger = logging.getLogger(__name__)

SCHEMA = 1
Phase = Literal["prolog", "epilog"]
PHASES: tuple[str, ...] = ("prolog", "epilog")


def report_name(job_id: int | str, node: str, phase: str) -> str:
    """The spool file name for a report; raises UnsafeValueError on anything odd."""
    if phase not in PHASES:
        raise UnsafeValueError(f"unknown report phase {phase!r}")
    return f"{safe_job_id(job_id)}.{safe_node_name(node)}.{phase}.json"


def write_report(spool: Path, report: dict[str, Any]) -> Path:
    """Write one node report into the spool atomically; return its path.

    Raises:
        UnsafeValueError: job id, node or phase not safe for a file name.
        OSError: the write failed (ENOSPC...); nothing half-written is left behind.
    """
    name = report_name(report["job_id"], report["node"], report["phase"])
    ensure_dir(spool, 0o755)
    body = {"schema": SCHEMA, "kind": "node_report", **report}
    data = json.dumps(body, sort_keys=True, default=str).encode()
    path = spool / name
    atomic_write(path, data, 0o644)
    logger.debug("spooled %s (%d bytes)", path, len(data))
    return path
