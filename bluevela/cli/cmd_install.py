"""`bv install`: lay out this node from the installed package (docs/install.md 1.2)."""

from __future__ import annotations

import click

from bluevela.cli.output import emit_json


@click.command()
@click.option("--root", "root", default="/", show_default=True, metavar="DIR",
              help="Lay the tree out under DIR (an image, a staging check) instead of /.")
@click.option("--dry-run", is_flag=True, help="Say what would change; write nothing.")
@click.option("--uninstall", is_flag=True,
              help="Remove exactly what bv install laid out (its manifest); data is kept.")
@click.option("--force", is_flag=True,
              help="Install even when someone but root can change the venv, or bluevela is an "
                   "editable/checkout install (a developer's machine: warned on stderr); with "
                   "--uninstall: even while slurm.conf still names the hooks.")
@click.option("--fleet-host", is_flag=True,
              help="This host runs bv-fleet-metrics: also make its system user (bvfleet) and "
                   "textfile directory. Only there; never on every node.")
@click.option("--json", "as_json", is_flag=True)
def command(root: str, dry_run: bool, uninstall: bool, force: bool, fleet_host: bool,
            as_json: bool) -> None:
    """Install the hook shims, systemd units, Prometheus files, slurm.conf additions and
    logrotate file of this bluevela, point /opt/bluevela/current at its venv (one rename),
    and write /etc/bluevela/python. Idempotent; units are laid out, not enabled."""
    from bluevela.deploy.install import install
    from bluevela.deploy.install import uninstall as remove

    result = (remove(root, dry_run=dry_run, force=force) if uninstall
              else install(root, dry_run=dry_run, force=force, fleet_host=fleet_host))
    for warning in result.warnings:  # loud, and on stderr even with --json
        click.echo(f"bv install: WARNING: {warning}", err=True)
    if as_json:
        emit_json(result.to_dict())
        return
    what = "bv install --uninstall" if uninstall else "bv install"
    for change in result.changes:
        click.echo(change.line())
    for note in result.notes:
        click.echo(note)
    if not result.changed:
        click.echo(f"{what}: nothing to change ({result.version}, root {result.root})")
    elif dry_run:
        click.echo(f"{what}: dry run, nothing written ({result.version}, root {result.root})")
    else:
        click.echo(f"{what}: done ({result.version}, root {result.root})")
