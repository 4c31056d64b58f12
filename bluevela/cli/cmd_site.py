"""`bv site`: validate and show site.yaml."""

from __future__ import annotations

import click

from bluevela.cli import State
from bluevela.cli.output import emit_json


@click.group()
def command() -> None:
    """site.yaml: validate it, show it."""


@command.command("validate")
@click.argument("path", required=False)
@click.option("--cluster", "against_cluster", is_flag=True,
              help="Also check the site against this cluster (run where sinfo and scontrol "
                   "answer): the prolog's timeout arithmetic, a node class for every node, the "
                   "spool and archive owner/mode/mount, and the merged slurm.conf lines bv "
                   "expects. Exit status: the worst finding (0 OK, 1 WARNING, 2 CRITICAL).")
@click.option("--json", "as_json", is_flag=True, help="With --cluster: the findings as JSON.")
@click.option("--allow-unknown", is_flag=True,
              help="Keys this bv does not know (a newer bv's) are warnings, not errors: what "
                   "the hooks and bv submit do with them.")
@click.pass_obj
def validate(obj: State, path: str | None, against_cluster: bool, as_json: bool,
             allow_unknown: bool) -> None:
    """Validate PATH (default: the site file bv would use). Problems print as PATH:LINE: message.

    A key this bv does not know is an error here (a typo must not pass); the hooks and the
    other commands ignore it with a warning (docs/site-yaml.md, "Unknown keys")."""
    from bluevela.launch.grow import readiness
    from bluevela.site import load_site

    site = load_site(path or obj.site_path, strict=not allow_unknown)
    if not as_json:
        click.echo(f"{site.source}: OK ({site.cluster}: {len(site.node_classes)} node classes)")
    note = readiness(site.launch.grow_deadline_s)
    if note is not None:
        click.echo(f"WARNING: {note}", err=True)
    from bluevela.hooks.env import events_dir_problem

    events_note = events_dir_problem()
    if events_note is not None:
        click.echo(f"WARNING: {events_note}", err=True)
    if not against_cluster:
        return
    from bluevela.site_checks import validate as check_cluster

    result = check_cluster(site)
    if as_json:
        emit_json(result.to_dict())
    else:
        for finding in result.findings:
            click.echo(finding.line())
        click.echo("slurm.conf: the lines bv expects, merged with the running config "
                   "(docs/install.md 1.4):")
        for line, in_place in result.slurm_lines:
            click.echo(f"  {line}" + ("" if in_place else "    # to merge"))
    if result.status.severity:
        raise SystemExit(int(result.status))


@command.command("show")
@click.option("--json", "as_json", is_flag=True)
@click.pass_obj
def show(obj: State, as_json: bool) -> None:
    """Print the effective site (defaults filled in)."""
    from bluevela.site import to_dict

    site = obj.site()
    data = to_dict(site)
    data["effective_paths"] = {k: str(site.path(k)) for k in ("spool", "archive", "state", "metrics")}
    if as_json:
        emit_json(data)
    else:
        import yaml

        click.echo(yaml.safe_dump(data, sort_keys=False), nl=False)
