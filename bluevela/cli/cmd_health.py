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
    """Node health: checks (gpu, ib, node, versions, nccl, dcgm), drains and resumes."""


@command.command("run")
@click.option("--tier", default="quick", show_default=True, help="Tier from site.yaml (quick, full).")
@click.option("--check", "checks", multiple=True, metavar="NAME",
              help="Run only this check (repeatable): gpu, ib, node, versions, nccl, dcgm.")
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

    from bluevela.fleet.api import run_local

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
    from bluevela.fleet.api import record_snapshot

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
@click.option("--versions", "versions", is_flag=True,
              help="Driver, CUDA, VBIOS, HCA firmware and kernel across the fleet: nodes "
                   "grouped by identical versions, with each class's pins and majority.")
@click.option("--all", "per_node", is_flag=True,
              help="With --versions: one row per node instead of one per group.")
@click.pass_obj
def nodes(obj: State, as_json: bool, versions: bool, per_node: bool) -> None:
    """Each node's Slurm state, drain reason and last bluevela report."""
    from bluevela.fleet.api import node_overview

    if per_node and not versions:
        raise click.UsageError("--all goes with --versions")
    if versions:
        _versions(obj, as_json, per_node)
        return
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


def _versions(obj: State, as_json: bool, per_node: bool) -> None:
    from bluevela.fleet.api import versions_overview

    view = versions_overview(obj.site(), obj.client(retry_s=10))
    if as_json:
        emit_json(view.to_dict(per_node=per_node))
        return
    fields = list(view.fields)

    def cells(values: dict[str, str] | object, drift: tuple[str, ...] = ()) -> list[str]:
        got = values if isinstance(values, dict) else {}
        return [f"{got[f]} *" if f in drift else got.get(f, "-") for f in fields]

    rows: list[list[str]] = []
    for cname in sorted(set(view.majority) | set(view.pinned)):
        pins = {f: " | ".join(v) for f, v in view.pinned.get(cname, {}).items()}
        rows.append([cname, "(pinned)", "", *cells(pins)])
        rows.append([cname, "(majority)", "", *cells(dict(view.majority.get(cname, {})))])
        for g in (g for g in view.groups if g.class_name == cname):
            members = g.nodes if per_node else (g.hostlist,)
            for m in members:
                rows.append([cname, m, str(1 if per_node else len(g.nodes)),
                             *cells(dict(g.versions), g.drift)])
        missing = view.unreported.get(cname, ())
        if missing:
            import hostlist

            rows.append([cname, hostlist.collect_hostlist(list(missing)), str(len(missing)),
                         *(["(no report)"] + ["-"] * (len(fields) - 1))])
    drifting = sum(len(g.nodes) for g in view.drifting)
    table(f"Versions: {drifting} node(s) drift (* differs from the pin, or from the class "
          "majority where unpinned)", ["CLASS", "NODES", "N", *[f.upper() for f in fields]],
          rows)


@command.command("dcgm")
@click.option("--level", type=click.IntRange(1, 4), required=True,
              help="dcgmi diag -r LEVEL (1 ~ seconds, 2 ~ 2 min, 3 ~ 30 min, 4 ~ hours).")
@click.option("--timeout-s", type=click.FloatRange(min=1), default=None,
              help="Kill dcgmi after this long (default: health.dcgm.nightly_timeout_s).")
@click.option("--class", "class_name", default=None,
              help="Node class (default: this host's, or $BV_NODE_CLASS).")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Also write the result (JSON) to this file.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.pass_obj
def dcgm(obj: State, level: int, timeout_s: float | None, class_name: str | None,
         out: Path | None, as_json: bool) -> None:
    """Run the DCGM diagnostic (dcgmi diag) on this node as the dcgm check. Exit code: the
    status (0 OK, 1 WARNING, 2 CRITICAL, 3 UNKNOWN: DCGM absent or no answer)."""
    import json

    from bluevela.errors import HealthError
    from bluevela.fleet.api import run_dcgm

    site = obj.site()
    result = run_dcgm(site, level=level, class_name=class_name,
                      timeout_s=timeout_s or site.health.dcgm.nightly_timeout_s)
    data = result.to_dict()
    if out is not None:
        try:
            out.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
        except OSError as exc:
            raise HealthError(f"cannot write {out}: {exc.strerror or exc}") from exc
    if as_json:
        emit_json(data)
    else:
        click.echo(f"dcgm: {result.status.name}: {result.summary}")
    sys.exit(int(result.status))


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

    from bluevela.fleet.api import resume_nodes

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
