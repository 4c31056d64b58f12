"""`bv logs`: a job's batch output."""

from __future__ import annotations

import click

from bluevela.cli import State


@click.command()
@click.argument("job_id", type=click.IntRange(min=1))
@click.option("-f", "--follow", is_flag=True, help="Keep printing until the job ends.")
@click.option("--attempt", type=click.IntRange(min=1), default=None, metavar="N",
              help="Only attempt N (1-based; split on bv's per-attempt banners).")
@click.pass_obj
def command(obj: State, job_id: int, follow: bool, attempt: int | None) -> None:
    """Print JOB_ID's output file (every attempt's output: requeues append)."""
    from bluevela.launch.logs import attempt_log, stream_log

    if attempt is not None:
        if follow:
            raise click.UsageError("--attempt and --follow do not go together")
        click.echo(attempt_log(obj.client(), job_id, attempt), nl=False)
        return

    for chunk in stream_log(obj.client(), job_id, follow=follow):
        click.echo(chunk, nl=False)
