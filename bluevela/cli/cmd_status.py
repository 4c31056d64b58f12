"""`bv status`: jobs' state, exit status and nodes."""

from __future__ import annotations

import click

from bluevela.cli import State
from bluevela.cli.output import emit_json, table


@click.command()
@click.argument("job_ids", nargs=-1, type=click.IntRange(min=1))
@click.option("--json", "as_json", is_flag=True, help="Print JSON (one object per job).")
@click.pass_obj
def command(obj: State, job_ids: tuple[int, ...], as_json: bool) -> None:
    """Show JOB_IDS (all jobs Slurm knows when none given)."""
    from bluevela.errors import SlurmError

    client = obj.client()
    infos = client.jobs(list(job_ids) if job_ids else None)
    unknown = sorted(set(job_ids) - {i.job_id for i in infos})
    if as_json:
        data = [i.to_dict() for i in infos]
        emit_json(data[0] if len(job_ids) == 1 and data else data)
    else:
        table("Jobs", ["JOBID", "STATE", "EXIT", "NODES", "NAME", "REASON"],
              [(i.job_id, i.state_name, "" if i.exit_code is None else i.exit_code,
                ",".join(i.nodes), i.name, i.reason) for i in infos])
    if unknown:
        raise SlurmError(f"unknown job(s): {', '.join(map(str, unknown))}")
