"""`bv health`: run the node checks here, record an NVML snapshot, the cluster view, resume."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import click

from bluevela.cli import State
from bluevela.cli.output import emit_json, table


@click.group()
def command() -> None:
    """Node health: checks (gpu, ib, node, nccl), drains and resumes."""


@command.command("run")
@click.option("--tier", default="quick", show_default=True, help="Tier from site.yaml (quick, full).")
@click.option("--check", "checks", multiple=True, metavar="NAME",
              help="Run only this check (repeatable): gpu, ib, node, nccl.")
@click.option("--class", "class_name", default=None,
              help="Node class to judge against (default: this host's, or $BV_NODE_CLASS).")
@click.option("--sysfs-root", type=click.Path(file_okay=False), default=None,
              help="Read sysfs/proc/dev below this directory (sets BV_SYSFS_ROOT).")
@click.option("--nvml-snapshot", type=click.Path(dir_okay=False), default=None,
              help="Replay this NVML snapshot instead of live NVML (sets BV_NVML_SNAPSHOT).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON {status, checks: [...]}.")
@click.pass_obj
def run(obj: State, tier: str, checks: tuple[str, ...], class_name: str | None,
        sysfs_root: str | None, nvml_snapshot: str | None, as_json: bool) -> None:
    """Run checks on this node. The exit code is the worst status (0 OK, 1 WARNING,
    2 CRITICAL, 3 UNKNOWN)."""
    import os

    from bluevela.health.api import run_local

    env = dict(os.environ)
    if sysfs_root:
        env["BV_SYSFS_ROOT"] = sysfs_root
    if nvml_snapshot:
        env["BV_NVML_SNAPSHOT"] = nvml_snapshot
    report = run_local(obj.site(), tier=tier, checks=checks or None, class_name=class_name,
                       env=env)
    if as_json:
        emit_json(report.to_dict())
    else:
        table(f"Health ({report.tier}): {report.status.name}", ["CHECK", "STATUS", "SUMMARY", "TIME"],
              [(c.name, c.status.name, c.summary, f"{c.duration_s:.2f}s") for c in report.checks])
    sys.exit(report.exit_code)


@command.command("snapshot")
@click.option("--out", "out", type=click.Path(dir_okay=False, path_type=Path), required=True,
              help="File to write (the BV_NVML_SNAPSHOT replay format).")
@click.option("--no-kmsg", is_flag=True, help="Do not read NVRM lines (XIDs) from /dev/kmsg.")
@click.pass_obj
def snapshot(obj: State, out: Path, no_kmsg: bool) -> None:
    """Record this node's live NVML values (pynvml) in the replay format."""
    from bluevela.errors import HealthError
    from bluevela.health.api import record_snapshot

    try:
        data = record_snapshot(out, include_kmsg=not no_kmsg)
    except ImportError as exc:
        raise HealthError("pynvml is not installed (pip install nvidia-ml-py)") from exc
    except RuntimeError as exc:
        raise HealthError(str(exc)) from exc
    except OSError as exc:
        raise HealthError(f"cannot write {out}: {exc.strerror or exc}") from exc
    gpus = data.get("gpus") or []
    names = sorted({str(g.get("name")) for g in gpus})
    click.echo(f"{out}: {len(gpus)} GPU(s) {', '.join(names)}, driver {data.get('driver_version')}")


@command.command("nodes")
@click.option("--json", "as_json", is_flag=True, help="Print JSON (one object per node).")
@click.pass_obj
def nodes(obj: State, as_json: bool) -> None:
    """Each node's Slurm state, drain reason and last bluevela report."""
    from bluevela.health.api import node_overview

    rows = node_overview(obj.site(), obj.client(retry_s=10))
    if as_json:
        emit_json([r.to_dict() for r in rows])
        return

    def last(r: object) -> str:
        lr = getattr(r, "last", None)
        if not lr:
            return ""
        when = time.strftime("%m-%d %H:%M", time.localtime(lr["time"])) if lr.get("time") else "?"
        job = f" job {lr['job_id']}" if lr.get("job_id") else ""
        return f"{lr.get('phase')}{job} {lr.get('status')} @ {when}"

    table("Nodes", ["NODE", "STATE", "REASON", "BV", "LAST REPORT"],
          [(r.name, r.state, r.reason, "yes" if r.ours else "", last(r)) for r in rows])


@command.command("resume")
@click.argument("node_names", nargs=-1, required=True, metavar="NODES...")
@click.option("--json", "as_json", is_flag=True)
@click.pass_obj
def resume(obj: State, node_names: tuple[str, ...], as_json: bool) -> None:
    """Resume NODES drained by bluevela ('bv:' reasons). Operators' drains are refused.

    On the node itself the full tier is re-run first; from a login node the node's own
    healthcheck and its next prolog are the re-check (they drain it again if it still fails).
    Exit 1 when any node was refused.
    """
    import hostlist

    from bluevela.health.api import resume_nodes

    try:
        names = [n for expr in node_names for n in hostlist.expand_hostlist(expr)]
    except hostlist.BadHostlist as exc:
        raise click.BadParameter(f"not a hostlist: {exc}", param_hint="NODES") from exc
    outcomes = resume_nodes(obj.site(), obj.client(retry_s=10), names)
    if as_json:
        emit_json([o.to_dict() for o in outcomes])
    else:
        for o in outcomes:
            verdict = "resumed" if o.resumed else "REFUSED" if o.refused else "unchanged"
            click.echo(f"{o.node}: {verdict}: {o.message}", err=o.refused)
    if any(o.refused for o in outcomes):
        sys.exit(1)
