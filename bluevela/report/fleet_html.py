"""The fleet report as one self-contained HTML page (`bv report fleet --html FILE`).

Five matplotlib figures, inlined as SVG (text kept as text, so node names and numbers can be
searched and read by a screen reader), and a few short tables. Every chart is a distribution
over the whole fleet (causes, interruptions per day, MTBF per node, return-to-service times,
goodput), never one chart per node, so the page stays the same size at 10 or 10,000 nodes:
the only tables that grow are capped (the worst `top` nodes, the nodes out of service now).
No script, no external resource.

Built on `bluevela.report.page` (stylesheet, escaping, formatting, writer, matplotlib);
matplotlib is imported when the first chart is drawn (pip extra `report`).
"""

from __future__ import annotations

import logging
from collections import Counter, defaultdict
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bluevela.report import page
from bluevela.report.goodput import inputs_text
from bluevela.report.page import ReportError, esc, fmt_num

__all__ = ["ReportError", "render_html", "write_html"]

logger = logging.getLogger(__name__)

SOURCE_COLORS = {"prolog": "#d62728", "epilog": "#ff7f0e", "job": "#9467bd",
                 "nightly": "#1f77b4", "ledger": "#8c564b"}
OUTCOME_COLORS = {"completed": "#2ca02c", "signalled": "#98df8a", "failed": "#ff9896",
                  "lost_node": "#d62728", "unknown": "#c7c7c7", "lost_ledger": "#8c564b"}
OUTCOME_LABELS = {"completed": "completed", "signalled": "ended by a signal",
                  "failed": "failed (exit code)", "lost_node": "lost to a node failure",
                  "unknown": "no exit status",
                  "lost_ledger": "lost (goodput ledger: not productive)"}
# The ledger's phases, in report/goodput.py's order, and their colours on the page.
PHASE_COLORS = {"productive": "#2ca02c", "redone": "#d62728", "checkpoint": "#1f77b4",
                "detection": "#ff7f0e", "teardown_relaunch": "#9467bd", "startup": "#bcbd22",
                "queue_hold": "#7f7f7f", "unattributed": "#c7c7c7", "idle_spare": "#17becf"}
PHASE_LABELS = {"productive": "productive", "redone": "re-done work",
                "checkpoint": "checkpoint saving", "detection": "detection",
                "teardown_relaunch": "teardown + relaunch", "startup": "start-up",
                "queue_hold": "queue wait + requeue hold", "unattributed": "unattributed",
                "idle_spare": "idle spare"}
MAX_LEDGER_JOBS = 30  # rows of the per-job ledger table (the worst ETTR first)
MAX_OUT_LISTED = 50
TIME_CAUSES = 6  # causes drawn separately over time; the rest are "other"


def _num(value: float | None, digits: int = 1) -> str:
    return fmt_num(value, digits)


def _svg(fig: Any, label: str) -> str:
    return page.svg(fig, label, tight=True)


def _ints() -> Any:
    """Whole-number ticks for an axis of counts."""
    from matplotlib.ticker import MaxNLocator

    return MaxNLocator(integer=True)


def _causes_chart(rep: dict[str, Any]) -> str:
    rows = rep["interruptions"]["by_cause"]
    per: dict[str, Counter[str]] = defaultdict(Counter)
    for r in rows:
        per[r["cause"]][r["source"]] += r["count"]
    causes = sorted(per, key=lambda c: (-sum(per[c].values()), c))[:15]
    fig = page.figure(720, 96 * (0.35 * max(3, len(causes)) + 0.8))
    ax = fig.subplots()
    left = [0] * len(causes)
    for source, color in SOURCE_COLORS.items():
        vals = [per[c][source] for c in causes]
        if any(vals):
            ax.barh(causes, vals, left=left, color=color, label=source)
            left = [a + b for a, b in zip(left, vals, strict=True)]
    for y, total in enumerate(left):
        ax.text(total, y, f" {total}", va="center")
    ax.invert_yaxis()
    ax.xaxis.set_major_locator(_ints())
    ax.set_xlabel("interruptions")
    ax.legend(title="found by", loc="upper left", bbox_to_anchor=(1.02, 1.0), frameon=False)
    ax.set_title("Interruptions by cause")
    return _svg(fig, "interruptions by cause")


def _days(rep: dict[str, Any]) -> list[str]:
    w = rep["window"]
    day = datetime.fromtimestamp(w["since_unix_s"], tz=UTC).date()
    last = datetime.fromtimestamp(w["now_unix_s"], tz=UTC).date()
    out = []
    while day <= last:
        out.append(day.isoformat())
        day = day.fromordinal(day.toordinal() + 1)
    return out


def _time_chart(rep: dict[str, Any]) -> str:
    days = _days(rep)
    total: Counter[str] = Counter()
    for r in rep["interruptions"]["by_day"]:
        total[r["cause"]] += r["count"]
    shown = [c for c, _ in sorted(total.items(), key=lambda kv: (-kv[1], kv[0]))[:TIME_CAUSES]]
    series: dict[str, list[int]] = {c: [0] * len(days) for c in [*shown, "other"]}
    at = {d: i for i, d in enumerate(days)}
    for r in rep["interruptions"]["by_day"]:
        if r["day"] in at:
            series[r["cause"] if r["cause"] in shown else "other"][at[r["day"]]] += r["count"]
    if not any(series["other"]):
        del series["other"]
    fig = page.figure(720, 249)
    ax = fig.subplots()
    bottom = [0] * len(days)
    x = list(range(len(days)))
    cmap = page.mpl().colormaps["tab10"]
    for k, (cause, vals) in enumerate(series.items()):
        ax.bar(x, vals, bottom=bottom, width=0.85, color=cmap(k % 10), label=cause)
        bottom = [a + b for a, b in zip(bottom, vals, strict=True)]
    step = max(1, len(days) // 10)
    ax.set_xticks(x[::step], [d[5:] for d in days[::step]])
    ax.set_ylabel("interruptions per day")
    ax.yaxis.set_major_locator(_ints())
    if series:
        ax.legend(frameon=False, fontsize=10, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.set_title("Interruptions over time (UTC days)")
    return _svg(fig, "interruptions per day by cause")


def _mtbf_chart(rep: dict[str, Any]) -> str:
    vals = [n["mtbf_h"] for n in rep["nodes"] if n["mtbf_h"] is not None]
    fig = page.figure(720, 249)
    ax = fig.subplots()
    window = rep["window"]["hours"]
    if vals:
        ax.hist(vals, bins=min(40, max(5, len(vals) // 3)), range=(0, max(window, max(vals))),
                color="#1f77b4")
    cmap = page.mpl().colormaps["tab10"]
    lines = 0
    for k, c in enumerate(rep["mtbf"]["by_class"]):
        # a class MTBF beyond the window (few failures over many nodes) is in the table only
        if c["mtbf_h"] is not None and c["mtbf_h"] <= window * 1.05:
            ax.axvline(c["mtbf_h"], color=cmap((k + 3) % 10), linestyle="--",
                       label=f"class {c['class']}: {_num(c['mtbf_h'])} h")
            lines += 1
    if lines:
        ax.legend(frameon=False, fontsize=10)
    ax.yaxis.set_major_locator(_ints())
    ax.set_xlabel("MTBF per node (hours in service / incidents)")
    ax.set_ylabel("nodes")
    ax.set_title(f"MTBF of the {len(vals)} nodes that failed "
                 f"({rep['mtbf']['nodes_without_failure']} had no failure in "
                 f"{_num(window, 0)} h)")
    return _svg(fig, "MTBF per node histogram")


def _rts_chart(rep: dict[str, Any]) -> str:
    rts = rep["return_to_service"]
    vals = rts["hours"]
    fig = page.figure(720, 249)
    ax = fig.subplots()
    if vals:
        ax.hist(vals, bins=min(30, max(5, len(vals) // 2)), color="#9467bd")
        for q, name in ((rts["median_h"], "median"), (rts["p90_h"], "p90")):
            if q is not None:
                ax.axvline(q, color="black", linestyle=":" if name == "p90" else "--",
                           label=f"{name} {_num(q)} h")
        ax.legend(frameon=False, fontsize=10)
    ax.yaxis.set_major_locator(_ints())
    ax.set_xlabel("hours from the failure to the node's next passing prolog")
    ax.set_ylabel("incidents")
    ax.set_title(f"Time to return to service ({rts['returned']} returned, "
                 f"{rts['still_out']} still out)")
    return _svg(fig, "time to return to service histogram")


def _goodput_chart(rep: dict[str, Any]) -> str:
    g = rep["goodput"]
    hours = g["gpu_hours"] if g["basis"] == "gpu_hours" else g["node_hours"]
    unit = "GPU hours" if g["basis"] == "gpu_hours" else "node hours"
    total = sum(hours.values()) or 1.0
    fig = page.figure(720, 144)
    ax = fig.subplots()
    left = 0.0
    for kind, color in OUTCOME_COLORS.items():
        v = hours.get(kind, 0.0)
        if v <= 0:
            continue
        ax.barh([0], [v], left=left, color=color,
                label=f"{OUTCOME_LABELS[kind]}: {_num(v, 0)} ({100 * v / total:.1f} %)")
        left += v
    ax.set_yticks([])
    from matplotlib.ticker import FuncFormatter

    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:,.0f}"))
    ax.set_xlabel(unit)
    ax.legend(ncol=2, frameon=False, fontsize=10, loc="upper center",
              bbox_to_anchor=(0.5, -0.55))
    ax.set_title(f"Goodput: {unit} of the jobs that ended in the window, by how they ended")
    return _svg(fig, "goodput by job outcome")


def _ledger_chart(led: dict[str, Any]) -> str:
    """One bar per job size: where its hours went, by phase (shares of the size's hours)."""
    unit = "GPU hours" if led["basis"] == "gpu_hours" else "node hours"
    fig = page.figure(720, 220)
    ax = fig.subplots()
    total = sum(led["hours_by_phase"].values()) or 1.0
    left = 0.0
    for k, color in PHASE_COLORS.items():
        v = led["hours_by_phase"].get(k, 0.0)
        if v <= 0:
            continue
        ax.barh([0], [100 * v / total], left=left, color=color,
                label=f"{PHASE_LABELS[k]}: {_num(v, 2)} ({100 * v / total:.1f} %)")
        left += 100 * v / total
    ax.set_yticks([])
    ax.set_xlim(0, 100)
    ax.set_xlabel(f"% of the {unit} of the {led['jobs']} job(s) with a ledger")
    ax.legend(ncol=2, frameon=False, fontsize=9, loc="upper center",
              bbox_to_anchor=(0.5, -0.35))
    ax.set_title(f"Where the time went: ETTR {_num(led['ettr_pct'])} %")
    return _svg(fig, "hours by goodput phase")


def _ledger_section(rep: dict[str, Any]) -> list[str]:
    led = rep.get("ledger") or {}
    if not led.get("jobs"):
        return []
    worst = sorted(led["per_job"], key=lambda r: (r["ettr_pct"] or 0.0, r["job_id"]))
    unit = "GPU-h" if led["basis"] == "gpu_hours" else "node-h"
    causes = list(led["hours_lost_by_cause"].items())
    return [
        "<h2 id=\"ledger\">Where the time went (goodput ledger)</h2>",
        f"<p>{led['jobs']} job(s) with supervisor events: ETTR {_num(led['ettr_pct'])} % "
        "(productive / all their hours, the idle hot spares' included). Phases: "
        "docs/resilience.md.</p>",
        _ledger_chart(led),
        _table(["job size (nodes)", "jobs", "ETTR %"],
               [[b["nodes"], b["jobs"], _num(b["ettr_pct"])] for b in led["by_size"]]),
        _table(["cause", "hours lost"], [[c, _num(h, 3)] for c, h in causes]),
        _table(["job", "nodes", "ETTR %", "idle spare " + unit, "interruptions",
                "checkpoint cost s", "interval used s", "advice", "spares"],
               [[r["job_id"], r["nodes"], _num(r["ettr_pct"]),
                 f"{_num(r.get('idle_spare_h'), 3)} ({r.get('spares', 0)} spare(s))",
                 "; ".join(i["cause"] for i in r["interruptions"]) or "none",
                 _num(r["checkpoint_cost_s"], 2), _num(r["checkpoint_interval_s"], 0),
                 f"{r['advice'].get('verdict', '')} [{inputs_text(r['advice'])}]",
                 "" if r["spares_advice"] is None else r["spares_advice"]["best_spares"]]
                for r in worst[:MAX_LEDGER_JOBS]], "ledger"),
        *([f"<p>The {MAX_LEDGER_JOBS} jobs with the lowest ETTR of {len(worst)}; every job: "
           "<code>bv report fleet --json</code> (<code>ledger.per_job</code>).</p>"]
          if len(worst) > MAX_LEDGER_JOBS else []),
    ]


def _table(headers: Sequence[str], rows: Sequence[Sequence[object]], cls: str = "") -> str:
    head = "".join(f"<th>{esc(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{esc(c)}</td>" for c in r) + "</tr>" for r in rows)
    return f'<table class="{cls}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def render_html(rep: dict[str, Any], top: int = 20) -> str:
    """The page for a report dict from `bluevela.report.fleet.compute`.

    Raises:
        ReportError: matplotlib is not installed.
    """
    parts = [
        *_head(rep),
        *_worst_section(rep, top),
        *_interruptions_section(rep),
        *_mtbf_section(rep),
        *_rts_section(rep),
        *_goodput_section(rep),
        *_ledger_section(rep),
        '<p class="note">Definitions and sources: docs/report.md. Produced by '
        "<code>bv report fleet</code>.</p>",
    ]
    return page.document("Fleet reliability report", parts)


def _head(rep: dict[str, Any]) -> list[str]:
    """The title, the window and sources, the tiles and the nodes still out of service."""
    w, fl, rts, g = rep["window"], rep["fleet"], rep["return_to_service"], rep["goodput"]
    out_now = fl["out_now"]
    tiles = [
        ("fleet MTBF", f"{_num(fl['mtbf_h'])} h", ""),
        ("incidents", f"{fl['incidents']}", "bad" if fl["incidents"] else ""),
        ("nodes that failed", f"{fl['nodes_failed']} / {fl['nodes']}", ""),
        ("out of service now", f"{len(out_now)}", "bad" if out_now else ""),
        ("median return to service", f"{_num(rts['median_h'])} h", ""),
        ("goodput", f"{_num(g['goodput_pct'])} %", ""),
        ("lost to node failures", f"{_num(g['lost_to_nodes_pct'])} %",
         "bad" if g["lost_to_nodes_pct"] else ""),
    ]
    parts = [
        "<h1>Fleet reliability report</h1>",
        f"<p class=\"sub\">{esc(w['since_utc'])} to {esc(w['now_utc'])} "
        f"({_num(w['hours'], 0)} h): {rep['sources']['jobs']:,} jobs, "
        f"{rep['sources']['reports']:,} node reports, {len(rep['sources']['nights'])} "
        "nightly runs</p>",
        '<div class="tiles">' + "".join(
            f'<div class="tile {c}"><b>{esc(v)}</b>{esc(k)}</div>' for k, v, c in tiles) + "</div>",
    ]
    if out_now:
        shown = ", ".join(esc(n) for n in out_now[:MAX_OUT_LISTED])
        more = f" and {len(out_now) - MAX_OUT_LISTED} more" if len(out_now) > MAX_OUT_LISTED \
            else ""
        parts.append(f'<p class="bad" id="out-now"><b>still out of service:</b> '
                     f"{shown}{esc(more)}</p>")
    return parts


def _worst_section(rep: dict[str, Any], top: int) -> list[str]:
    worst = rep["worst_nodes"][:top]
    return [
        f"<h2 id=\"worst\">Worst nodes (top {len(worst)} of {rep['fleet']['nodes_failed']} "
        "that failed)</h2>",
        _table(["node", "class", "incidents", "events", "MTBF h", "out of service h",
                "causes", "last failure (UTC)", "now"],
               [[n["node"], n["class"], n["incidents"], n["events"], _num(n["mtbf_h"]),
                 _num(n["out_of_service_h"]),
                 ", ".join(f"{c} x{k}" for c, k in n["causes"].items()),
                 n["last_failure_utc"] or "", "still out" if n["out_now"] else ""]
                for n in worst], "worst"),
    ]


def _interruptions_section(rep: dict[str, Any]) -> list[str]:
    return [
        "<h2 id=\"causes\">Interruptions</h2>",
        f"<p>{rep['interruptions']['total']} interruptions; requeued jobs: "
        f"{rep['requeues']['jobs_requeued']} (at least {rep['requeues']['requeues_min']} "
        "requeues).</p>",
        _causes_chart(rep),
        _time_chart(rep),
    ]


def _mtbf_section(rep: dict[str, Any]) -> list[str]:
    return [
        "<h2 id=\"mtbf\">Mean time between failures</h2>",
        _table(["class", "nodes", "nodes that failed", "incidents", "in service h",
                "MTBF h"],
               [[c["class"], c["nodes"], c["nodes_failed"], c["incidents"],
                 _num(c["in_service_h"], 0), _num(c["mtbf_h"])]
                for c in rep["mtbf"]["by_class"]]),
        _mtbf_chart(rep),
    ]


def _rts_section(rep: dict[str, Any]) -> list[str]:
    rts = rep["return_to_service"]
    return [
        "<h2 id=\"rts\">Return to service</h2>",
        f"<p>median {_num(rts['median_h'])} h, p90 {_num(rts['p90_h'])} h, "
        f"max {_num(rts['max_h'])} h; {rts['still_out']} still out. Measured to the node's "
        "next passing prolog report (the archive records no resume): an upper bound.</p>",
        _rts_chart(rep),
    ]


def _goodput_section(rep: dict[str, Any]) -> list[str]:
    g = rep["goodput"]
    return [
        "<h2 id=\"goodput\">Goodput</h2>",
        f"<p>{_num(g['goodput_pct'])} % of {_num(g['gpu_hours_total'], 0)} GPU hours "
        f"({_num(g['node_hours_total'], 0)} node hours) ran to completion; up to "
        f"{_num(g['goodput_upper_pct'])} % counting jobs ended by a signal (cancel, time "
        "limit, or a requeue after a checkpoint: the archive cannot tell them apart); "
        f"{_num(g['lost_to_nodes_pct'])} % was lost to node failures (the whole job: the "
        "archive does not record checkpoint times).</p>",
        _goodput_chart(rep),
    ]


def write_html(rep: dict[str, Any], path: Path, top: int = 20) -> Path:
    """Render `rep` to `path` (`page.write_page`: atomic, follows no symlink).

    Raises:
        ReportError: matplotlib missing, or the file cannot be written.
    """
    return page.write_page(path, render_html(rep, top))
