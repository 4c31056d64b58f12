"""A job's goodput advice measured against the fleet's history: `advise`
(report/goodput_advice.py, pure) fed with the MTBF of the job's node class over the last
30 days of the fleet report (report/fleet.py). It sits above both, so that the pure advice
imports nothing of the fleet report.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from bluevela.errors import BluevelaError
from bluevela.report.fleet import fleet_report
from bluevela.report.fleet_facts import UNKNOWN_CLASS, classes_of
from bluevela.report.goodput import Ledger
from bluevela.report.goodput_advice import advise

ADVICE_WINDOW_S = 30 * 86400.0  # the fleet history the advice's MTBF is measured over


def fleet_advice(archive_dir: Path, ledger: Ledger, job: dict[str, Any],
                 now: float | None = None) -> dict[str, Any]:
    """`advise` with the MTBF of the job's node class over the last 30 days of the fleet
    report (bluevela/report/fleet.py); no advice (said so) when that cannot be read."""
    now = time.time() if now is None else now
    try:
        from bluevela.site import load_site

        site = load_site()
    except Exception:  # noqa: BLE001 - without a site every node is in no class
        site = None
    try:
        rep = fleet_report(archive_dir, since=now - ADVICE_WINDOW_S, now=now, site=site)
    except BluevelaError as exc:
        return {"verdict": f"no advice: the fleet's history could not be read ({exc})"}
    first = (job.get("nodes") or [{}])[0].get("node")
    cls = next((name for name, info in classes_of(site).items() if first in info.nodes),
               UNKNOWN_CLASS)
    row = next((r for r in rep["mtbf"]["by_class"] if r["class"] == cls), None)
    out = advise(ledger, row["mtbf_h"] if row else None, int(row["incidents"]) if row else 0)
    out["node_class"] = cls
    out["history_days"] = ADVICE_WINDOW_S / 86400.0
    return out


__all__ = ["ADVICE_WINDOW_S", "fleet_advice"]
