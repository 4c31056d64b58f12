"""The epilog's part: cut the job's window out of the sampler's segments into the spool.

`<spool>/<job_id>.<node>.series.bvts` (`<job_id>.<node>.r<k>.series.bvts` for a requeued job's
restart k, archive/spool.py) holds the records of `<state>/samples/` from one interval
before the job's start (the prolog's reading; on a node grown into the job, the helper job's
epilog: health/state.py `take_over`) to now, over the union of the segments' columns
(`format.cut_window`). Written atomically (temporary file with O_EXCL|O_NOFOLLOW, fsync,
rename) relative to the spool directory opened without following a symlink, by the spool's
bounded writer (`archive.spool.write_spool_file`: a forked child, at most `SPOOL_WRITE_TIMEOUT_S`),
so a hung spool costs the epilog 10 s, never its `PrologEpilogTimeout`. Standard library only;
ingest turns the side files into `<archive>/series/<job_id>.h5` (archive/series_ingest.py).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bluevela.errors import BluevelaError

if TYPE_CHECKING:
    from bluevela.site import Site

logger = logging.getLogger(__name__)


def interval_s(site: Site) -> float:
    """The sampler's interval on this node (`BV_SAMPLER_INTERVAL_S`, else site.yaml)."""
    env = os.environ.get("BV_SAMPLER_INTERVAL_S")
    try:
        value = float(env) if env else site.telemetry.interval_s
    except ValueError:
        value = site.telemetry.interval_s
    return value if value > 0 else site.telemetry.interval_s


def write_side_file(spool: Path, samples: Path, job_id: int, node: str, start: float,
                    end: float, interval: float, restart: int = 0, *,
                    timeout_s: float | None = None) -> Path | None:
    """Cut [start - interval, end] out of `samples` into the spool; None when no sample.

    Args:
        timeout_s: None: write here. A number (the epilog: SPOOL_WRITE_TIMEOUT_S): write in a
            child and wait at most this long (`archive.spool.write_spool_file`).

    Raises:
        OSError, UnsafeValueError: the spool cannot be written or the names are unsafe.
        SpoolTimeoutError: no answer from the spool within `timeout_s` (an OSError).
    """
    from bluevela.archive.spool import series_name, write_spool_file
    from bluevela.telemetry.format import cut_window

    name = series_name(job_id, node, restart)
    # The samples are in the node's local state dir: only the spool can hang.
    cut = cut_window(samples, start - interval, end, node=node, job_id=job_id)
    if cut is None:
        return None
    header, data = cut
    return write_spool_file(spool, name, header.encode() + data, timeout_s=timeout_s)


def spool_series(site: Site, job_id: int, node: str, reading: Mapping[str, Any] | None,
                 now: float | None = None, *, restart: int = 0) -> str | None:
    """The epilog's step: spool the job's window of samples, bounded like the report's write
    (a hung spool: 10 s, one error line). Never raises (logged)."""
    from bluevela.archive.spool import SPOOL_WRITE_TIMEOUT_S

    now = time.time() if now is None else now
    start = reading.get("time") if reading else None
    if not isinstance(start, int | float) or isinstance(start, bool):
        logger.info("job %s: no prolog reading, so no start time: no time series", job_id)
        return None
    samples = site.path("state") / "samples"
    try:
        path = write_side_file(site.path("spool"), samples, job_id, node, float(start), now,
                               interval_s(site), restart, timeout_s=SPOOL_WRITE_TIMEOUT_S)
    except (OSError, BluevelaError, ValueError) as exc:
        logger.error("job %s: time series not spooled: %s", job_id, exc)
        return None
    if path is None:
        logger.info("job %s: no sampler data in %s for the job's window", job_id, samples)
        return None
    return str(path)
