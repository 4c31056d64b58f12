"""`bv requeue`: checkpoint, then requeue running jobs (the time-limit signal's path)."""

from __future__ import annotations

import click

from bluevela.cli import State


@click.command()
@click.argument("job_ids", nargs=-1, required=True, type=click.IntRange(min=1))
@click.pass_obj
def command(obj: State, job_ids: tuple[int, ...]) -> None:
    """Ask JOB_IDS to checkpoint, then requeue them (same job id, restart count + 1).

    bv's supervisor gets SIGUSR1, forwards it to every training process, waits for them to
    exit and requeues the job; the next attempt resumes from the checkpoint. Unlike
    `scontrol requeue`, nothing is killed before the workers have saved.
    """
    from bluevela.launch.submit import requeue_with_checkpoint

    client = obj.client()
    for job_id in job_ids:
        requeue_with_checkpoint(client, job_id)
        click.echo(f"job {job_id}: checkpoint requested; bv requeues it once the workers exit")
