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
    from bluevela.launch.logs import bv_attempts_of, with_causes

    client = obj.client()
    infos = client.jobs(list(job_ids) if job_ids else None)
    # Requeued jobs named on the command line: each restart's cause from bv's banners.
    # bv's own attempts too: relaunches inside the allocation (spare, shrink, a grown node, a
    # hang in place) are attempts without a Slurm restart.
    ours: dict[int, list[dict[str, object]]] = {}
    if job_ids:
        infos = [with_causes(i) for i in infos]
        ours = {i.job_id: bv_attempts_of(i) for i in infos}
    unknown = sorted(set(job_ids) - {i.job_id for i in infos})
    if as_json:
        data = [{**i.to_dict(), **({"bv_attempts": ours[i.job_id]}
                                   if len(ours.get(i.job_id, [])) > 1 else {})} for i in infos]
        emit_json(data[0] if len(job_ids) == 1 and data else data)
    else:
        table("Jobs", ["JOBID", "STATE", "EXIT", "RESTARTS", "NODES", "NAME", "REASON"],
              [(i.job_id, i.state_name, "" if i.exit_code is None else i.exit_code,
                i.restarts, ",".join(i.nodes), i.name, i.reason) for i in infos])
        rows = [(i.job_id, a.attempt, a.state_name, ",".join(a.nodes), a.cause)
                for i in infos if len(i.attempts) > 1 for a in i.attempts]
        if rows:
            table("Attempts", ["JOBID", "ATTEMPT", "ENDED", "NODES", "CAUSE"], rows)
        bv_rows = [(i.job_id, a["attempt"], a["nodes"],
                    "" if a["grown"] is None else f"{a['grown']} in {a['grow_s']:.1f} s",
                    "yes" if a["slurm_requeue"] else "no", a["ended"])
                   for i in infos if len(ours.get(i.job_id, [])) > 1 for a in ours[i.job_id]]
        if bv_rows:
            table("bv attempts", ["JOBID", "ATTEMPT", "NODES", "GREW", "REQUEUE", "ENDED"],
                  bv_rows)
    if unknown:
        raise SlurmError(f"unknown job(s): {', '.join(map(str, unknown))}")
