"""From CLI options and the site to a SubmitRequest; submit it; follow it to the end."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from bluevela.errors import LaunchError, SlurmError
from bluevela.launch.request import (
    SubmitRequest,
    parse_sbatch_arg,
    signal_margin_problem,
    time_limit_seconds,
)
from bluevela.site import Site
from bluevela.site_model import Launch

if TYPE_CHECKING:  # `bv submit --dry-run` never talks to Slurm: it does not import its client
    from bluevela.slurm.client import JobInfo, SlurmClient

logger = logging.getLogger(__name__)


def parse_env(pairs: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    """`KEY=VALUE` strings to pairs; a missing '=' is a LaunchError."""
    out = []
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise LaunchError(f"--env {pair!r} is not KEY=VALUE")
        out.append((key, value))
    return tuple(out)


def build_request(
    site: Site | None,
    script: str,
    args: tuple[str, ...] = (),
    *,
    nodes: int = 1,
    gpus_per_node: int | None = None,
    procs_per_node: int | str | None = None,
    module: bool = False,
    output: str | None = None,
    local_ranks_filter: str | None = None,
    rank_log_dir: str | None = None,
    partition: str | None = None,
    time_limit: str | None = None,
    job_name: str | None = None,
    comment: str | None = None,
    account: str | None = None,
    qos: str | None = None,
    env: tuple[str, ...] = (),
    max_restarts: int | None = None,
    requeue: bool | None = None,
    node_class: str | None = None,
    hold: bool = False,
    signal_before: int | None = None,
    spare_nodes: int | None = None,
    min_nodes: int | None = None,
    hang_timeout: float | None = None,
    cpus_per_task: int | None = None,
    mem: str | None = None,
    exclusive: bool = False,
    constraint: str | None = None,
    exclude: str | None = None,
    dependency: str | None = None,
    sbatch_args: tuple[str, ...] = (),
    python: str | None = None,
    notes: list[str] | None = None,
) -> SubmitRequest:
    """Merge the site's launch defaults with the user's options.

    GPUs per node default to the node class's (`node_class`, else the partition's single class
    is not guessed: 0). Site environment comes first; `--env` overrides it.

    An explicit `signal_before` that does not fit the time limit is refused (LaunchError); the
    site's default that does not fit a short `--time` is dropped, with a line in `notes`.
    """
    launch = site.launch if site else None
    spank = tuple(launch.spank_options) if launch else ()
    gpus_per_node = _gpus_per_node(site, node_class, gpus_per_node, notes)
    job_env = _job_env(launch, env)
    script, args, module, name = _program(script, args, module, job_name)
    if isinstance(procs_per_node, str) and procs_per_node.isdigit():
        procs_per_node = int(procs_per_node)
    if signal_before is None:
        signal_before = _site_signal_before(launch, time_limit, notes)
    return SubmitRequest(
        script=script,
        args=tuple(args),
        nodes=nodes,
        gpus_per_node=gpus_per_node,
        procs_per_node=procs_per_node,
        module=module,
        local_ranks_filter=local_ranks_filter,
        rank_log_dir=rank_log_dir,
        partition=partition or (launch.default_partition if launch else None),
        time=time_limit,
        job_name=name,
        comment=comment,
        account=account,
        qos=qos,
        env=job_env,
        max_restarts=max_restarts if max_restarts is not None else (launch.max_restarts if launch else 0),
        requeue=requeue if requeue is not None else (launch.requeue if launch else True),
        torchrun=tuple(launch.torchrun) if launch else ("torchrun",),
        python=python or (launch.python if launch else "python3"),
        output=output or (launch.output if launch else "bv-%j.out"),
        hold=hold,
        signal_before=signal_before,
        spare_nodes=spare_nodes if spare_nodes is not None else (launch.spare_nodes if launch else 0),
        min_nodes=min_nodes,
        hang_timeout=(hang_timeout if hang_timeout is not None
                      else (launch.hang_timeout_s if launch else 0.0)),
        grow_deadline=launch.grow_deadline_s if launch else 0.0,
        rdzv_guard=launch.rdzv_guard if launch else "required",
        warm_start=launch.warm_start if launch else False,
        warm_preimport=tuple(launch.warm_preimport) if launch else (),
        cpus_per_task=cpus_per_task,
        mem=mem,
        exclusive=exclusive,
        constraint=constraint,
        exclude=exclude,
        dependency=dependency,
        sbatch_args=tuple(parse_sbatch_arg(a, spank) for a in sbatch_args),
        spank_options=spank,
    )


def _gpus_per_node(site: Site | None, node_class: str | None, gpus_per_node: int | None,
                   notes: list[str] | None) -> int:
    """GPUs per node: given, else the node class's (`--class`, else the site's default
    class), else 0; a line in `notes` when every node of the site has GPUs but the job asks
    for none."""
    launch = site.launch if site else None
    if node_class is not None and site is None:
        raise LaunchError(f"--class {node_class} needs a site file (--site, $BV_SITE, "
                          "/etc/bluevela/site.yaml, ./site.yaml)")
    if node_class is None and gpus_per_node is None and launch is not None:
        node_class = launch.default_class
    if gpus_per_node is None:
        gpus_per_node = site.node_class(name=node_class).gpus if (site and node_class) else 0
    if (not gpus_per_node and site is not None and notes is not None
            and all(c.gpus for c in site.node_classes.values())):
        # every node of this site has GPUs: a job that asks for none is almost surely a slip
        notes.append("the job asks for no GPUs (one process per node): give --class or "
                     "--gpus-per-node (site.yaml launch.default_class sets a default)")
    return gpus_per_node


def _program(script: str, args: tuple[str, ...], module: bool,
             job_name: str | None) -> tuple[str, tuple[str, ...], bool, str]:
    """What the job runs and its name: (script or module, its arguments, whether a module,
    the job's name)."""
    if script in ("-m", "--module") and args:  # `bv submit -- -m pkg.train`, torchrun's way
        module, script, args = True, args[0], tuple(args[1:])
    # a module's job is named after the module (`pkg.train`), a file's after its stem
    default_name = script if module else Path(script).stem
    name = job_name if job_name is not None else default_name or "bv"
    return script, args, module, name


def _job_env(launch: Launch | None, env: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    """The site's environment first, then `--env KEY=VALUE` (which overrides it)."""
    merged = dict(launch.env.items()) if launch else {}
    merged.update(dict(parse_env(env)))
    return tuple(merged.items())


def _site_signal_before(launch: Launch | None, time_limit: str | None,
                        notes: list[str] | None) -> int:
    """The site's checkpoint-signal margin, or 0 (with a line in `notes`) when it does not
    fit `time_limit`."""
    signal_before = launch.signal_before_s if launch else 0
    limit = time_limit_seconds(time_limit) if time_limit else None
    if signal_before and limit is not None and signal_margin_problem(signal_before, limit):
        if notes is not None:
            notes.append(f"no checkpoint signal: site.yaml launch.signal_before_s "
                         f"({signal_before} s) does not fit --time {time_limit}; "
                         f"give --signal-before to choose one")
        return 0
    return signal_before


def preflight(request: SubmitRequest, site: Site | None, *, cwd: str,
              check_python: bool = True) -> None:
    """What a real submit checks on the login node before the job queues (a dry run does
    not): the output file's directory exists (sbatch does not make it), and the job's Python
    runs bv's supervisor (`jobpython.check_job_python`; torch needed unless the site lets
    another torchrun run unguarded).

    Raises:
        LaunchError: one line saying what the job would have failed on.
    """
    from bluevela.launch.request import output_dir_problem

    problem = output_dir_problem(request.output, cwd)
    if problem:
        raise LaunchError(problem)
    if check_python:
        from bluevela.launch.jobpython import check_job_python

        check_job_python(request.python, request.env, cwd=cwd,
                         need_torch=site is None or site.launch.rdzv_guard == "required")


def submit(request: SubmitRequest, client: SlurmClient, *, cwd: str | None = None) -> int:
    """Submit the materialized script; return the job id."""
    return client.submit(request.materialize(), cwd=cwd)


def follow(
    client: SlurmClient,
    job_id: int,
    *,
    on_update: Callable[[JobInfo], None] | None = None,
    on_attempt: Callable[[int, JobInfo], None] | None = None,
    poll_s: float = 1.0,
    timeout_s: float | None = None,
    requeue_grace_s: float = 30.0,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> JobInfo:
    """Poll a job until it is final; call `on_update` on every poll.

    A requeued job (signal + requeue by bv, node failure, preemption, operator requeue) goes
    back to PENDING with a higher restart count: that is not the end. `on_attempt(n, info)` is
    called when attempt n (1-based, Slurm's restart count + 1) is first seen running. A state
    that Slurm may still requeue (NODE_FAIL, PREEMPTED of a requeueable job; REQUEUED) is
    polled for `requeue_grace_s` more before it counts as final. A job briefly unknown right
    after submit is polled again. Raises SlurmError on timeout.
    """
    from bluevela.slurm.states import JobState

    start = clock()
    unknown_since: float | None = None
    maybe_final_since: float | None = None
    seen_attempts: set[int] = set()
    while True:
        try:
            info = client.job(job_id)
            unknown_since = None
        except SlurmError:
            now = clock()
            unknown_since = unknown_since or now
            if now - unknown_since > 30:
                raise
            sleep(poll_s)
            continue
        if on_update:
            on_update(info)
        attempt_no = info.restarts + 1
        if on_attempt and attempt_no not in seen_attempts and (
                info.state in (JobState.RUNNING, JobState.COMPLETING) or info.state.is_terminal()):
            seen_attempts.add(attempt_no)
            on_attempt(attempt_no, info)
        if info.state.is_terminal() or is_held(info):
            if info.state.is_terminal() and not (info.requeue and info.state.may_requeue()):
                return info
            # A requeue may still follow; a held job runs again only when someone releases
            # it (an expedited requeue that ended non-zero, `scontrol requeuehold`, `--hold`):
            # both are waited for `requeue_grace_s`, then returned as they are.
            now = clock()
            maybe_final_since = maybe_final_since or now
            if now - maybe_final_since > requeue_grace_s:
                return info
        else:
            maybe_final_since = None
        if timeout_s is not None and clock() - start > timeout_s:
            raise SlurmError(f"job {job_id} still {info.state_name} after {timeout_s:.0f} s")
        sleep(poll_s)


HELD_REASONS = frozenset({"JobHeldUser", "JobHeldAdmin"})  # squeue's reason for a held job


def is_held(info: JobInfo) -> bool:
    """A job that Slurm will not start again by itself: requeued held (REQUEUE_HOLD, e.g. an
    expedited requeue that ended non-zero: docs/install.md 4.7) or pending on a hold."""
    from bluevela.slurm.states import JobState

    return info.state is JobState.REQUEUE_HOLD or (
        info.state is JobState.PENDING and info.reason in HELD_REASONS)


def requeue_with_checkpoint(client: SlurmClient, job_id: int) -> JobInfo:
    """An operator's requeue that takes the time-limit path: SIGUSR1 to the job's batch shell
    (bv's supervisor), which asks every worker to checkpoint, waits for them, and requeues the
    job itself. (`scontrol requeue` instead sends SIGTERM to every process and SIGKILL after
    KillWait.) Raises SlurmError for a job that is not running or may not be requeued."""
    from bluevela.slurm.states import JobState

    info = client.job(job_id)
    if info.state is not JobState.RUNNING:
        raise SlurmError(f"job {job_id} is {info.state_name}, not RUNNING: nothing to "
                         "checkpoint (scontrol requeue requeues it as it is)")
    if not info.requeue:
        raise SlurmError(f"job {job_id} was submitted with --no-requeue; it cannot come back "
                         "(scancel --batch --signal=USR1 still asks it to checkpoint)")
    client.signal_batch(job_id, "USR1")
    return info


def exit_status_for(info: JobInfo) -> int:
    """The `--wait` exit code: 0 completed; the job's own code when it failed with one;
    124 timeout; 130 cancelled; 1 otherwise."""
    from bluevela.slurm.states import JobState

    if info.state is JobState.COMPLETED:
        return 0
    if info.state is JobState.TIMEOUT:
        return 124
    if info.state is JobState.CANCELLED:
        return 130
    if info.exit_code:
        return info.exit_code
    return 1
