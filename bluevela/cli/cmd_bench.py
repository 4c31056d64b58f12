"""`bv bench`: acceptance benchmarks on this node (`run`), the nightly run (`nightly`) and its
HTML report (`report`). torch, numpy, h5py and mpi4py are imported by the library functions
these commands call, never here."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import click

from bluevela.cli import State
from bluevela.cli.output import emit_json, table

MEASUREMENT_NAMES = ("gemm", "hbm", "h2d", "d2h", "allreduce", "allreduce-pair", "mpi")


@click.group()
def command() -> None:
    """Acceptance benchmarks: GEMM, memory, all_reduce inside and between nodes, MPI."""


@command.command("run")
@click.argument("names", nargs=-1, required=True, type=click.Choice(MEASUREMENT_NAMES))
@click.option("--class", "class_name", default=None,
              help="Node class whose floors apply (default: this host's).")
@click.option("--budget-s", type=click.FloatRange(min=0.01), default=0.5, show_default=True,
              help="Rough time budget per sweep point.")
@click.option("--out", "out_path", type=click.Path(dir_okay=False), default=None,
              help="Also write the JSON document to this file (atomically).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_obj
def run_cmd(obj: State, names: tuple[str, ...], class_name: str | None, budget_s: float,
            out_path: str | None, as_json: bool) -> None:
    """Run measurements NAME... on this node and judge them against its class's floors.

    Pair measurements (allreduce-pair, mpi) run under `srun -N2`; exit status is the worst
    result (0 OK, 1 WARNING, 2 CRITICAL, 3 UNKNOWN)."""
    from bluevela.bench.dist import launcher_rank
    from bluevela.bench.runner import exit_status, local_context, run_document, run_local

    ctx = local_context(obj.site_or_none(), class_name, budget_s=budget_s)
    results = run_local(names, ctx)
    if launcher_rank() != 0:
        return  # rank 0 reports for the whole step
    doc = run_document(ctx, results)
    if out_path:
        import json

        from bluevela.util.fs import atomic_write

        atomic_write(Path(out_path), (json.dumps(doc, indent=1, sort_keys=True) + "\n").encode())
    if as_json:
        emit_json(doc)
    else:
        rows = []
        for r in results:
            figs = " ".join(f"{v.name}={v.value:.4g} {v.unit}" for v in r.verdicts
                            if math.isfinite(v.value))
            rows.append((r.measurement, r.status.name, figs, r.message))
        table(f"bv bench run on {ctx.host} (class {ctx.class_name or '-'})",
              ("measurement", "status", "figures", "message"), rows)
    sys.exit(exit_status(results))


@command.command("nightly")
@click.option("-p", "--partition", default=None, help="Only nodes of this partition.")
@click.option("--nodes", "node_list", default=None, metavar="LIST",
              help="Only these nodes (hostlist, e.g. gpu[001-016]).")
@click.option("--wait", is_flag=True,
              help="Run in the foreground with progress; exit with the night's worst status.")
@click.option("--night", default=None, metavar="YYYY-MM-DD", help="Night id (default: today).")
@click.option("--no-drain", is_flag=True, help="Report failing nodes without draining them.")
@click.option("--budget-s", type=click.FloatRange(min=0.01), default=0.5, show_default=True,
              help="Rough time budget per sweep point inside the jobs.")
@click.option("--qos", default=None,
              help="The benchmark jobs' QOS (a high-priority one keeps backfill off the idle "
                   "nodes; docs/install.md 4.3).")
@click.option("--reservation", default=None,
              help="The benchmark jobs' reservation (its idle nodes are measured too).")
@click.option("--json", "as_json", is_flag=True, help="Print the night's outcome as JSON.")
@click.pass_obj
def nightly_cmd(obj: State, partition: str | None, node_list: str | None, wait: bool,
                night: str | None, no_drain: bool, budget_s: float, qos: str | None,
                reservation: str | None, as_json: bool) -> None:
    """Measure every idle node, then node pairs; drain failures; archive and report.

    Without --wait the run goes on as a detached process logging to <archive>/nightly/."""
    from bluevela.bench.nightly import NightlyOptions, run_nightly, start_detached
    from bluevela.bench.store import check_night

    site = obj.site()
    nodes: tuple[str, ...] | None = None
    if node_list:
        import hostlist

        try:
            nodes = tuple(hostlist.expand_hostlist(node_list))
        except hostlist.BadHostlist as exc:
            raise click.BadParameter(str(exc), param_hint="--nodes") from exc
    opts = NightlyOptions(partition=partition, nodes=nodes,
                          night=check_night(night) if night else None,
                          drain=not no_drain, budget_s=budget_s, qos=qos,
                          reservation=reservation)
    if not wait:
        pid, log = start_detached(site, opts, site_path=obj.site_path)
        if as_json:
            emit_json({"pid": pid, "log": str(log)})
        else:
            click.echo(f"Nightly run started (pid {pid}); log: {log}")
        return
    client = obj.client(retry_s=site.launch.submit_retry_s)
    if sys.stderr.isatty() and not as_json:
        from bluevela.bench.progress import RichEvents

        with RichEvents() as events:
            outcome = run_nightly(client, site, opts, events)
    else:
        from bluevela.bench.progress import PlainEvents

        outcome = run_nightly(client, site, opts, PlainEvents())
    if as_json:
        emit_json(outcome.to_dict())
    else:
        rows = [(n, s.status.name, outcome.culprits.get(n, "")) for n, s in outcome.singles.items()]
        table(f"nightly {outcome.night}", ("node", "status", "failure"), rows)
        for d in outcome.drains:
            click.echo(f"{'drained' if d.drained else 'NOT drained'} {d.node}: {d.reason}"
                       + (f" ({d.why_not})" if d.why_not else ""))
        click.echo(f"record: {outcome.record_path}")
        if outcome.report_path:
            click.echo(f"report: {outcome.report_path}")
    sys.exit(int(outcome.status))


@command.command("report")
@click.option("--night", default=None, metavar="YYYY-MM-DD", help="Night (default: latest).")
@click.option("--html", "html_path", required=True, type=click.Path(dir_okay=False),
              help="Where to write the self-contained HTML page.")
@click.pass_obj
def report_cmd(obj: State, night: str | None, html_path: str) -> None:
    """Write a night's report: failures first, pairs, distributions, trends."""
    from bluevela.bench.store import check_night, nightly_dir
    from bluevela.report.nightly_html import write_report

    site = obj.site()
    path = write_report(nightly_dir(site.path("archive")), check_night(night) if night else None,
                        Path(html_path))
    click.echo(str(path))
