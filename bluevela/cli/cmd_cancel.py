"""`bv cancel`: cancel jobs."""

from __future__ import annotations

import click

from bluevela.cli import State


@click.command()
@click.argument("job_ids", nargs=-1, required=True, type=click.IntRange(min=1))
@click.pass_obj
def command(obj: State, job_ids: tuple[int, ...]) -> None:
    """Cancel JOB_IDS."""
    obj.client().cancel(list(job_ids))
    click.echo(f"Cancelled {' '.join(map(str, job_ids))}")
