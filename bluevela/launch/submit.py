"""From CLI options and the site to a SubmitRequest; submit it; follow it to the end."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

from bluevela.errors import LaunchError, SlurmError
from bluevela.launch.request import SubmitRequest
from bluevela.site import Site
from bluevela.slurm.client import JobInfo, SlurmClient
from bluevela.slurm.states import JobState

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
    procs_per_node: int | None = None,
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
) -> SubmitRequest:
    """Merge the site's launch defaults with the user's options.

    GPUs per node default to the node class's (`node_class`, else the partition's single class
    is not guessed: 0). Site environment comes first; `--env` overrides it.
    """
    launch = site.launch if site else None
    if node_class is not None and site is None:
        raise LaunchError(f"--class {node_class} needs a site file (--site, $BV_SITE, ./site.yaml)")
    if gpus_per_node is None:
        gpus_per_node = site.node_class(name=node_class).gpus if (site and node_class) else 0
    site_env = tuple(launch.env.items()) if launch else ()
    user_env = parse_env(env)
    merged = dict(site_env)
    merged.update(dict(user_env))
    name = job_name if job_name is not None else Path(script).stem or "bv"
    return SubmitRequest(
        script=script,
        args=tuple(args),
        nodes=nodes,
        gpus_per_node=gpus_per_node,
        procs_per_node=procs_per_node,
        partition=partition or (launch.default_partition if launch else None),
        time=time_limit,
        job_name=name,
        comment=comment,
        account=account,
        qos=qos,
        env=tuple(merged.items()),
        max_restarts=max_restarts if max_restarts is not None else (launch.max_restarts if launch else 0),
        requeue=requeue if requeue is not None else (launch.requeue if launch else True),
        rdzv_port=launch.rdzv_port if launch else 29500,
        torchrun=tuple(launch.torchrun) if launch else ("torchrun",),
        output=launch.output if launch else "bv-%j.out",
        hold=hold,
    )


def submit(request: SubmitRequest, client: SlurmClient, *, cwd: str | None = None) -> int:
    """Submit the materialized script; return the job id."""
    return client.submit(request.materialize(), cwd=cwd)


def follow(
    client: SlurmClient,
    job_id: int,
    *,
    on_update: Callable[[JobInfo], None] | None = None,
    poll_s: float = 1.0,
    timeout_s: float | None = None,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> JobInfo:
    """Poll a job until it reaches a terminal state; call `on_update` on every poll.

    A requeued job (prolog failure, node failure) goes back to PENDING: that is not the end.
    A job briefly unknown right after submit is polled again. Raises SlurmError on timeout.
    """
    start = clock()
    unknown_since: float | None = None
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
        if info.state.is_terminal():
            return info
        if timeout_s is not None and clock() - start > timeout_s:
            raise SlurmError(f"job {job_id} still {info.state_name} after {timeout_s:.0f} s")
        sleep(poll_s)


def exit_status_for(info: JobInfo) -> int:
    """The `--wait` exit code: 0 completed; the job's own code when it failed with one;
    124 timeout; 130 cancelled; 1 otherwise."""
    if info.state is JobState.COMPLETED:
        return 0
    if info.state is JobState.TIMEOUT:
        return 124
    if info.state is JobState.CANCELLED:
        return 130
    if info.exit_code:
        return info.exit_code
    return 1
