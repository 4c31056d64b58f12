"""Reports <-> columnar tables: building rows from reports, sorting and indexing a segment,
and turning rows back into report dicts.

A `Tables` holds the six tables of schema 1 (see `schema.dtypes()`) in any order, plus for
every child row the position of the report (or job row) it belongs to. `finalize` sorts them,
drops duplicate report keys (the first one wins) and older job revisions, and computes the
row pointers and indexes that a segment file stores. All of it is vectorized numpy: a segment
of a million reports is sorted and indexed in seconds.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from bluevela.archive import schema as S

if TYPE_CHECKING:
    import numpy as np

logger = logging.getLogger(__name__)

# Report keys with a column of their own; everything else goes to `extra_json`.
_TOP_KEYS = frozenset({
    "schema", "kind", "job_id", "node", "phase", "restart", "time", "user", "partition",
    "num_nodes", "nodelist", "exit_code", "exit_signal", "derived_exit_code", "health", "telemetry",
    "drained", "drain_reason", "_nonnumeric",
})
_HEALTH_KEYS = frozenset({"status", "status_code", "tier", "duration_s", "checks"})
_CHECK_KEYS = frozenset({"name", "status", "status_code", "summary", "metrics", "duration_s"})
_NODE_SHIFT = 40  # report key: (node index << 40 | job_id, restart << 1 | phase)
_MAX_JOB_ID = (1 << 40) - 1


@dataclass
class Tables:
    """The six tables plus, per child row, the index of its owner row in this object."""

    jobs: np.ndarray
    job_nodes: np.ndarray
    reports: np.ndarray
    checks: np.ndarray
    check_metrics: np.ndarray
    telemetry: np.ndarray
    job_nodes_src: np.ndarray  # -> jobs
    checks_src: np.ndarray  # -> reports
    metrics_src: np.ndarray  # -> reports
    telemetry_src: np.ndarray  # -> reports

    @classmethod
    def empty(cls) -> Tables:
        import numpy as np

        dt = S.dtypes()
        e = np.zeros(0, dtype=np.int64)
        jobs, job_nodes, reports, checks, metrics, telemetry = (np.zeros(0, dt[n])
                                                                for n in S.TABLES)
        return cls(jobs, job_nodes, reports, checks, metrics, telemetry, e, e, e, e)

    def __len__(self) -> int:
        return len(self.reports)


def _f(value: float | None) -> float:
    return math.nan if value is None else float(value)


def _i(value: int | None) -> int:
    return S.MISSING_INT if value is None else int(value)


def _enc(text: str | None) -> bytes:
    return (text or "").encode()


def _residual(report: dict[str, Any]) -> str:
    """JSON of what has no column: unknown keys (top level, in health, in each check)."""
    health = report.get("health")
    checks = (health.get("checks") or []) if health is not None else []
    if (not report.keys() - _TOP_KEYS and not report.get("_nonnumeric")
            and (health is None or not health.keys() - _HEALTH_KEYS)
            and not any(c.keys() - _CHECK_KEYS for c in checks)):
        return ""  # the common case, checked at C speed
    extra = {k: v for k, v in report.items() if k not in _TOP_KEYS}
    if report.get("_nonnumeric"):
        extra["_nonnumeric"] = report["_nonnumeric"]
    if health is not None:
        h = {k: v for k, v in health.items() if k not in _HEALTH_KEYS}
        if h:
            extra["_health"] = h
        per_check = {str(i): {k: v for k, v in c.items() if k not in _CHECK_KEYS}
                     for i, c in enumerate(checks)}
        per_check = {k: v for k, v in per_check.items() if v}
        if per_check:
            extra["_checks"] = per_check
    return json.dumps(extra, sort_keys=True, default=str) if extra else ""


def _extend_named_values(cols: dict[str, list[Any]], src: int, named: dict[str, Any],
                         enc: dict[str, bytes]) -> None:
    """Append a report's `{name: value}` (check metrics or telemetry) as rows: source index,
    ordinal, encoded name (each name encoded once per batch), value (None -> NaN)."""
    n = len(named)
    cols["src"].extend([src] * n)
    cols["ordinal"].extend(range(n))
    cols["name"].extend(enc.get(k) or enc.setdefault(k, k.encode()) for k in named)
    values = list(named.values())
    cols["value"].extend(values if None not in values else
                         [math.nan if v is None else v for v in values])


def from_reports(reports: Sequence[dict[str, Any]]) -> Tables:
    """Build report, check, metric and telemetry rows from validated reports (no job rows)."""
    import numpy as np

    dt = S.dtypes()
    nan = math.nan
    enc: dict[str, bytes] = {}  # names repeat in every report: encode each once
    rep_rows: list[tuple[Any, ...]] = []
    chk: dict[str, list[Any]] = {k: [] for k in ("src", "ordinal", "name", "status",
                                                 "duration_s", "summary")}
    met: dict[str, list[Any]] = {k: [] for k in ("src", "check_ordinal", "ordinal", "name",
                                                 "value")}
    tel: dict[str, list[Any]] = {k: [] for k in ("src", "ordinal", "name", "value")}
    for idx, r in enumerate(reports):
        job_id = int(r["job_id"])
        if job_id > _MAX_JOB_ID:
            raise ValueError(f"job id {job_id} too large for the archive key")
        health = r.get("health")
        checks: list[dict[str, Any]]
        if health is None:
            status, tier, hdur, checks = -1, b"", nan, []
        else:
            code = health.get("status_code")
            status = -1 if code is None else int(code)
            tier, hdur = _enc(health.get("tier")), _f(health.get("duration_s"))
            checks = health.get("checks") or []
        rep_rows.append((
            job_id, r["node"].encode(), S.PHASE_CODES[r["phase"]], int(r.get("restart") or 0),
            float(r["time"]), status,
            tier, hdur, _i(r.get("exit_code")), _i(r.get("exit_signal")),
            _i(r.get("derived_exit_code")), 1 if r.get("drained") else 0,
            r.get("drain_reason") or "", _residual(r), 0, 0, 0, 0,
        ))
        for ci, c in enumerate(checks):
            name = enc.get(c["name"]) or enc.setdefault(c["name"], c["name"].encode())
            code = c.get("status_code")
            chk["src"].append(idx)
            chk["ordinal"].append(ci)
            chk["name"].append(name)
            chk["status"].append(-1 if code is None else code)
            chk["duration_s"].append(_f(c.get("duration_s")))
            chk["summary"].append(c.get("summary") or "")
            metrics = c.get("metrics") or {}
            met["check_ordinal"].extend([ci] * len(metrics))
            _extend_named_values(met, idx, metrics, enc)
        _extend_named_values(tel, idx, r.get("telemetry") or {}, enc)
    t = Tables.empty()
    t.reports = np.array(rep_rows, dtype=dt["reports"])
    for attr, cols, dtype in (("checks", chk, dt["checks"]),
                              ("check_metrics", met, dt["check_metrics"]),
                              ("telemetry", tel, dt["telemetry"])):
        src = np.array(cols.pop("src"), dtype=np.int64)
        arr = np.zeros(len(src), dtype=dtype)
        for col, values in cols.items():
            arr[col] = values if col != "summary" else np.array(values, dtype=object)
        setattr(t, attr, arr)
        setattr(t, {"checks": "checks_src", "check_metrics": "metrics_src",
                    "telemetry": "telemetry_src"}[attr], src)
    return t


def concat(parts: Iterable[Tables]) -> Tables:
    """Concatenate tables, shifting the owner indexes. Earlier parts win duplicate keys."""
    import numpy as np

    parts = list(parts)
    if not parts:
        return Tables.empty()
    rep_off = np.cumsum([0] + [len(p.reports) for p in parts[:-1]])
    job_off = np.cumsum([0] + [len(p.jobs) for p in parts[:-1]])

    def cat(name: str) -> np.ndarray:
        return np.concatenate([getattr(p, name) for p in parts])

    def shifted(name: str, offs: np.ndarray) -> np.ndarray:
        return np.concatenate([getattr(p, name) + o for p, o in zip(parts, offs, strict=True)])

    return Tables(
        jobs=cat("jobs"), job_nodes=cat("job_nodes"), reports=cat("reports"),
        checks=cat("checks"), check_metrics=cat("check_metrics"), telemetry=cat("telemetry"),
        job_nodes_src=shifted("job_nodes_src", job_off),
        checks_src=shifted("checks_src", rep_off),
        metrics_src=shifted("metrics_src", rep_off),
        telemetry_src=shifted("telemetry_src", rep_off),
    )


def _rkeys(arr: np.ndarray, nodes: np.ndarray) -> np.ndarray:
    """Each report's key (node, job_id, restart, phase) as its dense rank among the distinct
    keys (int64): equal keys share a rank, and ranks sort as the keys do."""
    import numpy as np

    if not len(arr):
        return np.zeros(0, dtype=np.int64)
    idx = np.searchsorted(nodes, arr["node"]).astype(np.uint64)
    hi = (idx << np.uint64(_NODE_SHIFT)) | arr["job_id"].astype(np.uint64)
    lo = (arr["restart"].astype(np.uint64) << np.uint64(1)) | arr["phase"].astype(np.uint64)
    order = np.lexsort((lo, hi))
    hs, ls = hi[order], lo[order]
    new = np.ones(len(order), dtype=np.int64)
    new[1:] = (hs[1:] != hs[:-1]) | (ls[1:] != ls[:-1])
    rank = np.empty(len(order), dtype=np.int64)
    rank[order] = np.cumsum(new) - 1
    return rank


def _ranges(sorted_keys: np.ndarray, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    import numpy as np

    lo = np.searchsorted(sorted_keys, keys, side="left")
    hi = np.searchsorted(sorted_keys, keys, side="right")
    return lo.astype(np.uint64), (hi - lo).astype(np.uint32)


@dataclass
class _Kept:
    """Which reports a segment keeps: sorted by key (stable), the first of each key. A child
    row (check, metric, telemetry) shares its owner's key."""

    rk_all: np.ndarray  # every report's key, in `t`'s order
    src: np.ndarray  # the kept reports' rows of `t`, in key order
    keep: np.ndarray  # per row of `t`: kept
    position: np.ndarray  # per row of `t`: its row in the segment (kept ones)

    @classmethod
    def of(cls, t: Tables, nodes: np.ndarray) -> _Kept:
        import numpy as np

        rk_all = _rkeys(t.reports, nodes)
        order = np.argsort(rk_all, kind="stable")
        rk_sorted = rk_all[order]
        first = np.ones(len(order), dtype=bool)
        first[1:] = rk_sorted[1:] != rk_sorted[:-1]
        kept_src = order[first]
        if (~first).any():
            logger.warning("dropped %d duplicate report(s) while writing a segment",
                           int((~first).sum()))
        keep = np.zeros(len(t.reports), dtype=bool)
        keep[kept_src] = True
        position = np.zeros(len(t.reports), dtype=np.uint32)
        position[kept_src] = np.arange(len(kept_src), dtype=np.uint32)
        return cls(rk_all, kept_src, keep, position)

    def children(self, arr: np.ndarray, src: np.ndarray, sort_cols: tuple[str, ...]
                 ) -> tuple[np.ndarray, np.ndarray]:
        """The kept owners' children in sorted-owner order, and their owners' sorted keys."""
        import numpy as np

        if len(src) and bool(np.all(src[1:] >= src[:-1])):
            # Each owner's children are one block already in order (what from_reports and
            # from_segment produce): gather the kept owners' blocks in sorted-owner order.
            counts = np.bincount(src, minlength=len(self.keep))
            starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
            c = counts[self.src]
            block = np.repeat(starts[self.src] - np.concatenate(([0], np.cumsum(c)[:-1])), c)
            idx = block + np.arange(int(c.sum()))
        else:
            idx = np.flatnonzero(self.keep[src])
            idx = idx[np.lexsort(tuple(arr[c][idx] for c in reversed(sort_cols))
                                 + (self.rk_all[src[idx]],))]
        out = arr[idx]
        out["report_row"] = self.position[src[idx]]
        return out, self.rk_all[src[idx]]


def finalize(t: Tables) -> dict[str, np.ndarray]:
    """Sort, deduplicate and index the tables into the datasets of one segment file.

    Reports: sorted by (node, job_id, restart, phase); of reports with the same key the first (lowest
    position in `t`) is kept, with its own checks, metrics and telemetry. Jobs: one row per
    job_id, the highest `revision` (later position on a tie), with its own job_nodes rows.
    """
    import numpy as np

    nodes = np.unique(t.reports["node"])
    if len(nodes) >= 1 << (64 - _NODE_SHIFT):
        raise ValueError("too many distinct nodes for one segment")

    kept = _Kept.of(t, nodes)
    reports, rk = t.reports[kept.src].copy(), kept.rk_all[kept.src]

    checks, chk_rk = kept.children(t.checks, t.checks_src, ("ordinal",))
    metrics, met_rk = kept.children(t.check_metrics, t.metrics_src, ("check_ordinal", "ordinal"))
    telemetry, tel_rk = kept.children(t.telemetry, t.telemetry_src, ("ordinal",))
    reports["check_first"], reports["check_count"] = _ranges(chk_rk, rk)
    reports["telemetry_first"], reports["telemetry_count"] = _ranges(tel_rk, rk)
    if len(metrics):
        check_row = reports["check_first"][metrics["report_row"]].astype(np.int64) \
            + metrics["check_ordinal"]
        metrics["check_row"] = check_row
        checks["metric_first"], checks["metric_count"] = _ranges(check_row, np.arange(len(checks)))
    else:
        checks["metric_first"], checks["metric_count"] = 0, 0

    index = _node_index(reports, checks, metrics, telemetry)
    jobs, job_nodes, by_job = _newest_jobs(t, reports)
    return {
        "jobs": jobs, "job_nodes": job_nodes, "reports": reports, "checks": checks,
        "check_metrics": metrics, "telemetry": telemetry,
        S.NODE_INDEX: index, S.JOB_REPORTS_INDEX: by_job,
        S.JOB_IDS_INDEX: jobs["job_id"].copy(),
    }


def _node_index(reports: np.ndarray, checks: np.ndarray, metrics: np.ndarray,
                telemetry: np.ndarray) -> np.ndarray:
    """The node index: each node's rows in every table. Each table is sorted by node first
    (children follow their reports), so a node's rows are contiguous."""
    import numpy as np

    used = np.unique(reports["node"])
    index = np.zeros(len(used), dtype=S.dtypes()[S.NODE_INDEX])
    index["node"] = used
    index["report_first"], index["report_count"] = _ranges(reports["node"], used)
    rep_end = (index["report_first"] + index["report_count"]).astype(np.int64)
    for arr, col in ((checks, "check"), (metrics, "metric"), (telemetry, "telemetry")):
        # A node's reports are rows [first, end): its children are those whose report_row is.
        lo = np.searchsorted(arr["report_row"], index["report_first"].astype(np.int64))
        hi = np.searchsorted(arr["report_row"], rep_end)
        index[f"{col}_first"], index[f"{col}_count"] = lo, hi - lo
    return index


def _newest_jobs(t: Tables, reports: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Jobs: the newest revision of each (later position on a tie) with its own job_nodes
    rows, each pointing at its nodes and (through the returned job-reports index, /reports
    rows in job order) at its reports."""
    import numpy as np

    jobs_in = t.jobs
    jorder = np.lexsort((np.arange(len(jobs_in)), jobs_in["revision"], jobs_in["job_id"]))
    last = np.ones(len(jorder), dtype=bool)
    if len(jorder):
        last[:-1] = jobs_in["job_id"][jorder][1:] != jobs_in["job_id"][jorder][:-1]
    job_src = jorder[last]
    jobs = jobs_in[job_src].copy()
    keep_job = np.zeros(len(jobs_in), dtype=bool)
    keep_job[job_src] = True
    job_nodes = t.job_nodes[keep_job[t.job_nodes_src]] if len(t.job_nodes) else t.job_nodes
    job_nodes = job_nodes[np.lexsort((job_nodes["node"], job_nodes["job_id"]))]
    jobs["node_first"], jobs["node_count"] = _ranges(job_nodes["job_id"], jobs["job_id"])
    by_job = np.lexsort((reports["phase"], reports["restart"], reports["node"],
                         reports["job_id"])).astype(np.uint64)
    jobs["report_first"], jobs["report_count"] = _ranges(
        reports["job_id"][by_job], jobs["job_id"])
    return jobs, job_nodes, by_job


def from_segment(data: dict[str, np.ndarray]) -> Tables:
    """Tables from the datasets of one segment file (owner indexes from its row pointers)."""
    import numpy as np

    rep = data["reports"]
    n = np.arange(len(rep), dtype=np.int64)
    checks_src = np.repeat(n, rep["check_count"].astype(np.int64))
    tel_src = np.repeat(n, rep["telemetry_count"].astype(np.int64))
    metrics_src = np.repeat(checks_src, data["checks"]["metric_count"].astype(np.int64))
    jobs = data["jobs"]
    jn_src = np.repeat(np.arange(len(jobs), dtype=np.int64), jobs["node_count"].astype(np.int64))
    return Tables(
        jobs=jobs, job_nodes=data["job_nodes"], reports=rep, checks=data["checks"],
        check_metrics=data["check_metrics"], telemetry=data["telemetry"],
        job_nodes_src=jn_src, checks_src=checks_src, metrics_src=metrics_src,
        telemetry_src=tel_src,
    )


# ---------------------------------------------------------------------------- rows -> dicts


def text(value: bytes | str) -> str:
    """A fixed-width (NUL-padded bytes) or variable-length column value as str."""
    if isinstance(value, bytes):
        return value.rstrip(b"\0").decode("utf-8", "replace")
    return str(value)


def num(value: Any) -> float | None:
    """A float column as a JSON-able value (NaN becomes None)."""
    v = float(value)
    return None if math.isnan(v) else v


def opt_int(value: Any) -> int | None:
    v = int(value)
    return None if v == S.MISSING_INT else v


def status_name(code: Any) -> str | None:
    c = int(code)
    return None if c < 0 else S.STATUS_NAMES.get(c, str(c))


def rows(arr: np.ndarray) -> list[dict[str, Any]]:
    """A structured array as a list of plain dicts (much faster to read than numpy rows)."""
    names = arr.dtype.names or ()
    return [dict(zip(names, t, strict=True)) for t in arr.tolist()]


_NAMES: dict[bytes, str] = {}


def _names(values: list[bytes]) -> list[str]:
    """Decode fixed-width names, each distinct one once (names repeat in every report)."""
    cache = _NAMES
    if len(cache) > 200_000:
        cache.clear()
    out = []
    for v in values:
        s = cache.get(v)
        if s is None:
            s = cache[v] = v.rstrip(b"\0").decode("utf-8", "replace")
        out.append(s)
    return out


def _vtext(value: bytes | str | None) -> str:
    if value is None:
        return ""
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


class _CheckColumns:
    """/checks and /check_metrics rows as Python lists (converted once: most of a query's
    cost), turned back into each report's checks."""

    def __init__(self, checks: np.ndarray, metrics: np.ndarray, metric_base: int) -> None:
        self.name = _names(checks["name"].tolist())
        self.status, self.dur = checks["status"].tolist(), checks["duration_s"].tolist()
        self.summary, self.ordinal = checks["summary"].tolist(), checks["ordinal"].tolist()
        self.mf, self.mc = checks["metric_first"].tolist(), checks["metric_count"].tolist()
        self.m_name, self.m_val = _names(metrics["name"].tolist()), metrics["value"].tolist()
        self.metric_base = metric_base

    def checks(self, first: int, count: int, nonnumeric: dict[str, Any],
               extra: dict[str, Any]) -> list[dict[str, Any]]:
        """Rows `first` .. `first + count` as check dicts, each with its metrics, its
        non-numeric metrics and its extra fields (both by ordinal)."""
        nan_none = (lambda v: None if v != v else v)  # noqa: E731 - NaN -> None
        out = []
        for j in range(first, first + count):
            o = self.ordinal[j]
            mf = self.mf[j] - self.metric_base
            ms: dict[str, Any] = {self.m_name[k]: nan_none(self.m_val[k])
                                  for k in range(mf, mf + self.mc[j])}
            ms.update(nonnumeric.get(str(o), {}))
            code = self.status[j]
            out.append({
                "name": self.name[j],
                "status": S.STATUS_NAMES.get(code) if code >= 0 else None,
                "status_code": code if code >= 0 else None,
                "summary": _vtext(self.summary[j]) or None, "duration_s": nan_none(self.dur[j]),
                "metrics": ms, **extra.get(str(o), {}),
            })
        return out


def build_reports(reps: np.ndarray, checks: np.ndarray, metrics: np.ndarray,
                  telemetry: np.ndarray, *, check_base: int = 0, metric_base: int = 0,
                  telemetry_base: int = 0, jobs: dict[int, dict[str, Any]] | None = None
                  ) -> list[dict[str, Any]]:
    """Rebuild reports as the nodes wrote them, from /reports rows and their children.

    `checks`, `metrics`, `telemetry` hold (at least) the children of `reps`, starting at the
    absolute row numbers `*_base` of their files. Job-level fields (user, partition,
    num_nodes, nodelist) come from `jobs` by job id when given. Columns are turned into Python
    lists once; that, not HDF5, is most of the cost of a query.
    """
    nan_none = (lambda v: None if v != v else v)  # noqa: E731 - NaN -> None
    r = {k: reps[k].tolist() for k in reps.dtype.names or ()}
    nodes, tiers = _names(r["node"]), _names(r["health_tier"])
    cols = _CheckColumns(checks, metrics, metric_base)
    t_name, t_val = _names(telemetry["name"].tolist()), telemetry["value"].tolist()
    status_names = S.STATUS_NAMES
    out = []
    for i in range(len(reps)):
        extra_text = _vtext(r["extra_json"][i])
        extra: dict[str, Any] = json.loads(extra_text) if extra_text else {}
        nonnumeric = extra.pop("_nonnumeric", {})
        health_extra = extra.pop("_health", {})
        checks_extra = extra.pop("_checks", {})
        job_id = r["job_id"][i]
        rep: dict[str, Any] = {
            "job_id": job_id, "node": nodes[i], "phase": S.PHASE_NAMES[r["phase"][i]],
            "restart": r["restart"][i], "time": r["time_unix_s"][i],
            "exit_code": None if r["exit_code"][i] == S.MISSING_INT else r["exit_code"][i],
            "exit_signal": None if r["exit_signal"][i] == S.MISSING_INT else r["exit_signal"][i],
            "derived_exit_code": None if r["derived_exit_code"][i] == S.MISSING_INT
            else r["derived_exit_code"][i],
            "drained": bool(r["drained"][i]),
            "drain_reason": _vtext(r["drain_reason"][i]) or None,
        }
        if jobs is not None:
            job = jobs.get(job_id) or {}
            for k in ("user", "partition", "num_nodes", "nodelist"):
                rep[k] = job.get(k)
        tf = r["telemetry_first"][i] - telemetry_base
        telem: dict[str, Any] = {t_name[k]: nan_none(t_val[k])
                                 for k in range(tf, tf + r["telemetry_count"][i])}
        telem.update(nonnumeric.get("telemetry", {}))
        rep["telemetry"] = telem
        status = r["health_status"][i]
        cf, cc = r["check_first"][i] - check_base, r["check_count"][i]
        if status < 0 and not cc and not tiers[i] and not health_extra:
            rep["health"] = None
        else:
            clist = cols.checks(cf, cc, nonnumeric.get("checks", {}), checks_extra)
            rep["health"] = {
                "status": status_names.get(status) if status >= 0 else None,
                "status_code": status if status >= 0 else None,
                "tier": tiers[i] or None, "duration_s": nan_none(r["health_duration_s"][i]),
                "checks": clist, **health_extra,
            }
        rep.update(extra)
        out.append(rep)
    return out


def job_dict(row: dict[str, Any], job_nodes: list[dict[str, Any]]) -> dict[str, Any]:
    """A /jobs row and its /job_nodes rows (see `rows`) as a plain dict."""
    expected = [text(n["node"]) for n in job_nodes if n["expected"]]
    missing = [text(n["node"]) for n in job_nodes if n["expected"] and not n["has_epilog"]]
    missing_prolog = [text(n["node"]) for n in job_nodes if n["expected"] and not n["has_prolog"]]
    return {
        "job_id": int(row["job_id"]),
        "revision": int(row["revision"]),
        "completion": S.COMPLETION_NAMES.get(int(row["completion"]), str(row["completion"])),
        "user": text(row["user"]) or None,
        "partition": text(row["partition"]) or None,
        "num_nodes": int(row["num_nodes"]),
        "nodelist": expected,
        "nodes_reported": [text(n["node"]) for n in job_nodes if n["has_prolog"] or n["has_epilog"]],
        "missing_nodes": missing,
        "missing_prolog_nodes": missing_prolog,
        "first_report_unix_s": num(row["first_report_unix_s"]),
        "last_report_unix_s": num(row["last_report_unix_s"]),
        "start_unix_s": num(row["start_unix_s"]),
        "end_unix_s": num(row["end_unix_s"]),
        "archived_unix_s": num(row["archived_unix_s"]),
        "exit_code": opt_int(row["exit_code"]),
        "exit_signal": opt_int(row["exit_signal"]),
        "derived_exit_code": opt_int(row["derived_exit_code"]),
        "health_worst": status_name(row["health_worst"]),
        "restarts": int(row["restarts"]) if "restarts" in row else 0,
    }
