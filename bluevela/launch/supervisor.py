"""The in-job supervisor: what a `bv submit` batch script `exec`s on the job's first node.

    python3 -P -m bluevela.launch.supervisor --nodes=N [--spare-nodes=S] [--min-nodes=M]
        [--hang-timeout=T] -- torchrun --nproc-per-node=K ... script args

It runs one training STEP at a time: ``srun`` starts one *node agent* per node
(bluevela/launch/agent.py), each agent keeps a TCP connection to the supervisor (hello, a ping
every fifth of the node timeout, 1-5 s, its exit status) and runs ``torchrun`` once told the rendezvous port. The
supervisor adds torchrun's rendezvous per step: torch's static rendezvous (c10d with
``--max-restarts`` above 0), the store on the step's first node, on a port that node's agent
found free there, each node told its rank with the go. What it does (docs/resilience.md, "What bv does inside
the job"):

- Only the step's own processes can speak to it (bluevela/launch/step.py, over
  bluevela/protocol/): a new secret per step, signed lines and beats, bounded connections
  ("Who can speak to the supervisor").
- Per attempt, one banner line in the job output before the step starts, and an end line
  when the attempt ends for a reason it knows (bluevela/launch/attempts.py).
- SIGUSR1 (Slurm's ``--signal=B:USR1@N`` before the time limit, or an operator's
  ``scancel --batch --signal=USR1``): every agent sends SIGUSR1 to its torchrun WORKERS (never
  the torchrun agent, which dies of signals it does not handle); when the step has ended the
  supervisor runs ``scontrol requeue`` on its own job (same id, restart count + 1).
- SIGTERM (scancel, ``scontrol requeue``, preemption): Slurm signals every process of the job
  itself; the supervisor forwards SIGUSR1 as well and lets Slurm finish, never requeueing.
- A lost node (its agent's connection closed, or silent for ``--node-timeout``): the step is
  aborted at once (agents on healthy nodes kill their torchrun, the hung ``srun`` is killed
  locally) and a new step starts in the SAME allocation without the lost node: on a spare node
  (``--spare-nodes``: any job kind), or on fewer nodes (``--min-nodes``: data parallel only).
  Neither waits for SlurmdTimeout nor for the requeue hold (cred_expire). With no node to
  spare, the job lets go of the lost node (``scontrol update NodeList=``) and, where the site
  allows it (``--grow-deadline``, site.yaml ``launch.grow_deadline_s``; Slurm's
  ``permit_job_expansion``), GROWS by one node (bluevela/launch/grow.py) and relaunches on
  it: same job, no requeue. Else, or when no node comes by the deadline, it is requeued
  through Slurm at once (it then waits for cred_expire, not for SlurmdTimeout); the end line
  says why it did not grow.
- Hang watchdog (``--hang-timeout``): ranks call `bluevela.runtime.progress(step)` (UDP beats);
  when a rank that reported falls silent, or no rank reports, for that long, the step is
  aborted; the end line names the rank and node that stopped first. When every node answers
  the abort, the step is relaunched in place (a spare instead of the hung rank's node when
  the allocation has one; with none left and growth on, a node grown in its place), without
  a Slurm requeue.

A rank failure on nodes that are all alive ends the job with that exit status (torchrun's
``--max-restarts`` is the in-place retry for those): a bug must not loop through requeues.

Which of these follows a step is one pure function (bluevela/launch/policy.py); this module
does what it says: the step (bluevela/launch/step.py), the grow, the Slurm calls (through
bluevela/slurm/jobctl.py). Building a `Supervisor` opens nothing; `start()` binds its ports.

Standard library only (it must not import torch): it runs as the job's main process.
"""

from __future__ import annotations

import argparse
import enum
import errno
import logging
import os
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

from bluevela.goodput.outcome import Loss, StepEnd
from bluevela.launch import warm
from bluevela.launch.agent import (
    PING_ENV,
    RDZV_ENDPOINT_ENV,
    RDZV_NODE_ENV,
    STATIC_FLAG,
    SUPERVISOR_ENV,
    agent_argv,
)
from bluevela.launch.attempts import (
    History,
    banner,
    compress,
    end_line,
    expand,
    one_line,
    previous_cause,
    read_history,
    record_line,
)
from bluevela.launch.events_log import EventLog
from bluevela.launch.grow import grow as grow_job
from bluevela.launch.grow import release_helpers
from bluevela.launch.policy import (
    Allocation,
    Exit,
    Grow,
    Grown,
    JobSignal,
    PolicyOptions,
    Relaunch,
    Requeue,
    choose_nodes,
    next_action,
)
from bluevela.launch.step import (
    Endpoints,
    Signals,
    Step,
    StepConfig,
    StepState,
    check_transition,
    log,
)
from bluevela.launch.step_result import StepResult
from bluevela.launch.usr1_wait import LimitClock
from bluevela.protocol.keys import SECRET_ENV, agg_key, beat_key, derive, new_secret
from bluevela.runtime.heartbeat import ENV_ADDR as HEARTBEAT_ENV
from bluevela.runtime.heartbeat import INTERVAL_ENV as BEAT_INTERVAL_ENV
from bluevela.runtime.world import STEP_NODELIST_ENV, STEP_NUM_NODES_ENV
from bluevela.slurm.jobctl import SLURM_RETRY_FOR_S, SLURM_TIMEOUT_S, JobControl

logger = logging.getLogger(__name__)

ATTEMPT_ENV = "BV_ATTEMPT"
UNSET_ON_RESIZE = ("SLURM_NPROCS", "SLURM_NTASKS", "SLURM_TASKS_PER_NODE")
# torchrun's rendezvous, in the environment only (/proc/PID/environ: the owner and root).
RDZV_ID_ENV = "PET_RDZV_ID"
# torchrun's static rendezvous from the environment: the agent sets the node's rank; the
# store's address is the endpoint. A job's own values would make another node the host.
STATIC_ENV = ("PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT")
REQUEUE_WAIT_S = 300.0  # after a requeue, for Slurm's SIGTERM


# --------------------------------------------------------------------------------------------
# Pure pieces (unit-tested)


def torchrun_step_argv(base: Sequence[str], nodes: Sequence[str]) -> list[str]:
    """torchrun's argv for one step: the node count and the rendezvous backend inserted after
    the program word. Nothing that names the rendezvous store is on it (argv is world-readable
    in /proc): its id and endpoint go in the environment (`rdzv_env`, `agent.endpoint_env`),
    and each node's rank with the agent's ``go`` (``PET_NODE_RANK``).

    The backend is torch's static rendezvous (issue 37): the supervisor knows the step's
    world (its nodes in order, the store on the first), so each torchrun is told its node rank
    and the first node's agent makes the store; no join loop polls it once a second. A command
    with ``--max-restarts`` above 0 keeps c10d: a static rendezvous does not restart the other
    nodes' workers with a failed node's (its ``num_nodes_waiting`` is always 0, and a restart
    meets no barrier), so the restarted ranks' process group can form without their peers and
    fail (gloo's connect gives up) where c10d's new round restarts every node together."""
    backend = "--rdzv-backend=c10d" if max_restarts(base) > 0 else STATIC_FLAG
    return [base[0], f"--nnodes={len(nodes)}", backend, *base[1:]]


def max_restarts(argv: Sequence[str]) -> int:
    """torchrun's ``--max-restarts`` in `argv` (either spelling, ``=N`` or a separate word;
    the last one wins, as argparse's); 0 when absent or not a number."""
    found = 0
    for i, word in enumerate(argv):
        name, eq, value = word.partition("=")
        if name not in ("--max-restarts", "--max_restarts"):
            continue
        if not eq:
            value = argv[i + 1] if i + 1 < len(argv) else ""
        found = int(value) if value.isdigit() else 0
    return found


def new_rdzv_id() -> str:
    """A rendezvous id no one else can learn or guess: 128 random bits, new for every step.
    torchrun keeps its pickled rendezvous state in the store under a key made of it."""
    return secrets.token_hex(16)


def rdzv_env(rdzv_id: str, rdzv_node: str) -> dict[str, str]:
    """What the step's agents and torchruns read instead of command-line flags: torchrun takes
    any option from ``PET_<OPTION>`` when it is not on its command line (its ``env`` action)."""
    return {RDZV_ID_ENV: rdzv_id, RDZV_NODE_ENV: rdzv_node}


def beat_interval(hang_timeout: float) -> float:
    """Seconds between a rank's beats to its agent and between the agent's aggregates to the
    supervisor: an eighth of the hang timeout, 0.25 to 10 s (1 s without a watchdog). A
    healthy rank's record at the supervisor is then never more than about timeout/4 old (a
    beat interval at the rank, one at the agent: no false hang, a short timeout included), a
    stuck rank's last progress is exact whatever the interval (the ages travel with it), and
    a big job with a long timeout sends a fraction of the datagrams (docs/scale.md)."""
    return 1.0 if hang_timeout <= 0 else min(10.0, max(0.25, hang_timeout / 8))


def ping_interval(node_timeout: float) -> float:
    """Seconds between an agent's pings: a fifth of the node timeout, 1 to 5 s (at least four
    pings within the timeout: a live node is never declared silent; 1,024 agents pinging
    every second were a third of the supervisor's steady CPU, docs/scale.md)."""
    return min(5.0, max(1.0, node_timeout / 5))


def ranks_bound(torchrun: Sequence[str], nodes: int) -> int:
    """How many ranks a step can have: nodes x torchrun's --nproc-per-node (1024 per node when
    it is not a number, e.g. `gpu`). Beats naming a rank beyond it are dropped."""
    return world_size(torchrun, nodes) or max(1, nodes * 1024)


def world_size(torchrun: Sequence[str], nodes: int) -> int | None:
    """The step's exact world size when torchrun's --nproc-per-node is a number (1 to 1024),
    else None (`gpu`, `auto`, or not given: not known here)."""
    per_node: str | None = None
    words = list(torchrun)
    for i, word in enumerate(words):
        for flag in ("--nproc-per-node", "--nproc_per_node"):
            if word.startswith(flag + "="):
                per_node = word.split("=", 1)[1]
            elif word == flag and i + 1 < len(words):
                per_node = words[i + 1]
    if per_node is None or not per_node.isdigit() or not 1 <= int(per_node) <= 1024:
        return None
    return max(1, nodes * int(per_node))


def open_files_for(nodes: int) -> str | None:
    """Raise this process's soft limit of open files to what `nodes` agents' connections
    need (Slurm gives the job the submit shell's limits: often 1,024, which a 1,024-node job
    exceeds and then accepts no more agents). Within the hard limit; a line when even that
    is short, else None."""
    import resource

    need = 2 * nodes + 64
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return None
    new = need if hard == resource.RLIM_INFINITY else min(hard, need)
    if new > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
        except (ValueError, OSError):
            new = soft
    if new < need:
        return (f"at most {new} open files (ulimit -n, hard limit {hard}); {nodes} nodes need "
                f"{need}: agents past that cannot connect")
    return None


def history_of_stdout() -> History | None:
    """Scan our own stdout (the job's --output file, opened for append) for earlier banners."""
    try:
        path = os.readlink("/proc/self/fd/1")
        if not path.startswith("/") or not Path(path).is_file():
            return None
        with open(path, "rb") as fh:
            return read_history(fh)
    except OSError:
        return None


# --------------------------------------------------------------------------------------------
# Supervisor


@dataclass
class Options:
    nodes: int
    spare_nodes: int = 0
    min_nodes: int | None = None
    hang_timeout: float = 0.0
    node_timeout: float = 10.0
    connect_timeout: float = 120.0
    settle_s: float = 2.0
    abort_grace_s: float = 5.0
    max_relaunches: int = 8
    grow_deadline: float = 0.0  # seconds to wait for a grown node; 0: no growth (requeue)
    slurm_timeout: float = SLURM_TIMEOUT_S
    slurm_retry_for: float = SLURM_RETRY_FOR_S
    torchrun: list[str] = field(default_factory=list)

    def policy(self) -> PolicyOptions:
        min_nodes = self.min_nodes if self.min_nodes is not None else self.nodes
        return PolicyOptions(self.nodes, min_nodes, self.max_relaunches, self.grow_deadline > 0)

    def step(self) -> StepConfig:
        return StepConfig(self.settle_s, self.node_timeout, self.connect_timeout,
                          self.abort_grace_s, self.hang_timeout)


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


class Phase(enum.Enum):
    """Where the supervisor is. A phase changes only as `TRANSITIONS` allows (`_to`). In each
    one a signal reaches the decision the same way: its number lands in the wakeup pipe, and
    `Signals.take` (a step's pump, after a grow, a requeue's wait) puts it in `Signals.seen`,
    which the policy reads (`Allocation.signal`)."""

    LAUNCHING = "launching"  # choosing the step's nodes, starting srun
    STEPPING = "stepping"  # a step runs (its own phases: step.StepPhase), then the policy
    GROWING = "growing"  # asking Slurm for a node (grow.py); SIGTERM stops it
    REQUEUEING = "requeueing"  # letting go of lost nodes, scontrol requeue, waiting for Slurm
    EXITING = "exiting"  # the one way out: endpoints, signals' pipe and event log closed


TRANSITIONS: dict[Phase, frozenset[Phase]] = {
    Phase.LAUNCHING: frozenset({Phase.STEPPING, Phase.EXITING}),
    Phase.STEPPING: frozenset({Phase.LAUNCHING, Phase.GROWING, Phase.REQUEUEING,
                               Phase.EXITING}),
    Phase.GROWING: frozenset({Phase.LAUNCHING, Phase.REQUEUEING, Phase.EXITING}),
    Phase.REQUEUEING: frozenset({Phase.EXITING}),
    Phase.EXITING: frozenset(),
}


class Supervisor:
    """The job's attempts: one step per launch, then what `policy.next_action` says.

    Building one reads the environment only; `start()` (run() calls it) makes the signals'
    pipe and binds the agents' and the ranks' ports."""

    def __init__(self, opts: Options, env: dict[str, str] | None = None) -> None:
        self.opts = opts
        self.env = dict(os.environ if env is None else env)
        # A step's secret and rendezvous are made by run_step, never inherited.
        for name in (SECRET_ENV, RDZV_ID_ENV, RDZV_ENDPOINT_ENV, RDZV_NODE_ENV, *STATIC_ENV):
            self.env.pop(name, None)
        self.job = self.env.get("SLURM_JOB_ID", "0")
        self.host = socket.gethostname()
        nodelist = self.env.get("SLURM_JOB_NODELIST") or self.env.get("SLURM_NODELIST") or ""
        self.alloc = expand(nodelist) if nodelist else [self.host]
        self.excluded: dict[str, Loss] = {}
        self.signals: Signals | None = None  # start()
        self.ends: Endpoints | None = None  # start()
        # Goodput events (bluevela/launch/events_log.py): off until run() opens the file.
        self.events = EventLog(None, self.host)
        self.slurm = JobControl(self.job, self.env, timeout_s=opts.slurm_timeout,
                                retry_for_s=opts.slurm_retry_for, wait=self._wait_stop)
        # The job's time limit, read once at the first SIGUSR1 (the agents' wait for a
        # handler follows the time left: bluevela/launch/usr1_wait.py).
        self.clock = LimitClock(self.slurm.time_left)
        self.phase = Phase.LAUNCHING
        self.grown: Grown | None = None  # the last grow's outcome (the attempt's record)
        # The warm servers' step (site.yaml launch.warm_start; launch/warm.py), for the job.
        self.warm_servers: subprocess.Popen[bytes] | None = None

    def _to(self, phase: Phase) -> None:
        check_transition(TRANSITIONS, self.phase, phase)
        self.phase = phase

    def start(self) -> tuple[Signals, Endpoints]:
        """The signals' pipe, and the ports the step's agents and ranks reach."""
        if self.signals is None or self.ends is None:
            if (short := open_files_for(len(self.alloc))) is not None:
                log(short)
            self.signals = Signals()
            self.ends = Endpoints(self.alloc, self.host, self.signals)
        return self.signals, self.ends

    def close(self) -> None:
        if self.ends is not None:
            self.ends.close()
        if self.signals is not None:
            self.signals.close()
        self.ends = self.signals = None

    def _wait_stop(self, seconds: float) -> bool:
        if self.signals is None:
            time.sleep(seconds)
            return False
        return self.signals.wait_stop(seconds)

    # -- attempts --------------------------------------------------------------------------
    def run(self) -> int:
        """The job's attempts; whatever ends them (a return, an exception) goes through
        EXITING: the endpoints, the signals' pipe and the event log are closed."""
        try:
            return self._attempts()
        finally:
            if self.phase is not Phase.EXITING:
                self._to(Phase.EXITING)
            warm.stop_servers(self.warm_servers)
            self.events.close()
            self.close()

    def _attempts(self) -> int:
        signals, _ = self.start()
        signals.install()
        self.events = EventLog.open(self.env, self.host)
        attempt, cause = self._history()
        if self.opts.grow_deadline > 0 and attempt > 0:
            # An earlier run of this job (same id) killed mid-grow may have left a helper job
            # (bv-grow-JOB) pending on `expand:` this job: cancel it before it gets a node.
            release_helpers(self.job, (), time.monotonic() + 5)
        rules = self.opts.policy()
        nodes = choose_nodes(self.alloc, self.excluded, rules.want, rules.min_nodes)
        if nodes is None:
            log(f"the allocation has {len(self.alloc)} node(s) ({compress(self.alloc)}), "
                f"the job needs {rules.min_nodes}")
            return 1
        # Before the first step: every node of the allocation, spares included, gets its
        # warm parent while the first step runs, so that a relaunch finds it ready.
        self.warm_servers = warm.start_servers(self.alloc, self.env, first=nodes)
        launch = 0
        while True:
            launch += 1
            attempt += 1
            _say(banner(attempt, self.job, nodes, cause))
            self._to(Phase.STEPPING)
            result = self.run_step(attempt, launch, nodes)
            self.events.step_ended(result.kind, result.cause, result.lost, result.failed_at,
                                   result.detected_at, time.monotonic(), hung=result.hang_node)
            self.grown = None
            action = self.decide(result, nodes, launch)
            if isinstance(action, Requeue):
                return self.requeue(attempt, action.cause, action.release)
            _say(end_line(attempt, action.cause))
            if isinstance(action, Exit):
                _say(record_line(attempt, "exit"))
                self._to(Phase.EXITING)
                return action.rc
            grown = self.grown if self.grown is not None and self.grown.ok else None
            _say(record_line(attempt, "relaunch", grown.added if grown else (),
                             grown.seconds if grown else None))
            self._to(Phase.LAUNCHING)
            nodes, cause = list(action.nodes), action.cause

    def _history(self) -> tuple[int, str]:
        """Attempts before this run, and why the last one ended."""
        history = history_of_stdout()
        if history is not None:
            return history.attempts, previous_cause(history)
        attempt = int(self.env.get("SLURM_RESTART_COUNT") or 0)
        return attempt, "none" if attempt == 0 else "requeued by Slurm"

    def decide(self, result: StepResult, nodes: Sequence[str],
               launch: int) -> Exit | Requeue | Relaunch:
        """`policy.next_action`, with the grow it may ask for done here."""
        def ask(grown: Grown | None) -> Exit | Requeue | Relaunch | Grow:
            # Signals that came since the step's last pump (during the grow above all): the
            # policy's answer follows them (SIGTERM: exit; SIGUSR1: requeue).
            seen = None
            if self.signals is not None:
                self.signals.take()
                if self.signals.seen is not None:
                    seen = (JobSignal.STOP if self.signals.stopping()
                            else JobSignal.CHECKPOINT)
            alloc = Allocation(tuple(self.alloc), dict(self.excluded), tuple(nodes), launch,
                               grown, seen)
            action = next_action(result, alloc, self.opts.policy())
            if not isinstance(action, Exit):
                self.excluded.update(action.exclude)
            return action

        action = ask(None)
        if isinstance(action, Grow):
            self._to(Phase.GROWING)
            self.grown = self.grow(action)
            action = ask(self.grown)
        assert not isinstance(action, Grow)  # the policy asks for one grow at most
        return action

    def grow(self, want: Grow) -> Grown:
        """Add nodes to this job in place of the lost ones, or of a hung rank's (`alive`:
        let go of only once the new node is in; bluevela/launch/grow.py); on success the
        allocation and the SLURM_* variables of the next srun follow, and the job's events
        name the helper job whose id the new node's prolog ran under (the archive gives that
        prolog to this job)."""
        log(f"growing job {self.job} by {want.count} node(s) in place of {compress(want.lost)} "
            f"(deadline {self.opts.grow_deadline:g} s)")
        res = grow_job(self.job, list(want.keep), list(want.lost), self.opts.grow_deadline,
                       count=want.count, alive=want.alive)
        if not res.ok:
            log(f"no node grown: {res.why}")
            return Grown(why=res.why, released=tuple(res.released))
        self.alloc = [*want.keep, *(n for n in res.added if n not in want.keep)]
        env = {"SLURM_JOB_NODELIST": compress(self.alloc), "SLURM_NODELIST": compress(self.alloc),
               "SLURM_JOB_NUM_NODES": str(len(self.alloc)), "SLURM_NNODES": str(len(self.alloc))}
        env.update(res.env)  # Slurm's own resize script wins where it says more
        self.env.update(env)
        for name in UNSET_ON_RESIZE:  # as Slurm's resize script does: srun recomputes them
            self.env.pop(name, None)
        log(f"grew job {self.job} by {compress(res.added)} in {res.seconds:.1f} s")
        self.events.grown(res.helper, list(res.added))
        return Grown(tuple(res.added), res.seconds, "", tuple(res.released))

    def requeue(self, attempt: int, cause: str, release: Sequence[str] = ()) -> int:
        """`scontrol requeue` this job. With lost nodes to let go of, the allocation is first
        shrunk to the nodes that answer (`scontrol update NodeList=`): otherwise the job stays
        COMPLETING until Slurm declares the dead node DOWN (SlurmdTimeout). The node let go
        stays COMPLETING (its epilog never ends) until it is DOWN, so the next attempt is not
        placed on it meanwhile."""
        self._to(Phase.REQUEUEING)
        _say(end_line(attempt, cause))
        _say(record_line(attempt, "requeue"))
        self.events.requeue()
        keep = [n for n in self.alloc if n not in self.excluded]
        if release and keep:
            done = self.slurm.keep_only(compress(keep))
            if done.terminated:
                return 0  # Slurm is ending the job
            if not done.ok:
                log(f"scontrol update JobId={self.job} NodeList={compress(keep)} failed "
                    f"({done.describe()})")
        done = self.slurm.requeue()
        if done.terminated:
            return 0  # Slurm is ending the job (the requeue took, or a cancel): let it
        if not done.ok:
            why = (f"scontrol requeue {self.job} failed ({done.describe()}): the job ends "
                   "here, not requeued")
            log(why)
            _say(end_line(attempt, why))
            _say(record_line(attempt, "exit"))
            return 1
        # Slurm now ends this allocation (SIGTERM, then SIGKILL): wait for it rather than exit
        # first (an early exit could end the job before the requeue takes effect).
        self._wait_stop(REQUEUE_WAIT_S)
        return 0

    # -- one step --------------------------------------------------------------------------
    def srun_argv(self, nodes: Sequence[str], launch: int) -> list[str]:
        return [
            "srun", f"--nodes={len(nodes)}", f"--ntasks={len(nodes)}", "--ntasks-per-node=1",
            f"--nodelist={','.join(nodes)}", "--export=ALL",
            *(["--overlap"] if launch > 1 else []),
            *agent_argv(), *torchrun_step_argv(self.opts.torchrun, nodes),
        ]

    def step_env(self, attempt: int, nodes: Sequence[str], secret: str) -> dict[str, str]:
        """The step's environment: the job's, the supervisor's addresses, the secret, the
        training world and the rendezvous (bluevela/runtime/world.py, docs/resilience.md)."""
        _, ends = self.start()
        env = dict(self.env)
        env[SUPERVISOR_ENV] = ends.line_addr()
        env[HEARTBEAT_ENV] = ends.beat_addr()
        env[BEAT_INTERVAL_ENV] = f"{beat_interval(self.opts.hang_timeout):g}"
        env[PING_ENV] = f"{ping_interval(self.opts.node_timeout):g}"
        env[ATTEMPT_ENV] = str(attempt)
        env[STEP_NODELIST_ENV] = compress(nodes)
        env[STEP_NUM_NODES_ENV] = str(len(nodes))
        env[SECRET_ENV] = secret  # the environment only: argv is world-readable in /proc
        # Whoever knows the store's key can write torchrun's pickled state, which every agent
        # unpickles: code execution as the job's user. So the id is random, and like the
        # endpoint it travels in the environment, never on srun's, the agent's or torchrun's argv.
        env.update(rdzv_env(new_rdzv_id(), nodes[0]))
        return env

    def run_step(self, attempt: int, launch: int, nodes: list[str]) -> StepResult:
        signals, ends = self.start()
        # A new secret per step: a straggler of an aborted step cannot speak in the next one.
        secret = new_secret()
        env = self.step_env(attempt, nodes, secret)
        key = bytes.fromhex(secret)
        st = StepState(nodes=list(nodes), started=time.monotonic(),
                       line_key=derive(key, b"line"), beat_key=beat_key(key),
                       agg_key=agg_key(key),
                       max_ranks=ranks_bound(self.opts.torchrun, len(nodes)),
                       world=world_size(self.opts.torchrun, len(nodes)))
        spares = len([n for n in self.alloc if n not in self.excluded]) - len(nodes)
        self.events.launch(attempt, launch, nodes, spares, st.started)
        try:
            srun = subprocess.Popen(self.srun_argv(nodes, launch), env=env,
                                    stdin=subprocess.DEVNULL)
        except OSError as exc:
            return StepResult(StepEnd.FAILED, 127 if exc.errno == errno.ENOENT else 126,
                              f"cannot start srun: {exc.strerror or exc}")
        return Step(st, srun, ends, signals, self.events, self.host, self.opts.step(),
                    self.clock).run()


# --------------------------------------------------------------------------------------------
# Entry


class _OneLineParser(argparse.ArgumentParser):
    """Bad arguments end in one line on stderr and exit 2 (no usage block, no traceback)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"bv supervisor: {one_line(message)}\n")


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = _OneLineParser(prog="python -m bluevela.launch.supervisor",
                            description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--nodes", type=int, required=True, help="training nodes per step")
    parser.add_argument("--spare-nodes", type=int, default=0)
    parser.add_argument("--min-nodes", type=int, default=None)
    parser.add_argument("--hang-timeout", type=float, default=0.0)
    parser.add_argument("--node-timeout", type=float, default=10.0)
    parser.add_argument("--grow-deadline", type=float, default=0.0)
    parser.add_argument("--slurm-timeout", type=float, default=SLURM_TIMEOUT_S,
                        help="seconds one try of a Slurm command (scontrol) may take")
    parser.add_argument("--slurm-retry-for", type=float, default=SLURM_RETRY_FOR_S,
                        help="seconds all tries of one Slurm call may take")
    # Ignored: batch scripts written before issue 16 still pass it; the rendezvous port is now
    # a free one picked on the step's first node for every step.
    parser.add_argument("--rdzv-port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("torchrun", nargs=argparse.REMAINDER)
    args = parser.parse_args(list(argv))
    if args.torchrun and args.torchrun[0] == "--":
        args.torchrun = args.torchrun[1:]
    if not args.torchrun:
        parser.error("no torchrun command after --")
    if args.nodes < 1 or args.spare_nodes < 0:
        parser.error("--nodes must be >= 1 and --spare-nodes >= 0")
    if args.min_nodes is not None and not 1 <= args.min_nodes <= args.nodes:
        parser.error("--min-nodes must be between 1 and --nodes")
    inf = float("inf")
    if not (0 <= args.hang_timeout < inf and 0 < args.node_timeout < inf
            and 0 <= args.grow_deadline <= 3600 and 1 <= args.slurm_timeout <= 600
            and 1 <= args.slurm_retry_for <= 86400):
        parser.error("--hang-timeout must be >= 0, --node-timeout > 0 (finite), "
                     "--grow-deadline between 0 and 3600, --slurm-timeout between 1 and 600 "
                     "and --slurm-retry-for between 1 and 86400")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    opts = Options(nodes=args.nodes, spare_nodes=args.spare_nodes, min_nodes=args.min_nodes,
                   hang_timeout=args.hang_timeout, node_timeout=args.node_timeout,
                   grow_deadline=args.grow_deadline, slurm_timeout=args.slurm_timeout,
                   slurm_retry_for=args.slurm_retry_for, torchrun=list(args.torchrun))
    logging.basicConfig(level=logging.INFO, format="bv supervisor: %(message)s")
    return Supervisor(opts).run()


if __name__ == "__main__":
    sys.exit(main())
