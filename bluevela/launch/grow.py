"""Grow a running job by one node in place of a lost one (issue 19; docs/resilience.md).

Slurm merges a second allocation into a running job when the site sets
``SchedulerParameters=permit_job_expansion``:

    salloc --no-shell -N1 --exclusive --dependency=expand:JOB ...   # job NEW, one node
    scontrol update JobId=NEW NumNodes=0                             # NEW gives its node up
    scancel NEW
    scontrol update JobId=JOB NumNodes=ALL                           # JOB takes it

The last command writes ``slurm_job_JOB_resize.sh`` (in its working directory: here a private
temporary one) with the ``SLURM_*`` variables the next ``srun`` of the job needs; the
supervisor merges them into the environment of its next step.

No path leaves a helper job (named ``bv-grow-JOB``) behind (issue 23):
- every grow ends by cancelling the helper it knows of AND every job of this user with the
  helper's name (a salloc killed, or a slurmctld answer lost, before the id was printed),
  retrying while slurmctld does not answer; the salloc's output is kept on a timeout;
- SIGTERM/SIGINT (the job cancelled, or at its time limit) during a grow stops the Slurm
  command under way and runs that cleanup before the supervisor goes on (KillWait);
- what no process of ours can clean up any more (the supervisor SIGKILLed) Slurm ends by
  itself: a granted helper's time limit is cut to minutes before anything else, and a pending
  one whose job has ended is started and failed by slurmctld within seconds (22.05, seen);
- a job that runs again (requeued, same id) sweeps what a previous run left
  (`release_helpers`, from the supervisor).

The job's fields are read with squeue's explicit format (bluevela.slurm.cli_client), never
from `scontrol show job` text, where a job name such as ``lr = 0.1 Partition=x`` reads as
fields.

Pure parts (argv, parsers, the support verdict) are unit-tested; `grow()` runs the commands,
each through the job side's one seam to Slurm (bluevela/slurm/command.py, `run_cli` here):
bounded, retried with backoff while slurmctld is unreachable or busy, salloc tried once, a
failure typed (`SlurmCall`: the command, its exit status, one printable line).
Standard library only: it runs inside the supervisor, which must not import torch or
pydantic. Talks to Slurm through its CLI with argv lists, never a shell.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

from bluevela.slurm.cli_client import job_fields_argv, parse_config, parse_job_fields
from bluevela.slurm.command import SlurmCall, run_slurm
from bluevela.slurm.jobctl import slurm_duration
from bluevela.slurm.releases import expansion_problem

logger = logging.getLogger(__name__)

# The variables of Slurm's resize script the supervisor takes over (the rest are csh/echo).
RESIZE_VAR = re.compile(r'^export (SLURM_[A-Z_]+)="?([^"\n]*)"?\s*$', re.M)
GRANTED = re.compile(r"Granted job allocation (\d+)")
PENDING = re.compile(r"Pending job allocation (\d+)")
HELPER_PREFIX = "bv-grow-"
# A granted helper's time limit right after the grant: what it holds if every process of ours
# is killed before it gave its node to the job (the merge itself takes well under a second).
HELPER_HOLD_MIN = 2
# How long the cleanup keeps trying while slurmctld does not answer (at least; a grow's own
# deadline when longer), and its first pause (doubled up to 8 s).
RELEASE_S = 60.0
RELEASE_PAUSE_S = 0.5
# Live states of a helper worth cancelling (squeue -t).
LIVE_STATES = "PENDING,CONFIGURING,RUNNING,SUSPENDED,REQUEUED,RESIZING"

# One Slurm command: argv, its bound in seconds (all tries), its working directory.
Runner = Callable[[Sequence[str], float, str | None], SlurmCall]


def run_cli(argv: Sequence[str], timeout: float, cwd: str | None = None) -> SlurmCall:
    """One Slurm command through the seam (bluevela/slurm/command.py), `timeout` bounding all
    its tries: retried with backoff while slurmctld is unreachable, hung or busy, or says a
    job update is not available right now; salloc is tried once, and a timed-out try keeps
    what the command had printed (salloc's "Pending job allocation N")."""
    return run_slurm(argv, timeout_s=timeout, retry_for_s=timeout, cwd=cwd)


def helper_name(job: str) -> str:
    return f"{HELPER_PREFIX}{job}"


# --------------------------------------------------------------------------------------------
# Pure pieces


def support_problem(config: dict[str, str]) -> str | None:
    """Why this Slurm cannot grow a running job, or None when it can (as far as the config and
    the release say: the salloc itself is the final word, and its refusal is reported as
    such). A release whose grown nodes do not run the job's steps (24.11 and later with
    PrologFlags=Alloc: bluevela/slurm/releases.py) is one that cannot: the job is requeued."""
    return expansion_problem(config)


def _minutes(value: str) -> int | None:
    """Slurm's [days-]hh:mm:ss as whole minutes (rounded down); None for UNLIMITED or junk."""
    seconds = slurm_duration(value.strip())
    return None if seconds is None else seconds // 60


@dataclass(frozen=True)
class JobShape:
    """What a node added to the job must match (from `scontrol show job -o`)."""

    partition: str = ""
    account: str = ""
    qos: str = ""
    constraints: str = ""
    gres: str = ""  # per node, e.g. gres:gpu:8
    cpus_per_node: int = 0  # a shared (not exclusive) job's CPUs on each of its nodes
    mem_per_node: str = ""  # MinMemoryNode, when set
    exclusive: bool = True
    minutes_left: int | None = None  # None: no time limit
    nodes: list[str] = field(default_factory=list)


def shape_of(fields: dict[str, str]) -> JobShape:
    """The shape from a job's fields (`parse_job_fields`: squeue's, named as scontrol names
    them)."""
    def val(key: str) -> str:
        v = fields.get(key, "")
        return "" if v in ("(null)", "(null)=", "N/A") else v

    limit = _minutes(val("TimeLimit"))
    run = _minutes(val("RunTime")) or 0
    left = None if limit is None else max(1, limit - run)
    # OverSubscribe=NO is what --exclusive gives; anything else: the job shares nodes.
    exclusive = val("OverSubscribe") in ("NO", "")
    cpus, nodes = val("NumCPUs"), val("NumNodes")
    per_node = int(cpus) // int(nodes) if cpus.isdigit() and nodes.isdigit() and int(nodes) else 0
    mem = val("MinMemoryNode")
    return JobShape(partition=val("Partition"), account=val("Account"), qos=val("QOS"),
                    constraints=val("Features"), gres=val("TresPerNode"), exclusive=exclusive,
                    minutes_left=left, cpus_per_node=per_node,
                    mem_per_node="" if mem in ("", "0") else mem,
                    nodes=_expand_nodes(val("NodeList")))


def salloc_argv(job: str, shape: JobShape, exclude: Sequence[str], deadline_s: float,
                count: int = 1) -> list[str]:
    """`count` node(s) for job `job`: same partition, account, QOS, constraints, exclusive; never a
    node in `exclude` (the lost ones, and the job's own). Drained/down nodes are never
    allocated by Slurm. --immediate bounds the wait: salloc gives up (and withdraws the
    request) when no node is free by then."""
    argv = ["salloc", "--no-shell", f"--nodes={max(1, count)}", f"--dependency=expand:{job}",
            f"--immediate={max(1, int(deadline_s))}", f"--job-name={helper_name(job)}"]
    if shape.exclusive:
        argv.append("--exclusive")
    elif shape.cpus_per_node > 1:
        argv.append(f"--mincpus={shape.cpus_per_node}")
    gres = shape.gres.removeprefix("gres:").replace("gres:", "") if shape.gres else ""
    argv += [f"--{flag}={value}" for flag, value in (
        ("mem", shape.mem_per_node), ("partition", shape.partition), ("account", shape.account),
        ("qos", shape.qos), ("constraint", shape.constraints), ("gres", gres)) if value]
    if shape.minutes_left is not None:
        # Placed as for the job's whole remaining time (never on a node that a reservation or
        # a planned job needs sooner). No --deadline: slurmctld then leaves the request to its
        # next scheduling cycle instead of placing it at once (+1.7 s a grow here, up to
        # sched_interval elsewhere); an orphaned pending helper ends by itself anyway
        # (docs/resilience.md, "Grow").
        argv.append(f"--time={shape.minutes_left}")
    if exclude:
        argv.append(f"--exclude={','.join(sorted(set(exclude)))}")
    return argv


def granted_job(text: str) -> str | None:
    m = GRANTED.search(text) or PENDING.search(text)
    return m.group(1) if m else None


def parse_resize(text: str) -> dict[str, str]:
    """The SLURM_* exports of Slurm's `slurm_job_<id>_resize.sh` (values are node lists and
    counts; anything with a shell character is dropped rather than trusted)."""
    return {k: v for k, v in RESIZE_VAR.findall(text) if re.fullmatch(r"[\w\[\],.()*:-]*", v)}


# --------------------------------------------------------------------------------------------
# The Slurm steps


@dataclass
class GrowResult:
    added: list[str]  # the new node(s); empty when the grow failed
    env: dict[str, str]  # SLURM_* for the next srun (from the resize script)
    seconds: float
    why: str = ""  # the reason when `added` is empty
    left: list[str] = field(default_factory=list)  # helper jobs not confirmed gone
    released: list[str] = field(default_factory=list)  # lost nodes the job already let go of
    helper: str = ""  # the helper job (bv-grow-JOB) whose node the job took: its prolog ran

    @property
    def ok(self) -> bool:
        return bool(self.added)


def _expand_nodes(nodelist: str) -> list[str]:
    import hostlist

    return list(hostlist.expand_hostlist(nodelist)) if nodelist and nodelist != "(null)" else []


class _Ending(Exception):
    """SIGTERM or SIGINT reached the supervisor during a grow (the job cancelled, or at its
    time limit): stop the grow where it is and clean up."""


@dataclass
class _Guard:
    armed: bool = True
    got: list[int] = field(default_factory=list)


@contextmanager
def _stop_on_signal() -> Iterator[_Guard]:
    """While armed, the first SIGTERM/SIGINT raises _Ending wherever the grow is (a Slurm
    command under way is killed by subprocess.run on the way out). The handler that was there
    still runs, and a wakeup fd (the supervisor's) still gets the signal, so the supervisor
    sees it after the grow. Main thread only (signal handlers); elsewhere nothing changes."""
    guard = _Guard()
    if threading.current_thread() is not threading.main_thread():
        guard.armed = False
        yield guard
        return
    sigs = (signal.SIGTERM, signal.SIGINT)
    old = {s: signal.getsignal(s) for s in sigs}

    def handler(sig: int, frame: FrameType | None) -> None:
        prev = old.get(signal.Signals(sig))
        if callable(prev):
            prev(sig, frame)
        guard.got.append(sig)
        if guard.armed:
            guard.armed = False
            raise _Ending(signal.Signals(sig).name)

    for s in sigs:
        signal.signal(s, handler)
    try:
        yield guard
    finally:
        guard.armed = False
        for s in sigs:
            signal.signal(s, old[s])


def release_helpers(job: str, known: Sequence[str] = (), until: float | None = None,
                    run: Runner = run_cli) -> list[str]:
    """Cancel the grow helper jobs of `job`: the ids in `known` and every live job of this
    user named ``bv-grow-JOB`` (`job` itself never), then check with squeue that none is
    left. Retries, pausing 0.5 s doubling to 8 s, while slurmctld does not answer, until
    `until` (monotonic; default RELEASE_S from now). Returns what may still be left: [] when
    squeue confirmed none, else the ids (or the name, when squeue never answered)."""
    until = time.monotonic() + RELEASE_S if until is None else until
    cancel = [j for j in dict.fromkeys(known) if j and j != job]
    left: list[str] = [*cancel] or [helper_name(job)]
    pause = RELEASE_PAUSE_S
    while True:
        budget = max(1.0, min(30.0, until - time.monotonic()))
        answered = True
        if cancel:
            # 0, or "already completing/invalid job id": squeue below says what is left.
            answered = run(["scancel", *cancel], budget, None).answered
        if answered:
            live = run(["squeue", "-h", "-u", str(os.getuid()), "-n", helper_name(job), "-t",
                        LIVE_STATES, "-o", "%i"], budget, None)
            if live.ok:
                left = [j for j in live.stdout.split() if j.isdigit() and j != job]
                if not left:
                    return []
                cancel = left
        if time.monotonic() + pause > until:
            logger.warning("grow helper(s) of job %s may be left: %s", job, ",".join(left))
            return left
        time.sleep(pause)
        pause = min(pause * 2, 8.0)


def grow(job: str, keep: Sequence[str], lost: Sequence[str], deadline_s: float,
         run: Runner = run_cli, count: int = 1, alive: bool = False) -> GrowResult:
    """Let go of `lost`, then add `count` node(s) to `job`; `keep` are the nodes it keeps.
    `alive` (a hung rank's node, which still answers): let go of `lost` only once a node is
    granted (a grow that finds none leaves the job as it was).

    Never raises for Slurm's answers: a failed step returns a GrowResult with `why`. Every
    path ends with `release_helpers`: no helper job is left behind that squeue can see."""
    start = time.monotonic()
    helpers: list[str] = []
    released: list[str] = []
    # Slurm writes slurm_job_<id>_resize.{sh,csh} into the working directory of the
    # `scontrol update` that resizes: a private directory, not the job's.
    with tempfile.TemporaryDirectory(prefix="bv-grow-") as tmp, _stop_on_signal() as guard:
        try:
            try:
                res = _grow(job, keep, lost, deadline_s, run, tmp, count, helpers, released,
                            start, alive)
            finally:
                guard.armed = False
        except _Ending as exc:
            res = GrowResult([], {}, time.monotonic() - start,
                             f"the job is ending ({exc}): grow stopped")
        left = release_helpers(job, helpers, max(start + deadline_s,
                                                 time.monotonic() + RELEASE_S), run)
    res.left, res.released = left, released
    if left and not res.ok:
        res.why += f"; helper job(s) {','.join(left)} may be left (slurmctld did not answer)"
    return res


def _fields(run: Runner, job: str) -> tuple[dict[str, str], str]:
    call = run(job_fields_argv(job), 30, None)
    fields = parse_job_fields(call.stdout, job) if call.ok else {}
    return fields, call.why or "no such job"


def _grow(job: str, keep: Sequence[str], lost: Sequence[str], deadline_s: float,
          run: Runner, tmp: str, count: int, helpers: list[str], released: list[str],
          start: float, alive: bool = False) -> GrowResult:

    def fail(why: str) -> GrowResult:
        return GrowResult([], {}, time.monotonic() - start, why)

    cfg = run(["scontrol", "show", "config"], 30, None)
    if not cfg.ok:
        return fail(f"scontrol show config: {cfg.why}")
    problem = support_problem(parse_config(cfg.stdout))
    if problem is not None:
        return fail(problem)
    fields, err = _fields(run, job)
    if not fields:
        return fail(f"squeue -j {job}: {err}")
    if fields.get("JobState") != "RUNNING":
        return fail(f"job {job} is {fields.get('JobState')}, not RUNNING")
    shape = shape_of(fields)
    if lost and keep and not alive:
        # The dead node out first: the job stays COMPLETING on it otherwise (SlurmdTimeout).
        if (why := _let_go(job, keep, lost, run, tmp, start + deadline_s, released)):
            return fail(why)
    left = deadline_s - (time.monotonic() - start)
    if left < 1:
        return fail(f"no time left of the {deadline_s:g} s deadline")
    alloc = run(salloc_argv(job, shape, [*lost, *keep], left, count), left + 15, None)
    said = alloc.stderr + alloc.stdout
    new = granted_job(said)
    if new is not None:
        helpers.append(new)  # granted or pending: cancelled by grow() whatever happens next
    if not alloc.ok or new is None or "Granted" not in said:
        return fail(f"no node granted in {deadline_s:g} s ({alloc.why or 'salloc granted none'})")
    if lost and keep and alive:
        # A node is granted: now let go of the live one it replaces. Before the merge: once
        # a job has taken a node, 22.05 without accounting refuses its `update NodeList=`.
        if (why := _let_go(job, keep, lost, run, tmp, start + deadline_s, released)):
            return fail(why)
    res = _take_node(job, new, keep, run, tmp, helpers, start + deadline_s, fail)
    res.seconds = time.monotonic() - start
    return res


def _let_go(job: str, keep: Sequence[str], lost: Sequence[str], run: Runner, tmp: str,
            until: float, released: list[str]) -> str | None:
    """`scontrol update NodeList=keep`: the job lets go of `lost`; why not, or None."""
    upd = run(["scontrol", "update", f"JobId={job}", f"NodeList={','.join(keep)}"],
              _until(until), tmp)
    if not upd.ok:
        return f"letting go of {','.join(lost)}: {upd.why}"
    # A second `update NodeList=` of this job is refused for good on 22.05 without
    # accounting ("the DB index is being set"): the requeue path must not repeat it.
    released.extend(lost)
    return None


def _take_node(job: str, new: str, held: Sequence[str], run: Runner, tmp: str,
               helpers: list[str], until: float,
               fail: Callable[[str], GrowResult]) -> GrowResult:
    """Move the node of the granted helper job `new` into `job`, which holds `held`."""
    # Should every process of ours die from here on, the helper holds its node minutes, not
    # the job's remaining time (users may shorten their own jobs; the merge is unaffected).
    cut = run(["scontrol", "update", f"JobId={new}", f"TimeLimit={HELPER_HOLD_MIN}"], 30, tmp)
    if not cut.ok:
        logger.warning("could not shorten grow helper %s: %s", new, cut.why)
    info, _ = _fields(run, new)
    added = _expand_nodes(info.get("NodeList", ""))
    bye = run(["scontrol", "update", f"JobId={new}", "NumNodes=0"], 30, tmp)
    if not bye.ok:
        return fail(f"scontrol update JobId={new} NumNodes=0: {bye.why}")
    if run(["scancel", new], 30, None).answered:  # 0, or already ended by NumNodes=0 (22.05)
        helpers.remove(new)
    # On 22.05 `NumNodes=0` on the helper job already moves its node to JOB ("killing JobId=NEW
    # and moving all resources to JobId=JOB"); `NumNodes=ALL` on JOB is then only needed where
    # that did not happen, and without accounting it is refused for good ("the DB index is
    # being set"), each try costing slurmctld's 5 s wait.
    fields, _ = _fields(run, job)
    now = _expand_nodes(fields.get("NodeList", ""))
    env: dict[str, str] = {}
    if not added or not set(added) <= set(now):
        _resize_env(tmp, job)  # the one the shrink above wrote
        merge = run(["scontrol", "update", f"JobId={job}", "NumNodes=ALL"], _until(until), tmp)
        if not merge.ok:
            return fail(f"scontrol update JobId={job} NumNodes=ALL: {merge.why}")
        env = _resize_env(tmp, job)
        fields, _ = _fields(run, job)
        now = _expand_nodes(fields.get("NodeList", ""))
    added = [n for n in now if n not in held]
    if not added:
        return fail("the job did not take the new node")
    return GrowResult(added, _node_env(env, fields, now), 0.0, helper=new)


def _resize_env(tmp: str, job: str) -> dict[str, str]:
    """The variables of the resize script Slurm wrote for `job` into `tmp`, which is then
    removed (the next resize writes its own)."""
    resize = Path(tmp) / f"slurm_job_{job}_resize.sh"
    try:
        return parse_resize(resize.read_text())
    except OSError:
        return {}
    finally:
        resize.unlink(missing_ok=True)


def _node_env(env: dict[str, str], fields: dict[str, str], now: Sequence[str]) -> dict[str, str]:
    """`env` (a resize script's), with the job's nodes from squeue where it says none."""
    env = dict(env)
    env.setdefault("SLURM_JOB_NODELIST", fields.get("NodeList", ""))
    env.setdefault("SLURM_NODELIST", fields.get("NodeList", ""))
    env.setdefault("SLURM_JOB_NUM_NODES", str(len(now)))
    env.setdefault("SLURM_NNODES", str(len(now)))
    return env


def _until(until: float) -> float:
    """The bound of a job update that may be refused for a moment right after an allocation
    ("Job update not available right now, the DB index is being set"; the seam retries it):
    until `until` (monotonic), 30 s at least."""
    return max(30.0, until - time.monotonic())


def _once(argv: Sequence[str], timeout: float, cwd: str | None = None) -> SlurmCall:
    return run_slurm(argv, timeout_s=timeout, cwd=cwd)


def readiness(deadline_s: float, run: Runner = _once) -> str | None:
    """For `bv site validate`: a one-line note when the site asks for growth
    (launch.grow_deadline_s > 0) that this Slurm cannot give, or None when all is well. One
    try of `scontrol show config` (a person waits for it; no job does)."""
    if deadline_s <= 0:
        return None
    cfg = run(["scontrol", "show", "config"], 30, None)
    if not cfg.ok:
        return (f"launch.grow_deadline_s is {deadline_s:g} s, but whether Slurm can grow jobs "
                f"is unknown (scontrol show config: {cfg.why or 'failed'})")
    fields = parse_config(cfg.stdout)
    problem = support_problem(fields)
    if problem is None:
        return None
    version = fields.get("SLURM_VERSION", "?")
    return (f"launch.grow_deadline_s is {deadline_s:g} s, but {problem} (Slurm {version}): "
            "a node lost without a spare is requeued instead")
