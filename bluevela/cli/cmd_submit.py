"""`bv submit`: a distributed PyTorch job (torchrun under srun) through sbatch."""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

import click

from bluevela.cli import State
from bluevela.cli.output import emit_json

if TYPE_CHECKING:
    from bluevela.launch.request import SubmitRequest
    from bluevela.site import Site
    from bluevela.slurm.client import SlurmClient


class _SubmitCommand(click.Command):
    """`--requeue=expedite` (Slurm 25.11+) beside the `--requeue/--no-requeue` flag: the value
    is taken off bv's own options before click parses them (sbatch_opts.take_requeue_value)."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        from bluevela.launch.sbatch_opts import take_requeue_value

        takes_value = {name for p in self.params if isinstance(p, click.Option)
                       and not p.is_flag and not p.count for name in (*p.opts, *p.secondary_opts)}
        args, ctx.meta["bv.requeue_mode"] = take_requeue_value(args, takes_value)
        return super().parse_args(ctx, args)


@click.command(cls=_SubmitCommand, context_settings={"allow_interspersed_args": False})
@click.argument("script")
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
@click.option("-N", "--nodes", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--gpus-per-node", type=click.IntRange(min=0), default=None,
              help="GPUs to request per node (default: the --class's GPUs, else 0).")
@click.option("--procs-per-node", default=None, metavar="N|gpu|auto",
              help="torchrun --nproc-per-node: a number, gpu (one per GPU torch sees) or auto "
                   "(default: GPUs per node, or 1 without GPUs).")
@click.option("-m", "--module", "module", is_flag=True,
              help="SCRIPT is a module, run as python -m would (torchrun -m): "
                   "bv submit -m pkg.train ARGS. The job is named after it.")
@click.option("-o", "--output", default=None, metavar="PATTERN",
              help="The job's output file (sbatch --output; %j: the job id). Every attempt "
                   "appends to it. Default: site.yaml launch.output, bv-%j.out.")
@click.option("--local-ranks-filter", default=None, metavar="RANKS",
              help="Only these local ranks' output reaches the output file, e.g. 0 "
                   "(torchrun --local-ranks-filter).")
@click.option("--rank-log-dir", default=None, metavar="DIR",
              help="Also keep every rank's stdout/stderr in a file of its own under DIR "
                   "(torchrun --log-dir DIR --tee 3: DIR/<run>/attempt_<n>/<local rank>/).")
@click.option("--class", "node_class", default=None, help="Node class from site.yaml.")
@click.option("-p", "--partition", default=None)
@click.option("-t", "--time", "time_limit", default=None, help="Slurm time limit, e.g. 1:00:00.")
@click.option("-J", "--job-name", default=None)
@click.option("--comment", default=None)
@click.option("--account", default=None)
@click.option("--qos", default=None)
@click.option("--env", "env", multiple=True, metavar="KEY=VALUE",
              help="Environment for the job (repeatable); overrides site.yaml launch.env.")
@click.option("--max-restarts", type=click.IntRange(min=0), default=None,
              help="torchrun --max-restarts (default: site.yaml).")
@click.option("--requeue/--no-requeue", default=None,
              help="Let Slurm requeue the job (prolog failure, node failure). Default: site.yaml. "
                   "--requeue=expedite (Slurm 25.11+, where slurm.conf allows it): a requeued "
                   "job is eligible at once, at the top of the queue.")
@click.option("--signal-before", type=click.IntRange(min=0, max=65535), default=None,
              metavar="SECONDS",
              help="SIGUSR1 to every training process this long before the time limit (and on "
                   "preemption/requeue); checkpoint, then bv requeues. 0: none. "
                   "Default: site.yaml launch.signal_before_s.")
@click.option("--spare-nodes", type=click.IntRange(min=0), default=None,
              help="Hot spare nodes added to the allocation; a lost node is replaced without a "
                   "requeue (they cost nodes). Default: site.yaml.")
@click.option("--min-nodes", type=click.IntRange(min=1), default=None,
              help="Data parallel only: keep training on at least this many nodes after a loss.")
@click.option("--hang-timeout", type=click.FloatRange(min=0), default=None, metavar="SECONDS",
              help="End the step and relaunch it in place when no rank reports progress "
                   "(bluevela.runtime.progress) this long. 0: off. Default: site.yaml.")
@click.option("-c", "--cpus-per-task", type=click.IntRange(min=1), default=None,
              help="CPUs for each node's task (torchrun and all its ranks).")
@click.option("--mem", default=None, help="Memory per node, e.g. 200G (0: all).")
@click.option("--exclusive", is_flag=True, help="Whole nodes only.")
@click.option("-C", "--constraint", default=None, help="Node features, e.g. 'h100&ib'.")
@click.option("-x", "--exclude", default=None, help="Nodes to leave out, e.g. gpu[001-004].")
@click.option("-d", "--dependency", default=None, help="e.g. afterok:1234, singleton.")
@click.option("--sbatch-arg", "sbatch_args", multiple=True, metavar="--NAME[=VALUE]",
              help="Any other sbatch option (repeatable), checked against sbatch's own list.")
@click.option("--python", "python", default=None, metavar="PYTHON",
              help="The job's Python (>= 3.11 with bluevela): a command on the job's PATH or "
                   "an absolute path. Default: site.yaml launch.python, else python3.")
@click.option("--no-python-check", is_flag=True,
              help="Do not run the job's Python at submit to check it (for a PATH that only "
                   "the compute nodes set up).")
@click.option("--site", "site_path", default=None, metavar="PATH",
              help="site.yaml to use (default: $BV_SITE, /etc/bluevela/site.yaml, then "
                   "./site.yaml where there is no system file).")
@click.option("--hold", is_flag=True, help="Submit held (release with scontrol release).")
@click.option("--dry-run", is_flag=True, help="Print the batch script; do not touch Slurm.")
@click.option("--wait", is_flag=True, help="Follow the job to its end; exit non-zero if it failed.")
@click.option("--retry-s", type=click.FloatRange(min=0), default=None,
              help="How long to retry an unreachable slurmctld (default: site.yaml, 120 s).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_obj
def command(obj: State, script: str, args: tuple[str, ...], nodes: int,
            gpus_per_node: int | None, procs_per_node: str | None, node_class: str | None,
            partition: str | None, time_limit: str | None, job_name: str | None,
            comment: str | None, account: str | None, qos: str | None, env: tuple[str, ...],
            max_restarts: int | None, requeue: bool | None, site_path: str | None,
            hold: bool, dry_run: bool, wait: bool, retry_s: float | None, as_json: bool,
            signal_before: int | None, spare_nodes: int | None, min_nodes: int | None,
            hang_timeout: float | None, cpus_per_task: int | None, mem: str | None,
            exclusive: bool, constraint: str | None, exclude: str | None,
            dependency: str | None, sbatch_args: tuple[str, ...], python: str | None,
            no_python_check: bool, module: bool, output: str | None,
            local_ranks_filter: str | None, rank_log_dir: str | None) -> None:
    """Submit SCRIPT [ARGS]... as a torchrun job: one srun task per node, c10d rendezvous on
    the first node of the allocation. With -m, SCRIPT is a module (bv submit -m pkg.train)."""
    from bluevela.launch.submit import build_request, submit
    from bluevela.site_file import choose_site

    if site_path:
        obj.site_path = site_path
    choice = choose_site(obj.site_path)
    site = obj.site() if choice.path is not None else None
    notes: list[str] = []
    request = build_request(
        site, script, args, nodes=nodes, gpus_per_node=gpus_per_node,
        procs_per_node=procs_per_node, partition=partition, time_limit=time_limit,
        job_name=job_name, comment=comment, account=account, qos=qos, env=env,
        max_restarts=max_restarts, requeue=requeue, node_class=node_class, hold=hold,
        signal_before=signal_before, spare_nodes=spare_nodes, min_nodes=min_nodes,
        hang_timeout=hang_timeout, cpus_per_task=cpus_per_task, mem=mem, exclusive=exclusive,
        constraint=constraint, exclude=exclude, dependency=dependency, sbatch_args=sbatch_args,
        python=python, module=module, output=output, local_ranks_filter=local_ranks_filter,
        rank_log_dir=rank_log_dir, notes=notes,
    )
    requeue_mode = click.get_current_context().meta.get("bv.requeue_mode")
    if requeue_mode is not None:
        request = _with_requeue_mode(request, requeue_mode, requeue)
        from bluevela.launch.sbatch_opts import EXPEDITE_CAVEAT

        notes.append(EXPEDITE_CAVEAT)
    _say_site(choice.lines(), notes, as_json)
    where = {"site": str(choice.path) if choice.path else None}
    if dry_run:
        if as_json:
            emit_json({"dry_run": True, **where, "script": request.materialize()})
        else:
            click.echo(request.materialize(), nl=False)
        return
    _check_before_submit(request, site, requeue_mode, check_python=not no_python_check)
    if retry_s is None and site is not None:
        retry_s = site.launch.submit_retry_s
    client = obj.client(retry_s=retry_s)
    job_id = submit(request, client, cwd=os.getcwd())
    if not wait:
        if as_json:
            emit_json({"job_id": job_id, **where, "nodes": nodes, "procs_per_node": request.nproc_per_node,
                       "output": request.output.replace("%j", str(job_id))})
        else:
            click.echo(f"Submitted job {job_id}. Follow it: bv status {job_id} | bv logs {job_id} --follow")
        return
    sys.exit(_follow_to_end(client, job_id, where, as_json))


def _with_requeue_mode(request: SubmitRequest, requeue_mode: str,
                       requeue: bool | None) -> SubmitRequest:
    """`request` with `--requeue=MODE` among its sbatch options (LaunchError: not with
    `--no-requeue`, or not a mode bv knows)."""
    import dataclasses

    from bluevela.errors import LaunchError
    from bluevela.launch.sbatch_opts import requeue_mode_problem

    problem = requeue_mode_problem(requeue_mode, requeue)
    if problem:
        raise LaunchError(problem)
    return dataclasses.replace(
        request, extra_sbatch=(*request.extra_sbatch, ("requeue", requeue_mode)))


def _say_site(lines: list[str], notes: list[str], as_json: bool) -> None:
    """The site file used (or passed over) and the request's notes, on stderr."""
    for line in lines:
        if not (as_json and line.startswith("site file:")):  # --json: in the document
            click.echo(f"bv: {line}", err=True)
    for note in notes:
        click.echo(f"bv: note: {note}", err=True)


def _check_before_submit(request: SubmitRequest, site: Site | None,
                         requeue_mode: str | None, *, check_python: bool) -> None:
    """What sbatch would not catch (the output directory, the job's Python) and, with
    `--requeue=MODE`, whether the running Slurm takes it (a dry run asks none of these)."""
    from bluevela.launch.submit import preflight

    preflight(request, site, cwd=os.getcwd(), check_python=check_python)
    if requeue_mode is not None:
        from bluevela.errors import LaunchError
        from bluevela.slurm.releases import expedite_problem_here

        problem = expedite_problem_here()
        if problem:
            raise LaunchError(f"--requeue={requeue_mode}: {problem}")


def _follow_to_end(client: SlurmClient, job_id: int, where: dict[str, str | None],
                   as_json: bool) -> int:
    """`--wait`: follow the job (progress and each attempt on stderr), print how it ended
    and each earlier attempt's cause; the exit status `bv submit --wait` ends with."""
    from bluevela.cli.follow import Follower
    from bluevela.launch.logs import with_causes
    from bluevela.launch.submit import exit_status_for, follow, is_held
    from bluevela.slurm.client import JobInfo
    from bluevela.util.term import printable

    if not as_json:
        click.echo(f"Submitted job {job_id}.", err=True)

    def on_attempt(n: int, info: JobInfo) -> None:
        # stderr, like the progress lines (stdout stays the one JSON document with --json).
        where = f" on {','.join(info.nodes)}" if info.nodes else ""
        click.echo(printable(f"job {job_id}: attempt {n}{where}"), err=True)

    with Follower(job_id, live=sys.stderr.isatty() and not as_json) as follower:
        info = follow(client, job_id, on_update=follower.update, on_attempt=on_attempt)
    code = exit_status_for(info)
    info = with_causes(info)
    if as_json:
        emit_json({"job_id": job_id, **info.to_dict(), **where, "wait_exit_status": code})
    else:
        for rec in info.attempts[:-1]:
            click.echo(printable(f"job {job_id}: attempt {rec.attempt} ended {rec.state_name}"
                                 + (f": {rec.cause}" if rec.cause else "")), err=True)
        click.echo(printable(f"Job {job_id} {info.state_name} (exit {info.exit_code}) on "
                             f"{','.join(info.nodes)}"
                             + (f" after {info.restarts} restart(s)" if info.restarts else "")))
    if is_held(info):  # said on stderr with --json too: the one JSON document stays on stdout
        click.echo(printable(f"job {job_id} is held ({info.reason or info.state_name}): Slurm "
                             f"starts it again only once released (scontrol release {job_id}); "
                             "bv stopped waiting"), err=True)
    return code
