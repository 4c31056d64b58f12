"""`bv report`: fleet-wide reports from the run archive and the nightly store.

A thin layer over `bluevela.report.fleet` (numbers) and `bluevela.report.fleet_html` (the page);
h5py, numpy and matplotlib are imported only inside those, when a subcommand runs.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import click

from bluevela.cli import State
from bluevela.cli.output import emit_json, table

logger = logging.getLogger(__name__)


@click.group()
def command() -> None:
    """Fleet-wide reports (reliability) from the run archive and the nightly store."""


def _when(value: str, what: str) -> float:
    from bluevela.archive.query import parse_since
    from bluevela.errors import ArchiveError

    ts = parse_since(value) if value.strip() else None
    if ts is None:
        raise ArchiveError(f"{what} {value!r}: expected a date (2025-01-31), a date and time "
                           "(2025-01-31T08:00), a unix time, or an age (24h, 7d)")
    return ts


@command.command("fleet")
@click.option("--since", "since", default="30d", show_default=True, metavar="DATE",
              help="Start of the window: an age (30d, 2w, 12h), a date, or a unix time.")
@click.option("--now", "until", default=None, metavar="DATE",
              help="End of the window (default: now); same forms as --since.")
@click.option("--archive-dir", type=click.Path(path_type=Path), default=None,
              help="Archive directory (default: $BV_ARCHIVE_DIR, else site.yaml paths.archive).")
@click.option("--html", "html_path", type=click.Path(path_type=Path, dir_okay=False),
              default=None, metavar="FILE", help="Also write the self-contained HTML page.")
@click.option("--top", type=click.IntRange(min=1, max=1000), default=20, show_default=True,
              help="Rows of the worst-nodes table.")
@click.option("--json", "as_json", is_flag=True, help="Print the whole report as JSON.")
@click.pass_obj
def fleet_cmd(obj: State, since: str, until: str | None, archive_dir: Path | None,
              html_path: Path | None, top: int, as_json: bool) -> None:
    """Interruptions by cause, MTBF per node and class, the worst nodes, time to return to
    service, and goodput over a window (docs/report.md defines every figure)."""
    import time

    from bluevela.report.fleet import fleet_report

    start = _when(since, "--since")
    end = time.time() if until is None else _when(until, "--now")
    site = obj.site_or_none()
    if archive_dir is None:
        env = os.environ.get("BV_ARCHIVE_DIR")
        # no site file at all: obj.site() says so in one line
        archive_dir = Path(env) if env else (site or obj.site()).path("archive")
    rep = fleet_report(archive_dir, since=start, now=end, site=site, top=top)
    if html_path is not None:
        from bluevela.report.fleet_html import write_html

        write_html(rep, html_path, top)
    if as_json:
        emit_json(rep)
        return
    _print_text(rep, top)
    if html_path is not None:
        click.echo(f"report: {html_path}")


def _n(value: Any, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _print_text(rep: dict[str, Any], top: int) -> None:
    w, fl, g, rts = rep["window"], rep["fleet"], rep["goodput"], rep["return_to_service"]
    click.echo(f"fleet {w['since_utc']} .. {w['now_utc']} ({_n(w['hours'], 0)} h): "
               f"{rep['sources']['jobs']} jobs, {rep['sources']['reports']} reports, "
               f"{len(rep['sources']['nights'])} nightly runs")
    click.echo(f"nodes {fl['nodes']}, failed {fl['nodes_failed']}, incidents "
               f"{fl['incidents']}, fleet MTBF {_n(fl['mtbf_h'])} h, out of service now "
               f"{len(fl['out_now'])}")
    click.echo(f"return to service: median {_n(rts['median_h'])} h, p90 {_n(rts['p90_h'])} h, "
               f"still out {rts['still_out']}")
    click.echo(f"goodput {_n(g['goodput_pct'])} % of {_n(g['gpu_hours_total'], 0)} GPU h "
               f"(up to {_n(g['goodput_upper_pct'])} % with signalled jobs), lost to node "
               f"failures {_n(g['lost_to_nodes_pct'])} %")
    table("Interruptions by cause", ["cause", "found by", "count"],
          [[c["cause"], c["source"], c["count"]] for c in rep["interruptions"]["by_cause"]])
    table("MTBF by class", ["class", "nodes", "failed", "incidents", "MTBF h"],
          [[c["class"], c["nodes"], c["nodes_failed"], c["incidents"], _n(c["mtbf_h"])]
           for c in rep["mtbf"]["by_class"]])
    table(f"Worst nodes (top {top})",
          ["node", "class", "incidents", "MTBF h", "out h", "causes", "now"],
          [[n["node"], n["class"], n["incidents"], _n(n["mtbf_h"]), _n(n["out_of_service_h"]),
            ", ".join(f"{c} x{k}" for c, k in n["causes"].items()),
            "still out" if n["out_now"] else ""] for n in rep["worst_nodes"]])
