"""`bv archive`: ingest spooled node reports into the HDF5 run archive, query and export it.

A thin layer over `bluevela.archive.ingest` and `bluevela.archive.query`; h5py and numpy are
imported only inside those, when a subcommand runs.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import click

from bluevela.cli import State
from bluevela.cli.output import emit_json, table
from bluevela.util.term import printable

logger = logging.getLogger(__name__)

_META = "bv.archive.dirs"


def _dirs(ctx: click.Context) -> dict[str, Path | None]:
    return ctx.meta.setdefault(_META, {"archive": None, "spool": None})


def _path(ctx: click.Context, which: str) -> Path:
    """The archive or spool directory: --archive-dir/--spool-dir, BV_<WHICH>_DIR, site.yaml.

    The environment override is read here without loading site.yaml (pydantic costs ~0.2 s),
    which keeps `bv archive node` fast; `site.path()` gives the same answer.
    """
    given = _dirs(ctx)[which]
    if given is not None:
        return given
    env = os.environ.get(f"BV_{which.upper()}_DIR")
    if env:
        return Path(env)
    state = ctx.find_object(State)
    assert state is not None
    return state.site().path(which)  # type: ignore[arg-type]


def _emit_records(records: Any, out: Any = None) -> None:
    """A JSON array with one compact record per line: json's C encoder (an indented dump uses
    the pure-Python one, several times slower on a year of history)."""
    import json

    write = (out or sys.stdout).write
    write("[")
    sep = "\n"
    for rec in records:
        write(sep + json.dumps(rec, sort_keys=True, default=str))
        sep = ",\n"
    write("\n]\n")


def _since(value: str | None) -> float | None:
    from bluevela.archive.query import parse_since

    return parse_since(value)


def _node(value: str | None) -> str | None:
    from bluevela.util.fs import safe_node_name

    return None if value is None else safe_node_name(value)


@click.group()
@click.option("--archive-dir", type=click.Path(path_type=Path), default=None,
              help="Archive directory (default: $BV_ARCHIVE_DIR, else site.yaml paths.archive).")
@click.option("--spool-dir", type=click.Path(path_type=Path), default=None,
              help="Spool directory (default: $BV_SPOOL_DIR, else site.yaml paths.spool).")
@click.pass_context
def command(ctx: click.Context, archive_dir: Path | None, spool_dir: Path | None) -> None:
    """The HDF5 run archive: ingest node reports, list jobs, show a job or a node's history.

    Layout, dtypes and units: docs/archive.md.
    """
    _dirs(ctx).update(archive=archive_dir, spool=spool_dir)


@command.command("ingest")
@click.option("--watch", is_flag=True, help="Keep ingesting every --interval seconds.")
@click.option("--interval", type=click.FloatRange(min=0.1), default=30.0, show_default=True,
              help="Seconds between rounds with --watch.")
@click.option("--job", "job_id", type=click.IntRange(min=1), default=None,
              help="Only this job's reports (as EpilogSlurmctld does).")
@click.option("--wait", "wait_s", type=click.FloatRange(min=0), default=0.0, show_default=True,
              help="With --job: first wait up to this many seconds for every node's epilog.")
@click.option("--timeout-min", type=click.FloatRange(min=0), default=10.0, show_default=True,
              help="Archive a job with missing nodes this long after its first epilog report.")
@click.option("--lock-wait", type=click.FloatRange(min=0), default=30.0, show_default=True,
              help="Seconds to wait for another ingest to finish.")
@click.option("--delete", is_flag=True,
              help="Delete ingested spool files instead of moving them to <spool>/done/.")
@click.option("--compact/--no-compact", default=None,
              help="Merge crowded segment levels afterwards (default: yes, but not with --job).")
@click.option("--json", "as_json", is_flag=True, help="Print what was done as JSON.")
@click.option("-q", "--quiet", is_flag=True, help="Print nothing when all went well.")
@click.pass_context
def ingest_cmd(ctx: click.Context, watch: bool, interval: float, job_id: int | None,
               wait_s: float, timeout_min: float, lock_wait: float, delete: bool,
               compact: bool | None, as_json: bool, quiet: bool) -> None:
    """Merge spooled node reports into the archive (idempotent, crash safe, one writer)."""
    from bluevela.archive.ingest import ingest
    from bluevela.errors import ArchiveError

    spool, archive = _path(ctx, "spool"), _path(ctx, "archive")

    def once() -> None:
        res = ingest(spool, archive, job_id=job_id, wait_s=wait_s,
                     timeout_s=timeout_min * 60, lock_wait_s=lock_wait, delete=delete,
                     compact=(job_id is None) if compact is None else compact)
        if as_json:
            emit_json(res.to_dict())
        elif not quiet or res.quarantined:
            click.echo(_ingest_line(res))

    if not watch:
        once()
        return
    stop = {"flag": False}

    def on_term(signum: int, frame: Any) -> None:
        stop["flag"] = True

    signal.signal(signal.SIGTERM, on_term)
    while not stop["flag"]:
        try:
            once()
        except ArchiveError as exc:
            click.echo(f"bv: error: {exc}", err=True)
        deadline = time.monotonic() + interval
        while not stop["flag"] and time.monotonic() < deadline:
            time.sleep(min(0.2, interval))


def _ingest_line(res: Any) -> str:
    parts = [f"ingested {res.reports_ingested} report(s) of {len(res.jobs_archived)} job(s)"
             + (f" into {res.segment}" if res.segment else "") + f" in {res.seconds:.2f} s"]
    if res.jobs_timed_out:
        parts.append(f"{len(res.jobs_timed_out)} job(s) archived with missing nodes after the "
                     "timeout")
    if res.duplicates:
        parts.append(f"{res.duplicates} already archived")
    if res.waiting_reports:
        parts.append(f"{res.waiting_reports} waiting for {len(res.waiting_jobs)} incomplete "
                     "job(s)")
    if res.conflicts:
        parts.append(f"{len(res.conflicts)} in conflict with an archived report of the same "
                     "key (quarantined, see the log)")
    if res.quarantined:
        parts.append(f"{len(res.quarantined)} quarantined")
    if res.compactions:
        parts.append(f"{res.compactions} compaction(s)")
    return "; ".join(parts)


def _fmt_time(ts: float | None) -> str:
    if ts is None:
        return ""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


@command.command("ls")
@click.option("--since", default=None, metavar="DATE",
              help="Jobs with a report at or after DATE (2025-01-31, 2025-01-31T08:00, 24h, 7d).")
@click.option("--user", default=None, help="Only this user's jobs.")
@click.option("--node", default=None, help="Only jobs that ran on this node.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_context
def ls_cmd(ctx: click.Context, since: str | None, user: str | None, node: str | None,
           as_json: bool) -> None:
    """List archived jobs."""
    from bluevela.archive.query import list_jobs

    jobs = list_jobs(_path(ctx, "archive"), since=_since(since), user=user, node=_node(node))
    if as_json:
        emit_json(jobs)
        return
    table("Archived jobs", ["JOBID", "USER", "PARTITION", "NODES", "COMPLETION", "MISSING",
                            "EXIT", "HEALTH", "END"],
          [(j["job_id"], j["user"], j["partition"], j["nodes"], j["completion"],
            ",".join(j["missing_nodes"]), _exit(j), j["health_worst"],
            _fmt_time(j["end_unix_s"])) for j in jobs])


def _exit(d: dict[str, Any]) -> str:
    if d.get("exit_code") is None:
        return ""
    sig = d.get("exit_signal")
    return f"{d['exit_code']}:{sig if sig is not None else 0}"


def _health_cell(report: dict[str, Any] | None) -> str:
    if report is None:
        return "-"
    health = report.get("health")
    if not health:
        return "(none)"
    checks = " ".join(f"{c['name']}={c['status']}" for c in health.get("checks") or [])
    return f"{health.get('status')} {checks}".strip()


def _prolog_cell(report: dict[str, Any] | None) -> str:
    """A grown node's prolog ran under the helper job's id (archive.query.grown_prologs)."""
    via = (report or {}).get("grown_via_job")
    return _health_cell(report) + (f" (grown via job {via})" if via else "")


@command.command("show")
@click.argument("job_id", type=click.IntRange(min=1))
@click.option("--json", "as_json", is_flag=True, help="Print JSON (includes the archive file).")
@click.option("--efficiency", is_flag=True,
              help="From the job's time series: GPU/CPU utilisation, power, energy, idle GPUs, "
              "restart gaps and stragglers (docs/efficiency.md).")
@click.option("--html", "html_out", type=click.Path(path_type=Path, dir_okay=False),
              default=None, help="With --efficiency: also write a self-contained HTML page.")
@click.option("--goodput", is_flag=True,
              help="The goodput ledger: the job's wall time and GPU hours by phase "
              "(productive, re-done, checkpoint, detection, relaunch, start-up, queue), each "
              "interruption's cause (docs/resilience.md).")
@click.pass_context
def show_cmd(ctx: click.Context, job_id: int, as_json: bool, efficiency: bool,
             html_out: Path | None, goodput: bool) -> None:
    """Show one archived job: its nodes, each node's prolog and epilog health, exit status,
    telemetry; or with --efficiency, how well it used its nodes and which lagged."""
    from bluevela.archive.query import show_job
    from bluevela.errors import BluevelaError

    try:
        spool: Path | None = _path(ctx, "spool")
    except BluevelaError:  # the spool only adds a hint to "not archived"
        spool = None
    job = show_job(_path(ctx, "archive"), job_id, spool=spool)
    if goodput:
        _show_goodput(_path(ctx, "archive"), job, as_json)
        return
    if efficiency or html_out is not None:
        _show_efficiency(_path(ctx, "archive"), job, as_json, html_out)
        return
    if as_json:
        emit_json(job)
        return
    # user and partition come from the job's Slurm record: shown as data (`printable`)
    click.echo(printable(f"job {job['job_id']}  user {job['user']}  partition {job['partition']}  "
                         f"exit {_exit(job) or '?'}  health {job['health_worst']}  "
                         f"completion {job['completion']} (revision {job['revision']})"))
    if job["missing_nodes"]:
        click.echo(printable(f"missing epilog reports: {','.join(job['missing_nodes'])}"))
    click.echo(printable(f"archive file: {job['archive_file']}"))
    table(f"Job {job_id}", ["NODE", "PROLOG", "EPILOG", "EXIT", "TELEMETRY"],
          [(n["node"], _prolog_cell(n["prolog"]), _health_cell(n["epilog"]),
            _exit(n["epilog"] or {}), _telemetry_cell(n["epilog"])) for n in job["nodes"]])
    if job.get("attempts"):  # a requeued job: one row per attempt (the nodes above: the last)
        click.echo(f"requeued {job['restarts']} time(s); each node above shows its last "
                   "attempt; the attempts:")
        table(f"Job {job_id}: {job['restarts']} restart(s)",
              ["RESTART", "NODES", "FIRST PROLOG", "LAST EPILOG", "EXIT"],
              [(a["restart"], a["nodes"], a["first_prolog_utc"] or "-",
                a["last_epilog_utc"] or "-", _exit(a) or "-") for a in job["attempts"]])


def _show_efficiency(archive: Path, job: dict[str, Any], as_json: bool,
                     html_out: Path | None) -> None:
    from bluevela.report.efficiency import job_efficiency
    from bluevela.report.efficiency_text import summary_lines

    eff = job_efficiency(archive, job["job_id"], job=job)
    if html_out is not None:
        from bluevela.report.efficiency_html import render_html
        from bluevela.report.goodput import ledger_or_none
        from bluevela.report.page import write_page

        write_page(html_out, render_html(eff, ledger_or_none(archive, job)))
    if as_json:
        emit_json(eff.to_dict())
        return
    for line in summary_lines(eff):
        click.echo(printable(line))
    if eff.stragglers:
        table(None, ["NODE", "GPU", "EVIDENCE"],
              [(s.node, "" if s.gpu is None else s.gpu, s.evidence) for s in eff.stragglers])
    if html_out is not None:
        click.echo(printable(f"wrote {html_out}"))


def _show_goodput(archive: Path, job: dict[str, Any], as_json: bool) -> None:
    from bluevela.report.fleet_advice import fleet_advice
    from bluevela.report.goodput import job_goodput, summary_lines

    ledger = job_goodput(archive, job["job_id"], job=job)
    ledger.advice = fleet_advice(archive, ledger, job)
    if as_json:
        emit_json(ledger.to_dict())
        return
    for line in summary_lines(ledger):
        click.echo(printable(line))


def _telemetry_cell(report: dict[str, Any] | None, limit: int = 4) -> str:
    if not report:
        return ""
    items = list((report.get("telemetry") or {}).items())
    text = " ".join(f"{k}={v:g}" if isinstance(v, int | float) else f"{k}={v}"
                    for k, v in items[:limit])
    return text + (f" (+{len(items) - limit})" if len(items) > limit else "")


@command.command("node")
@click.argument("node")
@click.option("--since", default=None, metavar="DATE", help="Reports at or after DATE.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_context
def node_cmd(ctx: click.Context, node: str, since: str | None, as_json: bool) -> None:
    """A node's history: every report's health per check, exit status and telemetry."""
    from bluevela.archive.query import node_history

    name = _node(node)
    assert name is not None
    hist = node_history(_path(ctx, "archive"), name, since=_since(since))
    if as_json:
        _emit_records(hist)
        return
    table(f"Node {name}", ["TIME", "JOBID", "PHASE", "HEALTH", "EXIT", "TELEMETRY"],
          [(_fmt_time(r["time"]), r["job_id"], r["phase"], _health_cell(r), _exit(r),
            _telemetry_cell(r)) for r in hist])


@command.command("export")
@click.option("--format", "fmt", type=click.Choice(["csv", "json"]), default="csv",
              show_default=True,
              help="csv: one flat row per report; json: the full reports.")
@click.option("--since", default=None, metavar="DATE", help="Reports at or after DATE.")
@click.option("--out", "out", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="Write to FILE (atomically) instead of standard output.")
@click.pass_context
def export_cmd(ctx: click.Context, fmt: str, since: str | None, out: Path | None) -> None:
    """Export archived reports as CSV or JSON."""
    import io

    from bluevela.archive.query import flat_record, iter_reports, write_csv
    from bluevela.errors import ArchiveError
    from bluevela.util.fs import atomic_write

    reports = iter_reports(_path(ctx, "archive"), since=_since(since))
    buf: Any = io.StringIO() if out is not None else sys.stdout
    if fmt == "json":
        _emit_records(reports, buf)
    else:
        write_csv([flat_record(r) for r in reports], buf)
    if out is not None:
        try:
            atomic_write(out, buf.getvalue().encode(), 0o644)
        except OSError as exc:
            raise ArchiveError(f"cannot write {out}: {exc.strerror or exc}") from exc


@command.command("verify")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_context
def verify_cmd(ctx: click.Context, as_json: bool) -> None:
    """Open every archive file and check the schema and indexes; exit 1 on any problem."""
    from bluevela.archive.query import verify

    res = verify(_path(ctx, "archive"))
    if as_json:
        emit_json(res.to_dict())
    else:
        for note in res.notes:
            click.echo(f"bv: note: {printable(note)}", err=True)
        for problem in res.problems:
            click.echo(f"bv: error: {printable(problem)}", err=True)
        if res.ok:
            click.echo(f"archive OK: {res.files} file(s), {res.reports} report(s), "
                       f"{res.jobs} job(s)")
    if not res.ok:
        sys.exit(1)  # the problems are printed above, one line each
