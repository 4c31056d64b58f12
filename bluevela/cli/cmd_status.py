"""`bv status`: jobs' state, exit status and nodes; for a requeued job the restart count, each
attempt's end (Slurm's record, and bv's cause where the output file is readable), and the LAST
attempt's state as the job's."""

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
    from bluevela.launch.logs import with_causes

    client = obj.client()
    infos = client.jobs(list(job_ids) if job_ids else None)
    # Requeued jobs named on the command line: each restart's cause from bv's banners.
    if job_ids:
        infos = [with_causes(i) for i in infos]
    unknown = sorted(set(job_ids) - {i.job_id for i in infos})
    if as_json:
        data = [i.to_dict() for i in infos]
        emit_json(data[0] if len(job_ids) == 1 and data else data)
    else:
        table("Jobs", ["JOBID", "STATE", "EXIT", "RESTARTS", "NODES", "NAME", "REASON"],
              [(i.job_id, i.state_name, "" if i.exit_code is None else i.exit_code,
                i.restarts, ",".join(i.nodes), i.name, i.reason) for i in infos])
        rows = [(i.job_id, a.attempt, a.state_name, ",".join(a.nodes), a.cause)
                for i in infos if len(i.attempts) > 1 for a in i.attempts]
        if rows:
            table("Attempts", ["JOBID", "ATTEMPT", "ENDED", "NODES", "CAUSE"], rows)
    if unknown:
        raise SlurmError(f"unknown job(s): {', '.join(map(str, unknown))}")
