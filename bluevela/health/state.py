"""The node's own state directory (`site.path("state")`): small JSON files, written atomically.

Layout:
    ib_counters.json      last IB counter reading (for "increase since the last run")
    gpu_counters.json     last NVLink error / NVML violation counter reading (checks/gpu_fabric.py)
    nccl_last_pass.json   time and busbw of the last PASSING nccl check (prolog freshness)
    nccl_attempts.json    the last nccl attempt and how many since the last pass (back-off)
    last_results.json     the last result of each check (the Prometheus file is rendered from it)
    last_run.json         the last hook run: phase, job, health report, drain
    jobs/<job_id>.json    the prolog's readings of a running job (the epilog's per-job deltas)
    handover.json         the last epilog's job, user, start and check metrics: where a
                          node grown into a running job (its prolog ran under the helper job
                          `bv-grow-JOB`) starts that job's window (`take_over`)

Every file name is fixed or built from a validated job id; nothing is followed through a
symlink; a file that cannot be read or parsed counts as absent.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from bluevela.errors import UnsafeValueError
from bluevela.util.fs import atomic_write, ensure_dir, read_no_follow, safe_job_id

logger = logging.getLogger(__name__)

IB_COUNTERS = "ib_counters.json"
NCCL_LAST_PASS = "nccl_last_pass.json"
NCCL_ATTEMPTS = "nccl_attempts.json"
# A node whose nccl keeps failing (or failing to run) is retried by the prolog after
# 15 min, 30 min, 1 h, 2 h, 4 h, then every 6 h: not on every job start.
NCCL_RETRY_BASE_S = 900.0
NCCL_RETRY_MAX_S = 6 * 3600.0
LAST_RESULTS = "last_results.json"
LAST_RUN = "last_run.json"
JOBS = "jobs"
JOB_READING_MAX_AGE_S = 30 * 86400.0
HANDOVER = "handover.json"


def read_json(path: Path) -> Any | None:
    """Parsed JSON at `path`, or None when missing, unreadable, a symlink or not JSON."""
    try:
        return json.loads(read_no_follow(path, limit=16 << 20))
    except FileNotFoundError:
        return None
    except (OSError, UnsafeValueError, ValueError) as exc:
        logger.warning("ignoring %s: %s", path, exc)
        return None


def write_json(path: Path, data: Any) -> bool:
    """Write `data` as JSON atomically (creating the directory); False (logged) on failure."""
    try:
        ensure_dir(path.parent, 0o755)
        atomic_write(path, json.dumps(data, sort_keys=True, default=str).encode(), 0o644)
    except (OSError, UnsafeValueError) as exc:
        logger.warning("cannot write %s: %s", path, exc)
        return False
    return True


def writable_dir(path: Path | None, *, create: bool = True) -> Path | None:
    """`path` when it is a writable directory of ours (created if `create`), else None."""
    if path is None:
        return None
    try:
        if create:
            ensure_dir(path, 0o755)
        elif not path.is_dir() or path.is_symlink():
            return None
    except (OSError, UnsafeValueError):
        return None
    return path if os.access(path, os.W_OK | os.X_OK) else None


# -- nccl freshness -------------------------------------------------------------------------


def nccl_last_pass(state_dir: Path) -> dict[str, Any] | None:
    data = read_json(state_dir / NCCL_LAST_PASS)
    return data if isinstance(data, dict) and isinstance(data.get("time"), int | float) else None


def nccl_attempts(state_dir: Path) -> dict[str, Any] | None:
    """{"time": last attempt, "failures": attempts since the last pass} or None."""
    data = read_json(state_dir / NCCL_ATTEMPTS)
    if (isinstance(data, dict) and isinstance(data.get("time"), int | float)
            and isinstance(data.get("failures"), int)):
        return data
    return None


def nccl_retry_delay_s(failures: int) -> float:
    """How long the prolog waits after the `failures`-th attempt without a pass."""
    if failures <= 0:
        return 0.0
    return min(NCCL_RETRY_MAX_S, NCCL_RETRY_BASE_S * 2.0 ** min(failures - 1, 30))


def nccl_is_stale(state_dir: Path | None, freshness_h: float, now: float | None = None) -> bool:
    """True when the prolog should run nccl: its last pass is older than `freshness_h` (or
    there is none), and it is not backing off after attempts that did not pass.

    `freshness_h` 0 means "never from the prolog": never stale.
    """
    if freshness_h <= 0:
        return False
    if state_dir is None:
        return True
    now = time.time() if now is None else now
    last = nccl_last_pass(state_dir)
    if last is not None and now - float(last["time"]) <= freshness_h * 3600.0:
        return False
    tried = nccl_attempts(state_dir)
    if tried is not None:
        since = float(tried["time"])
        fails = int(tried["failures"])
        if (last is None or since >= float(last["time"])) and now - since < nccl_retry_delay_s(fails):
            logger.info("nccl backing off: %d attempt(s) without a pass, the last %.0f s ago",
                        fails, now - since)
            return False
    return True


def record_nccl_attempt(state_dir: Path, now: float | None = None) -> int:
    """Count one nccl attempt (made before it runs: a run killed at its timeout counts too);
    return the attempts since the last pass, this one included."""
    prev = nccl_attempts(state_dir)
    failures = (int(prev["failures"]) if prev else 0) + 1
    write_json(state_dir / NCCL_ATTEMPTS,
               {"time": time.time() if now is None else now, "failures": failures})
    return failures


def record_nccl_pass(state_dir: Path, metrics: Mapping[str, float], now: float | None = None) -> None:
    t = time.time() if now is None else now
    write_json(state_dir / NCCL_LAST_PASS, {"time": t, **metrics})
    write_json(state_dir / NCCL_ATTEMPTS, {"time": t, "failures": 0})


# -- per-job readings -----------------------------------------------------------------------


def job_reading_path(state_dir: Path, job_id: int | str) -> Path:
    return state_dir / JOBS / f"{safe_job_id(job_id)}.json"


def save_job_reading(state_dir: Path, job_id: int, reading: dict[str, Any]) -> None:
    """Keep the prolog's readings of `job_id`; also drop readings of jobs long gone."""
    write_json(job_reading_path(state_dir, job_id), reading)
    _prune_jobs(state_dir / JOBS)


def pop_job_reading(state_dir: Path, job_id: int) -> dict[str, Any] | None:
    """The prolog's readings of `job_id`, removed from the state dir."""
    path = job_reading_path(state_dir, job_id)
    data = read_json(path)
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    except OSError as exc:
        logger.warning("cannot remove %s: %s", path, exc)
    return data if isinstance(data, dict) else None


def _prune_jobs(directory: Path, max_age_s: float = JOB_READING_MAX_AGE_S) -> None:
    """Readings whose epilog never ran (node crash) would pile up: remove old ones."""
    cutoff = time.time() - max_age_s
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return
    for entry in entries:
        try:
            if entry.is_file(follow_symlinks=False) and entry.stat(follow_symlinks=False).st_mtime < cutoff:
                os.unlink(entry.path)
        except OSError:
            continue


# -- a node handed from one job to the next (a grown node) ----------------------------------


def hand_over(state_dir: Path, job_id: int, user: str, started: float,
              metrics: Mapping[str, Any]) -> None:
    """Every epilog leaves its job, user, start and the metrics of its checks in
    `handover.json`: the next epilog of a job with no reading of its own here takes its window
    (and its telemetry's baseline) from it (`take_over`). One slot, overwritten by each epilog."""
    write_json(state_dir / HANDOVER, {"job": job_id, "user": user, "time": started,
                                      "metrics": dict(metrics)})


def take_over(state_dir: Path, job_id: int, user: str, now: float | None = None
              ) -> dict[str, Any] | None:
    """The start of `job_id` on a node where its prolog left no reading, or None.

    A node grown into a running job (bluevela/launch/grow.py) ran its prolog under the helper job
    (`bv-grow-JOB`), whose epilog ran when Slurm gave the node to the job: that epilog's start
    is when the node joined, and its checks' metrics the baseline of the job's telemetry. It is taken (and removed, once) only when the last epilog here was
    of the same user and of a job submitted later than this one (a helper exists only while its
    job runs; a wrapped job id counts as unrelated: no window). The record is the hooks' own
    (root's state directory): nothing a user writes, neither the job's name nor its goodput
    events, decides it. The reading has no "restart": the epilog asks Slurm which attempt ended
    (hooks/phases.py `_grown_attempt`: after a requeue, SLURM_JOB_RESTART_COUNT is already the
    next attempt's).
    """
    data = read_json(state_dir / HANDOVER)
    if not isinstance(data, dict):
        return None
    helper, start = data.get("job"), data.get("time")
    now = time.time() if now is None else now
    if not (user and data.get("user") == user
            and isinstance(helper, int) and not isinstance(helper, bool) and helper > job_id
            and isinstance(start, int | float) and not isinstance(start, bool)
            and 0 < start <= now):
        return None
    try:
        (state_dir / HANDOVER).unlink()
    except OSError as exc:  # not removed: not taken (it could be taken twice)
        logger.warning("cannot remove %s: %s", state_dir / HANDOVER, exc)
        return None
    metrics = data.get("metrics")
    return {"time": float(start), "metrics": metrics if isinstance(metrics, dict) else {},
            "grown_via_job": helper}
