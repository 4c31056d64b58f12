"""The on-disk schema of an archive segment file (schema version 1): its tables and dtypes.

Every segment is one immutable HDF5 file holding whole tables: compound datasets written in
one batch (never a group or dataset per report). `docs/archive.md` documents each dataset,
column, dtype and unit for plain h5py / h5dump users; keep the two in step.

numpy and h5py are imported inside the functions that need them: `bv --help` imports this
module's constants only through the CLI, never the heavy libraries.
"""

from __future__ import annotations

import logging
from functools import cache
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

logger = logging.getLogger(__name__)

FORMAT = "bluevela-archive"
SCHEMA_VERSION = 1

# Widths of identifier columns: fixed-length, NUL-terminated UTF-8 strings, one byte wider
# than the longest value the spool's validation lets through (64 bytes; 32 for a tier), so
# nothing is ever cut.
NODE_LEN = 65
NAME_LEN = 65
TIER_LEN = 33
USER_LEN = 65
PARTITION_LEN = 65

PHASE_CODES: dict[str, int] = {"prolog": 0, "epilog": 1}
PHASE_NAMES: dict[int, str] = {v: k for k, v in PHASE_CODES.items()}
# Nagios values, as in bluevela's health Status; -1 = the report carried no health result.
STATUS_CODES: dict[str, int] = {"NONE": -1, "OK": 0, "WARNING": 1, "CRITICAL": 2, "UNKNOWN": 3}
STATUS_NAMES: dict[int, str] = {v: k for k, v in STATUS_CODES.items()}
COMPLETION_CODES: dict[str, int] = {"all_reported": 0, "timeout": 1}
COMPLETION_NAMES: dict[int, str] = {v: k for k, v in COMPLETION_CODES.items()}
MISSING_INT = -1  # exit codes and signals a report did not carry
MAX_RESTART = 65535  # /reports.restart and /jobs.restarts are uint16 (SLURM_JOB_RESTART_COUNT)

# Dataset paths inside a segment file.
TABLES: tuple[str, ...] = ("jobs", "job_nodes", "reports", "checks", "check_metrics", "telemetry")
NODE_INDEX = "index/nodes"
JOB_REPORTS_INDEX = "index/job_reports"
JOB_IDS_INDEX = "index/job_ids"

DESCRIPTIONS: dict[str, str] = {
    "jobs": "one row per archived job, sorted by job_id; newest revision wins across files",
    "job_nodes": "one row per (job, node): expected by the job's nodelist, and which reports came",
    "reports": "one row per node report, sorted by (node, job_id, restart, phase)",
    "checks": "one row per health check of a report, in report order; report_row -> /reports",
    "check_metrics": "one row per numeric metric of a check, in check order; unit in the name; "
                     "check_row -> /checks, report_row -> /reports",
    "telemetry": "one row per telemetry value of a report (per-job deltas), in report order; "
                 "unit in the name; report_row -> /reports",
    NODE_INDEX: "per node, its contiguous row range in reports, checks, check_metrics, telemetry",
    JOB_REPORTS_INDEX: "rows of /reports ordered by (job_id, node, restart, phase); "
                       "see jobs.report_first",
    JOB_IDS_INDEX: "/jobs.job_id on its own (sorted), to find a job without reading /jobs",
}


@cache
def dtypes() -> dict[str, np.dtype[Any]]:
    """The numpy dtypes of every table, keyed by dataset path."""
    import h5py
    import numpy as np

    phase = h5py.enum_dtype(PHASE_CODES, basetype=np.uint8)
    status = h5py.enum_dtype(STATUS_CODES, basetype=np.int8)
    completion = h5py.enum_dtype(COMPLETION_CODES, basetype=np.uint8)
    text = h5py.string_dtype("utf-8")
    node = f"S{NODE_LEN}"
    name = f"S{NAME_LEN}"
    return {
        "jobs": np.dtype([
            ("job_id", "u8"), ("revision", "u4"), ("completion", completion),
            ("user", f"S{USER_LEN}"), ("partition", f"S{PARTITION_LEN}"),
            ("num_nodes", "u4"), ("nodes_expected", "u4"), ("nodes_prolog", "u4"),
            ("nodes_epilog", "u4"), ("nodes_missing", "u4"),
            ("first_report_unix_s", "f8"), ("last_report_unix_s", "f8"),
            ("start_unix_s", "f8"), ("end_unix_s", "f8"), ("archived_unix_s", "f8"),
            ("exit_code", "i4"), ("exit_signal", "i4"), ("derived_exit_code", "i4"),
            ("health_worst", status), ("restarts", "u2"),
            ("node_first", "u8"), ("node_count", "u4"),
            ("report_first", "u8"), ("report_count", "u4"),
        ]),
        "job_nodes": np.dtype([
            ("job_id", "u8"), ("node", node), ("expected", "u1"),
            ("has_prolog", "u1"), ("has_epilog", "u1"),
        ]),
        "reports": np.dtype([
            ("job_id", "u8"), ("node", node), ("phase", phase), ("restart", "u2"),
            ("time_unix_s", "f8"), ("health_status", status), ("health_tier", f"S{TIER_LEN}"),
            ("health_duration_s", "f8"),
            ("exit_code", "i4"), ("exit_signal", "i4"), ("derived_exit_code", "i4"),
            ("drained", "u1"), ("drain_reason", text), ("extra_json", text),
            ("check_first", "u8"), ("check_count", "u4"),
            ("telemetry_first", "u8"), ("telemetry_count", "u4"),
        ]),
        "checks": np.dtype([
            ("report_row", "u4"), ("ordinal", "u2"), ("name", name), ("status", status),
            ("duration_s", "f8"), ("summary", text),
            ("metric_first", "u8"), ("metric_count", "u4"),
        ]),
        "check_metrics": np.dtype([
            ("report_row", "u4"), ("check_row", "u4"), ("check_ordinal", "u2"),
            ("ordinal", "u2"), ("name", name), ("value", "f8"),
        ]),
        "telemetry": np.dtype([
            ("report_row", "u4"), ("ordinal", "u2"), ("name", name), ("value", "f8"),
        ]),
        NODE_INDEX: np.dtype([
            ("node", node),
            ("report_first", "u8"), ("report_count", "u4"),
            ("check_first", "u8"), ("check_count", "u4"),
            ("metric_first", "u8"), ("metric_count", "u4"),
            ("telemetry_first", "u8"), ("telemetry_count", "u4"),
        ]),
        JOB_REPORTS_INDEX: np.dtype("u8"),
        JOB_IDS_INDEX: np.dtype("u8"),
    }


UNITS: dict[str, str] = {
    "time_unix_s": "s since 1970-01-01 UTC (float)",
    "first_report_unix_s": "s since 1970-01-01 UTC",
    "last_report_unix_s": "s since 1970-01-01 UTC",
    "start_unix_s": "s since 1970-01-01 UTC (NaN: unknown)",
    "end_unix_s": "s since 1970-01-01 UTC (NaN: unknown)",
    "archived_unix_s": "s since 1970-01-01 UTC",
    "health_duration_s": "s (NaN: unknown)",
    "duration_s": "s (NaN: unknown)",
    "value": "the unit is the suffix of `name` (_j, _c, _s, _bytes, _count, ...)",
    "exit_code": "process exit status, -1: not reported",
    "exit_signal": "signal number, -1: not reported",
    "derived_exit_code": "highest exit status of any step, -1: not reported",
    "restart": "attempt number, SLURM_JOB_RESTART_COUNT (0: first run; files without the "
               "column: 0)",
    "restarts": "highest attempt number archived (0: never requeued)",
}

# Columns added after the first files were written: a file without them is still schema 1
# and reads with the column 0 (HDF5 converts by member name and leaves a missing member as
# the zero-filled buffer holds it: `segment_read.read_rows`; checked by
# `segment_read.schema_problems`).
ADDED_COLUMNS: dict[str, tuple[str, ...]] = {"reports": ("restart",), "jobs": ("restarts",)}


def legacy_dtype(path: str) -> np.dtype[Any] | None:
    """The dtype `path` had before ADDED_COLUMNS (None: the table never changed)."""
    import numpy as np

    added = ADDED_COLUMNS.get(path)
    if not added:
        return None
    dt = dtypes()[path]
    fields: Any = dt.fields or {}
    return np.dtype([(n, fields[n][0]) for n in dt.names or () if n not in added])
