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
@click.pass_obj
def validate(obj: State, path: str | None) -> None:
    """Validate PATH (default: the site file bv would use). Problems print as PATH:LINE: message."""
    from bluevela.launch.grow import readiness
    from bluevela.site import load_site

    site = load_site(path or obj.site_path)
    click.echo(f"{site.source}: OK ({site.cluster}: {len(site.node_classes)} node classes)")
    note = readiness(site.launch.grow_deadline_s)
    if note is not None:
        click.echo(f"WARNING: {note}", err=True)
    from bluevela.launch.events import events_dir_problem

    events_note = events_dir_problem()
    if events_note is not None:
        click.echo(f"WARNING: {events_note}", err=True)


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
