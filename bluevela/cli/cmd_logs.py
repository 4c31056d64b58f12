"""`bv logs`: a job's batch output."""

from __future__ import annotations

import click

from bluevela.cli import State


@click.command()
@click.argument("job_id", type=click.IntRange(min=1))
@click.option("-f", "--follow", is_flag=True, help="Keep printing until the job ends.")
@click.pass_obj
def command(obj: State, job_id: int, follow: bool) -> None:
    """Print JOB_ID's output file."""
    from bluevela.launch.logs import stream_log

    for chunk in stream_log(obj.client(), job_id, follow=follow):
        click.echo(chunk, nl=False)
