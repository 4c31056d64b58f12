"""The archive's job index: a job's newest archived revision (its /jobs row, its job_nodes rows
and, when asked, the keys of its reports) looked up by job id across segments.

Read by ingest (what is archived already), the series side files (the jobs they belong to) and
the queries; apart from ingest so that the series modules, which ingest calls, need not import
it back.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from bluevela.archive import schema as S
from bluevela.archive.store import open_h5

if TYPE_CHECKING:
    import numpy as np

    from bluevela.archive.store import Writer


@dataclass
class Archived:
    """A job's newest archived revision: its row and its job_nodes rows; with `keys` asked
    for, the (node, phase, restart) of every report of the job in the archive and its time."""

    row: Any
    nodes: np.ndarray
    keys: dict[tuple[str, str, int], float] = field(default_factory=dict)

    @property
    def restarts(self) -> int:
        return row_restarts(self.row)


def row_restarts(row: Any) -> int:
    """A /jobs row's `restarts` (0 in a file written before the column existed)."""
    names = getattr(getattr(row, "dtype", None), "names", None)
    if names is not None:
        return int(row["restarts"]) if "restarts" in names else 0
    return int(row.get("restarts", 0) or 0)


def archived_jobs(w: Writer, job_ids: list[int], *, keys: bool = False
                  ) -> dict[int, Archived]:
    """The newest archived revision of each of `job_ids` that is in the archive."""
    return find_jobs([(s, w.archive.path_of(s)) for s in w.manifest.segments], job_ids,
                     keys=keys)


def find_jobs(segments: list[Any], job_ids: list[int], *, keys: bool = False
              ) -> dict[int, Archived]:
    """Look `job_ids` up in the segments' job index; newest revision wins. With `keys`, also
    collect each found job's report keys (node, phase, restart) from every segment (each
    revision's file holds only the reports that revision added)."""
    import numpy as np

    found: dict[int, Archived] = {}
    got_keys: dict[int, dict[tuple[str, str, int], float]] = defaultdict(dict)
    if not job_ids:
        return found
    ids = np.array(sorted(set(job_ids)), dtype=np.uint64)
    for info, path in segments:
        lo, hi = np.searchsorted(ids, [info.job_id_min, info.job_id_max + 1])
        if lo >= hi:
            continue
        want = ids[lo:hi]
        with open_h5(path) as f:
            index = f[S.JOB_IDS_INDEX][()]
            pos = np.searchsorted(index, want)
            pos = pos[pos < len(index)]
            pos = np.unique(pos[np.isin(index[pos], want)])
            if not len(pos):
                continue
            rows = f["jobs"][pos]
            jn = f["job_nodes"]
            if keys:
                _report_keys(f, rows, got_keys)
            for row in rows:
                jid = int(row["job_id"])
                cur = found.get(jid)
                if cur is not None and int(cur.row["revision"]) >= int(row["revision"]):
                    continue
                first, count = int(row["node_first"]), int(row["node_count"])
                found[jid] = Archived(row.copy(), jn[first:first + count])
    for jid, k in got_keys.items():
        if jid in found:
            found[jid].keys = k
    return found


def _report_keys(f: Any, jobs: Any, out: dict[int, dict[tuple[str, str, int], float]]) -> None:
    """Add the (node, phase, restart) of the reports of `jobs` (rows of f's /jobs) to `out`,
    each with its report's time."""
    import numpy as np

    idx = f[S.JOB_REPORTS_INDEX]
    ds = f["reports"]
    cols = ["job_id", "node", "phase", "time_unix_s"] + (
        ["restart"] if "restart" in ds.dtype.names else [])
    for row in jobs:
        first, count = int(row["report_first"]), int(row["report_count"])
        if not count:
            continue
        at = np.unique(idx[first:first + count])
        lo, hi = int(at[0]), int(at[-1]) + 1
        if hi - lo <= max(4 * len(at), 65536):  # one slice read beats a point selection
            rep = ds.fields(cols)[lo:hi][at - lo]
        else:
            rep = ds.fields(cols)[at]
        restarts = rep["restart"].tolist() if "restart" in cols else [0] * len(rep)
        keys = out[int(row["job_id"])]
        for node, phase, k, t in zip(rep["node"].tolist(), rep["phase"].tolist(), restarts,
                                     rep["time_unix_s"].tolist(), strict=True):
            keys[(node.rstrip(b"\0").decode(), S.PHASE_NAMES[int(phase)], int(k))] = float(t)
