"""The in-job supervisor: what a `bv submit` batch script `exec`s on the job's first node.

    python3 -P -m bluevela.launch.supervisor --nodes=N [--spare-nodes=S] [--min-nodes=M]
        [--hang-timeout=T] -- torchrun --nproc-per-node=K ... script args

It runs one training STEP at a time: ``srun`` starts one *node agent* per node
(bluevela/launch/agent.py), each agent keeps a TCP connection to the supervisor (hello, a ping
every second, its exit status) and runs ``torchrun`` once told the rendezvous port. The
supervisor adds torchrun's rendezvous flags per step: c10d on the step's first node, on a port
that node's agent found free there. What it does (docs/resilience.md, "What bv does inside
the job"):

- Only the step's own processes can speak to it (bluevela/protocol/): a new secret per
  step in the job environment, an HMAC on every line and beat, a hello only from a node of
  the step and once, caps on line size and connections, a hello deadline; a bad message drops
  that message or connection, never the supervisor ("Who can speak to the supervisor").

- Per attempt, one banner line in the job output before the step starts, and an end line
  when the attempt ends for a reason it knows (`banner()`, `end_line()`).
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
  the allocation has one), without a Slurm requeue.

A rank failure on nodes that are all alive ends the job with that exit status (torchrun's
``--max-restarts`` is the in-place retry for those): a bug must not loop through requeues.

Standard library only (it must not import torch): it runs as the job's main process.
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import re
import secrets
import selectors
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

from bluevela.launch.agent import (
    RDZV_ENDPOINT_ENV,
    RDZV_NODE_ENV,
    SUPERVISOR_ENV,
    USR1_UNCAUGHT_S,
    agent_argv,
)
from bluevela.launch.events import failure_time
from bluevela.launch.events_copy import keeper_of
from bluevela.launch.events_log import EventLog
from bluevela.launch.grow import GrowResult, release_helpers
from bluevela.launch.grow import grow as grow_job
from bluevela.launch.proctree import reap
from bluevela.protocol.channel import Channel, ChannelError, challenge_line
from bluevela.protocol.keys import SECRET_ENV, beat_key, derive, new_secret
from bluevela.protocol.messages import fresh_seq, parse_beat
from bluevela.protocol.names import printable, safe_name
from bluevela.runtime.heartbeat import ENV_ADDR as HEARTBEAT_ENV
from bluevela.runtime.world import STEP_NODELIST_ENV, STEP_NUM_NODES_ENV

logger = logging.getLogger(__name__)

BANNER_PREFIX = "==== bv attempt "
BANNER_RE = re.compile(r"^==== bv attempt (\d+) job (\S+) nodes (\S+) previous: (.*) ====$")
END_RE = re.compile(r"^==== bv attempt (\d+) ended: (.*) ====$")
ATTEMPT_ENV = "BV_ATTEMPT"
TICK_S = 0.2
UNSET_ON_RESIZE = ("SLURM_NPROCS", "SLURM_NTASKS", "SLURM_TASKS_PER_NODE")
# torchrun's rendezvous, in the environment only (/proc/PID/environ: the owner and root).
RDZV_ID_ENV = "PET_RDZV_ID"


# --------------------------------------------------------------------------------------------
# Pure pieces (unit-tested)


def one_line(text: str) -> str:
    return " ".join(text.split())


def banner(attempt: int, job: str, nodes: Sequence[str], previous: str) -> str:
    """The per-attempt banner `bv logs --attempt N` splits on (N: 1-based, file order)."""
    return f"{BANNER_PREFIX}{attempt} job {job} nodes {compress(nodes)} previous: {one_line(previous)} ===="


def end_line(attempt: int, cause: str) -> str:
    return f"{BANNER_PREFIX}{attempt} ended: {one_line(cause)} ===="


def compress(nodes: Sequence[str]) -> str:
    try:
        import hostlist

        return str(hostlist.collect_hostlist(list(nodes)))
    except Exception:  # noqa: BLE001 - a display nicety only
        return ",".join(nodes)


def expand(nodelist: str) -> list[str]:
    import hostlist

    return list(hostlist.expand_hostlist(nodelist))


@dataclass(frozen=True)
class History:
    """What earlier attempts left in the job output."""

    attempts: int = 0  # banners seen
    last_end: str | None = None  # the end line's cause after the last banner, if any


def read_history(lines: Iterable[bytes]) -> History:
    attempts, last_end = 0, None
    for raw in lines:
        if not raw.startswith(b"==== bv attempt "):
            continue
        text = raw.decode("utf-8", "replace").rstrip("\r\n")
        if BANNER_RE.match(text):
            attempts, last_end = attempts + 1, None
        elif (m := END_RE.match(text)) is not None:
            last_end = m.group(2)
    return History(attempts, last_end)


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


def previous_cause(history: History | None) -> str:
    if history is None or history.attempts == 0:
        return "none"
    if history.last_end is not None:
        return history.last_end
    return ("ended without a bv end line (Slurm ended the allocation: node failure of the "
            "batch node, time limit or cancel)")


def choose_nodes(alloc: Sequence[str], excluded: Iterable[str], want: int,
                 min_nodes: int) -> list[str] | None:
    """The nodes of the next step: `want` healthy ones in allocation order, else at least
    `min_nodes` (elastic shrink), else None (nothing to run on inside this allocation)."""
    bad = set(excluded)
    healthy = [n for n in alloc if n not in bad]
    if len(healthy) >= want:
        return healthy[:want]
    if len(healthy) >= min_nodes:
        return healthy
    return None


def torchrun_step_argv(base: Sequence[str], nodes: Sequence[str]) -> list[str]:
    """torchrun's argv for one step: the node count and the c10d backend inserted after the
    program word. Nothing that names the rendezvous store is on it (argv is world-readable in
    /proc): its id and endpoint go in the environment (`rdzv_env`, `endpoint_env`)."""
    return [base[0], f"--nnodes={len(nodes)}", "--rdzv-backend=c10d", *base[1:]]


def new_rdzv_id() -> str:
    """A rendezvous id no one else can learn or guess: 128 random bits, new for every step.
    torchrun keeps its pickled rendezvous state in the store under a key made of it."""
    return secrets.token_hex(16)


def rdzv_env(rdzv_id: str, rdzv_node: str) -> dict[str, str]:
    """What the step's agents and torchruns read instead of command-line flags: torchrun takes
    any option from ``PET_<OPTION>`` when it is not on its command line (its ``env`` action)."""
    return {RDZV_ID_ENV: rdzv_id, RDZV_NODE_ENV: rdzv_node}


def ranks_bound(torchrun: Sequence[str], nodes: int) -> int:
    """How many ranks a step can have: nodes x torchrun's --nproc-per-node (1024 per node when
    it is not a number, e.g. `gpu`). Beats naming a rank beyond it are dropped."""
    per_node: str | None = None
    words = list(torchrun)
    for i, word in enumerate(words):
        for flag in ("--nproc-per-node", "--nproc_per_node"):
            if word.startswith(flag + "="):
                per_node = word.split("=", 1)[1]
            elif word == flag and i + 1 < len(words):
                per_node = words[i + 1]
    k = int(per_node) if per_node is not None and per_node.isdigit() else 1024
    return max(1, nodes * max(1, min(k, 1024)))


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


def bind_address(alloc: Sequence[str], host: str) -> str:
    """Where the supervisor listens: loopback when the job has this one node (its only agent
    runs here), else this host's own address, never wider; 0.0.0.0 only when the hostname
    resolves to loopback (then the address agents use cannot be known here)."""
    if len(set(alloc)) == 1:
        return "127.0.0.1"
    try:
        addr = socket.gethostbyname(host)
    except OSError:
        return "0.0.0.0"
    return "0.0.0.0" if addr.startswith("127.") else addr


@dataclass
class RankBeat:
    node: str
    step: int
    last_progress: float  # monotonic time of its last progress() call (receive time - age)
    in_collective: bool = False
    where: str = "?"


@dataclass(frozen=True)
class Hang:
    rank: int
    beat: RankBeat
    silent_s: float
    waiting: int = 0  # other ranks waiting inside a collective

    def describe(self) -> str:
        b = self.beat
        state = "in a collective" if b.in_collective else "not in a collective"
        others = f"; {self.waiting} other rank(s) wait in a collective" if self.waiting else ""
        return (f"hang: rank {self.rank} on {b.node} stopped first (no progress for "
                f"{self.silent_s:.0f} s, last step {b.step}, at {b.where}, {state}){others}")


def find_hang(beats: dict[int, RankBeat], started: float, now: float,
              timeout: float) -> Hang | None:
    """A hang when a rank that reported is without progress for `timeout`. The watchdog arms at
    the first beat: start-up (imports, rendezvous, loading) has its own timeouts in torchrun
    and init_process_group, and may legitimately take longer than a short hang timeout. The
    rank named as stopped first: one NOT waiting in a collective (its peers wait for it
    there), then the oldest progress, lowest step, rank."""
    del started
    if timeout <= 0 or not beats:
        return None
    oldest = min(b.last_progress for b in beats.values())
    if now - oldest < timeout:
        return None
    rank, beat = min(beats.items(), key=lambda kv: (kv[1].in_collective, kv[1].last_progress,
                                                     kv[1].step, kv[0]))
    waiting = sum(1 for r, b in beats.items() if r != rank and b.in_collective)
    return Hang(rank, beat, now - beat.last_progress, waiting)


# --------------------------------------------------------------------------------------------
# Slurm calls: bounded and retried (the supervisor must outlive a hung or restarting slurmctld)

SLURM_TIMEOUT_S = 20.0  # one try of a Slurm command
SLURM_RETRY_FOR_S = 300.0  # all tries of one call, within the job's remaining time
BACKOFF_S = (0.5, 1.0, 2.0, 4.0, 8.0, 15.0)  # between tries, then 15 s
# Refusals that no retry changes (the job is gone or not requeueable, the user may not).
PERMANENT_SLURM_ERRORS = ("invalid job id", "access/permission denied", "presently disabled",
                          "already completing or completed", "not requeue", "invalid user")
# "Job update not available right now, the DB index is being set": with slurmdbd it clears in
# seconds; without accounting (22.05, accounting_storage/none) a second `update NodeList=` of the
# same job is refused so for good. Retried for this long only, not the call's whole budget.
SLOW_SLURM_ERRORS = ("db index is being set",)
SLOW_SLURM_RETRY_S = 30.0


@dataclass(frozen=True)
class SlurmCall:
    ok: bool
    stdout: str
    why: str  # the last try's failure, one line
    tries: int
    seconds: float
    terminated: bool = False  # Slurm's SIGTERM came while retrying

    def describe(self) -> str:
        return f"{self.tries} tr{'y' if self.tries == 1 else 'ies'} in {self.seconds:.0f} s; last: {self.why}"


def permanent_slurm_error(why: str) -> bool:
    low = why.lower()
    return any(text in low for text in PERMANENT_SLURM_ERRORS)


def retry_deadline(why: str, start: float, deadline: float) -> float:
    """The deadline of a Slurm call's tries after a failure saying `why`: a refusal that may
    never clear (SLOW_SLURM_ERRORS) is retried for SLOW_SLURM_RETRY_S from the first try."""
    if any(text in why.lower() for text in SLOW_SLURM_ERRORS):
        return min(deadline, start + SLOW_SLURM_RETRY_S)
    return deadline


def retry_budget(env: dict[str, str], retry_for: float, now: float) -> float:
    """Seconds the tries of one Slurm call may take: `retry_for`, cut to the job's remaining
    time when Slurm says it (``SLURM_JOB_END_TIME``, epoch seconds; Slurm 23.02+), less 10 s
    so the last line is written before the time limit."""
    end = env.get("SLURM_JOB_END_TIME", "")
    if end.isdigit() and len(end) <= 12:
        return max(1.0, min(retry_for, int(end) - now - 10))
    return max(1.0, retry_for)


# --------------------------------------------------------------------------------------------
# An agent's connection: signed lines over TCP (bluevela/protocol/channel.py)


class Conn:
    """An agent's connection. Pending until a signed hello names a node of the step that has
    no connection yet; dropped on any protocol error, or without a hello in HELLO_DEADLINE_S."""

    def __init__(self, sock: socket.socket, key: bytes, nonce: bytes, now: float) -> None:
        self.sock = sock
        self.chan = Channel(sock, key, nonce, b"s")
        self.opened = now
        self.node: str | None = None
        self.last_seen = now
        self.exit_rc: int | None = None
        self.signalled = 0  # workers this agent sent SIGUSR1 to (from its exit message)
        self.termed = 0  # workers without a SIGUSR1 handler, stopped with SIGTERM instead
        self.why = ""  # the agent's own reason with a failed exit (e.g. no torchrun)
        self.go_sent = False
        self.closed = False

    def send(self, msg: dict[str, object]) -> None:
        self.chan.send(msg)

    def read(self, now: float) -> list[dict[str, object]] | None:
        """Messages now readable; None on EOF/error. Raises ChannelError (drop the peer)."""
        msgs = self.chan.receive()
        if msgs:
            self.last_seen = now
        return msgs


# --------------------------------------------------------------------------------------------
# Supervisor

HELLO_DEADLINE_S = 5.0  # a connection without a signed hello by then is closed
MAX_PENDING = 64  # connections without a hello yet; the oldest goes when one more comes
# A connection accepted in one tick is read in the next three before it can be pushed out
# (64 pending / 16 a tick): an agent's hello, sent on the challenge, is read in time.
MAX_ACCEPT_PER_TICK = 16
MAX_BEATS_PER_TICK = 512  # then signals and agents get their turn (a flood cannot starve them)
# (or a quarter of the step's ranks: a turn takes 1/4 s of beats at most, with TURN_S in between)
UDP_RCVBUF = 16 << 20  # bytes asked for the beat socket's receive buffer (rmem_max caps it)
TURN_S = 0.01  # a turn woken by datagrams or agents' lines alone waits for this since the last
HANG_CHECK_S = 0.2  # the hang watchdog's look over every rank's last progress, this often
MAX_DROP_LOGS = 3  # per step; the rest are counted


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


@dataclass
class StepResult:
    kind: str  # ok | failed | lost | hang | signal | terminated
    rc: int
    cause: str
    lost: dict[str, str] = field(default_factory=dict)
    hang_node: str | None = None  # the node of the rank that stopped first


@dataclass
class StepState:
    nodes: list[str]
    started: float
    line_key: bytes = b""
    beat_key: bytes = b""
    max_ranks: int = 1
    rdzv_port: int | None = None  # reported by the rendezvous node's agent
    conns: list[Conn] = field(default_factory=list)
    beats: dict[int, RankBeat] = field(default_factory=dict)
    seqs: dict[tuple[int, int], int] = field(default_factory=dict)  # (rank, pid) -> last seq
    lost: dict[str, str] = field(default_factory=dict)
    first_failure: tuple[str, int] | None = None  # (node, rc) of the first non-zero exit
    failure_why: str = ""  # what the first failed node's agent said about it, if anything
    srun_rc: int | None = None
    srun_exit_at: float | None = None
    dropped: int = 0  # connections dropped for a protocol error
    agents: dict[str, Conn] = field(default_factory=dict)  # node -> its agent, from its hello
    members: frozenset[str] = field(init=False, default=frozenset())  # `nodes`, for lookups

    def __post_init__(self) -> None:
        self.members = frozenset(self.nodes)

    def by_node(self) -> dict[str, Conn]:
        """Each node's agent (set at its hello, kept once closed): not to be modified."""
        return self.agents

    def exits(self) -> dict[str, int]:
        return {n: c.exit_rc for n, c in self.by_node().items() if c.exit_rc is not None}

    def unaccounted(self) -> list[str]:
        """Step nodes that neither reported an exit nor are lost."""
        exits = self.exits()
        return [n for n in self.nodes if n not in exits and n not in self.lost]


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _log(line: str) -> None:
    sys.stderr.write(f"bv supervisor: {line}\n")
    sys.stderr.flush()


class Supervisor:
    def __init__(self, opts: Options, env: dict[str, str] | None = None) -> None:
        self.opts = opts
        self.env = dict(os.environ if env is None else env)
        # A step's secret and rendezvous are made by run_step, never inherited.
        for name in (SECRET_ENV, RDZV_ID_ENV, RDZV_ENDPOINT_ENV, RDZV_NODE_ENV):
            self.env.pop(name, None)
        self.job = self.env.get("SLURM_JOB_ID", "0")
        nodelist = self.env.get("SLURM_JOB_NODELIST") or self.env.get("SLURM_NODELIST") or ""
        self.alloc = expand(nodelist) if nodelist else [socket.gethostname()]
        self.excluded: dict[str, str] = {}
        self.signal_seen: int | None = None  # SIGUSR1 or SIGTERM, once received
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self.wake_w, False)
        self.host = socket.gethostname()
        if (short := open_files_for(len(self.alloc))) is not None:
            _log(short)
        addr = bind_address(self.alloc, self.host)
        self.advertised = "127.0.0.1" if addr == "127.0.0.1" else self.host
        self.listen = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.listen.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listen.bind((addr, 0))
        # Every agent of the allocation connects at once at a step's start: a backlog of them
        # all (the kernel caps it at net.core.somaxconn), else the rest wait out SYN retries.
        self.listen.listen(max(256, 2 * len(self.alloc)))
        self.listen.setblocking(False)
        self.udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        # A save of all ranks is 8 x nodes checkpoint datagrams within milliseconds: a receive
        # buffer for them (the kernel caps it at net.core.rmem_max; docs/scale.md).
        self.udp.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, UDP_RCVBUF)
        self.udp.bind((addr, 0))
        self.udp.setblocking(False)
        self.last_turn = 0.0  # when the loop's last turn began (`_pump`)
        # selectors (epoll): no FD_SETSIZE limit, whatever the number of connections.
        self.sel = selectors.DefaultSelector()
        for fileobj in (self.listen, self.udp, self.wake_r):
            self.sel.register(fileobj, selectors.EVENT_READ)
        self.conns: list[Conn] = []
        # Goodput events (bluevela/launch/events.py): off until run() opens the file.
        self.events = EventLog(None, self.host)
        self.step_failed: float | None = None
        self.step_detected: float | None = None

    # -- signals ---------------------------------------------------------------------------
    def install_signals(self) -> None:
        signal.set_wakeup_fd(self.wake_w, warn_on_full_buffer=False)
        for sig in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: None)  # the wakeup fd carries the number

    def _drain_signals(self) -> list[int]:
        try:
            return list(os.read(self.wake_r, 1024))
        except BlockingIOError:
            return []

    # -- attempts --------------------------------------------------------------------------
    def run(self) -> int:
        self.install_signals()
        self.events = EventLog.open(self.env, self.host)
        history = history_of_stdout()
        attempt = (history.attempts if history else int(self.env.get("SLURM_RESTART_COUNT") or 0))
        cause = previous_cause(history) if history else (
            "none" if attempt == 0 else "requeued by Slurm")
        if self.opts.grow_deadline > 0 and attempt > 0:
            # An earlier run of this job (same id) killed mid-grow may have left a helper job
            # (bv-grow-JOB) pending on `expand:` this job: cancel it before it gets a node.
            release_helpers(self.job, (), time.monotonic() + 5)
        want = self.opts.nodes
        min_nodes = self.opts.min_nodes if self.opts.min_nodes is not None else want
        launch = 0
        while True:
            launch += 1
            attempt += 1
            nodes = choose_nodes(self.alloc, self.excluded, want, min_nodes)
            if nodes is None and launch == 1:
                _log(f"the allocation has {len(self.alloc)} node(s) ({compress(self.alloc)}), "
                     f"the job needs {min_nodes}")
                return 1
            if nodes is None:
                return self.requeue(attempt - 1, f"{cause}; no healthy node left to relaunch on "
                                    f"in this allocation (need {min_nodes}), requeued by bv")
            _say(banner(attempt, self.job, nodes, cause))
            result = self.run_step(attempt, launch, nodes)
            self.events.step_ended(result.kind, result.cause, sorted(result.lost),
                                   self.step_failed, self.step_detected, time.monotonic())
            if result.kind == "ok":
                _say(end_line(attempt, "exit 0"))
                return 0
            if result.kind == "failed":
                _say(end_line(attempt, result.cause))
                return result.rc or 1
            if result.kind == "terminated":
                _say(end_line(attempt, result.cause))
                return result.rc
            if result.kind == "signal":
                return self.requeue(attempt, result.cause)
            if result.kind == "hang" and not result.lost:
                # Every node answered the abort: they are alive. Relaunch in place (no Slurm
                # requeue, no credential hold), on a spare instead of the hung rank's node
                # when the allocation has one.
                if launch > self.opts.max_relaunches:
                    return self.requeue(attempt, f"{result.cause}; {self.opts.max_relaunches} "
                                        "relaunches done, requeued by bv")
                cause = f"{result.cause}; {self.relaunch_in_place(nodes, result, want)}"
                _say(end_line(attempt, cause))
                continue
            # A lost node: relaunch in this allocation without it, if the job allows.
            self.excluded.update(result.lost)
            nxt = choose_nodes(self.alloc, self.excluded, want, min_nodes)
            if launch > self.opts.max_relaunches:
                return self.requeue(attempt, f"{result.cause}; {self.opts.max_relaunches} "
                                    f"relaunches done: the job lets go of "
                                    f"{compress(sorted(result.lost))} and is requeued by bv",
                                    lost=sorted(result.lost))
            grown: GrowResult | None = None
            if nxt is None:
                grown = self.grow(sorted(result.lost), want)
                if grown.ok:
                    nxt = choose_nodes(self.alloc, self.excluded, want, min_nodes)
            if nxt is None:
                why = "no spare node (--spare-nodes) and no shrink (--min-nodes)"
                if grown is not None and grown.why:
                    why += f"; no node grown ({grown.why})"
                # Let go of the lost nodes unless the grow already did (a second `update
                # NodeList=` is refused for good on 22.05 without accounting).
                done = set(grown.released) if grown is not None else set()
                return self.requeue(attempt, f"{result.cause}; {why}: the job lets go of "
                                    f"{compress(sorted(result.lost))} and is requeued by bv",
                                    lost=sorted(set(result.lost) - done))
            spare = [n for n in nxt if n not in nodes]
            if grown is not None and grown.ok:
                how = (f"relaunching on {compress(nxt)} (grown {compress(grown.added)} in "
                       f"{grown.seconds:.1f} s, same job, no Slurm requeue)")
            elif spare:
                how = f"relaunching on {compress(nxt)} (spare {compress(spare)})"
            else:
                how = f"relaunching on {len(nxt)} of {want} nodes ({compress(nxt)})"
            cause = f"{result.cause}; {how}"
            _say(end_line(attempt, cause))

    def relaunch_in_place(self, nodes: list[str], result: StepResult, want: int) -> str:
        """After a hang with every node alive: the next step's nodes are the same, or a spare
        in place of the hung rank's node. Says which, for the end line."""
        hung = result.hang_node
        if hung and hung in nodes:
            spare = [n for n in self.alloc if n not in nodes and n not in self.excluded]
            if spare:
                self.excluded[hung] = "its rank hung"
                nxt = choose_nodes(self.alloc, self.excluded, want, want) or nodes
                return f"relaunching on {compress(nxt)} (spare {spare[0]} for {hung}; no Slurm requeue)"
        return f"relaunching on the same nodes ({compress(nodes)}; no Slurm requeue)"

    def grow(self, lost: list[str], want: int) -> GrowResult:
        """Add nodes to this job in place of `lost`, as many as the step lacks of `want`
        (bluevela/launch/grow.py); on success the allocation and the SLURM_* variables of the
        next srun follow."""
        if self.opts.grow_deadline <= 0:
            return GrowResult([], {}, 0.0, "job growth is off in site.yaml "
                              "(launch.grow_deadline_s: 0)")
        keep = [n for n in self.alloc if n not in self.excluded]
        if not keep:
            return GrowResult([], {}, 0.0, "no node of the job is left to grow from")
        need = max(1, want - len(keep))
        _log(f"growing job {self.job} by {need} node(s) in place of {compress(lost)} "
             f"(deadline {self.opts.grow_deadline:g} s)")
        res = grow_job(self.job, keep, lost, self.opts.grow_deadline, count=need)
        if not res.ok:
            _log(f"no node grown: {res.why}")
            return res
        self.alloc = keep + [n for n in res.added if n not in keep]
        env = {"SLURM_JOB_NODELIST": compress(self.alloc), "SLURM_NODELIST": compress(self.alloc),
               "SLURM_JOB_NUM_NODES": str(len(self.alloc)), "SLURM_NNODES": str(len(self.alloc))}
        env.update(res.env)  # Slurm's own resize script wins where it says more
        self.env.update(env)
        for name in UNSET_ON_RESIZE:  # as Slurm's resize script does: srun recomputes them
            self.env.pop(name, None)
        _log(f"grew job {self.job} by {compress(res.added)} in {res.seconds:.1f} s")
        return res

    def requeue(self, attempt: int, cause: str, lost: Sequence[str] = ()) -> int:
        """`scontrol requeue` this job. With lost nodes, the allocation is first shrunk to the
        nodes that answer (`scontrol update NodeList=`): otherwise the job stays COMPLETING
        until Slurm declares the dead node DOWN (SlurmdTimeout). The node let go stays
        COMPLETING (its epilog never ends) until it is DOWN, so the next attempt is not placed
        on it meanwhile."""
        if attempt:
            _say(end_line(attempt, cause))
        else:
            _log(cause)
        self.events.requeue()
        keep = [n for n in self.alloc if n not in self.excluded]
        if lost and keep and self._scontrol("update", f"JobId={self.job}",
                                            f"NodeList={compress(keep)}").terminated:
            return 0  # Slurm is ending the job
        done = self._slurm(["scontrol", "requeue", self.job])
        if done.terminated:
            return 0  # Slurm is ending the job (the requeue took, or a cancel): let it
        if not done.ok:
            why = (f"scontrol requeue {self.job} failed ({done.describe()}): the job ends "
                   "here, not requeued")
            _log(why)
            if attempt:
                _say(end_line(attempt, why))
            return 1
        # Slurm now ends this allocation (SIGTERM, then SIGKILL): wait for it rather than exit
        # first (an early exit could end the job before the requeue takes effect).
        deadline = time.monotonic() + 300
        with selectors.DefaultSelector() as wait:
            wait.register(self.wake_r, selectors.EVENT_READ)
            while time.monotonic() < deadline:
                for sig in self._drain_signals():
                    if sig in (signal.SIGTERM, signal.SIGINT):
                        return 0
                wait.select(1.0)
        return 0

    def _scontrol(self, *args: str) -> SlurmCall:
        done = self._slurm(["scontrol", *args])
        if not done.ok and not done.terminated:
            _log(f"scontrol {' '.join(args)} failed ({done.describe()})")
        return done

    def _slurm(self, argv: list[str]) -> SlurmCall:
        """Run a Slurm command: each try bounded by --slurm-timeout, retried with backoff
        while slurmctld is unreachable, hung or busy, within --slurm-retry-for and the job's
        remaining time. Never raises. Stops early when Slurm's SIGTERM arrives (the job is
        ending: nothing left to retry for). The first try is immediate: no cost when Slurm
        answers."""
        start = time.monotonic()
        deadline = start + retry_budget(self.env, self.opts.slurm_retry_for, time.time())
        tries, why = 0, ""
        while True:
            tries += 1
            limit = max(1.0, min(self.opts.slurm_timeout, deadline - time.monotonic()))
            try:
                proc = subprocess.run(argv, capture_output=True, text=True, check=False,
                                      timeout=limit, stdin=subprocess.DEVNULL)
            except subprocess.TimeoutExpired:
                why = f"timed out after {limit:.0f} s"
            except OSError as exc:  # no such command: no retry mends it
                return SlurmCall(False, "", f"cannot run {argv[0]}: {exc.strerror or exc}",
                                 tries, time.monotonic() - start)
            else:
                if proc.returncode == 0:
                    return SlurmCall(True, proc.stdout, "", tries, time.monotonic() - start)
                why = (f"exit {proc.returncode}: "
                       f"{printable(proc.stderr or proc.stdout, 200) or 'no message'}")
                if permanent_slurm_error(why):
                    return SlurmCall(False, "", why, tries, time.monotonic() - start)
                deadline = retry_deadline(why, start, deadline)
            delay = BACKOFF_S[min(tries - 1, len(BACKOFF_S) - 1)]
            if time.monotonic() + delay >= deadline:
                return SlurmCall(False, "", why, tries, time.monotonic() - start)
            _log(f"{' '.join(argv[:2])}: {why}; try {tries + 1} in {delay:g} s")
            if self._sleep_unless_terminated(delay):
                return SlurmCall(False, "", why, tries, time.monotonic() - start,
                                 terminated=True)

    def _sleep_unless_terminated(self, seconds: float) -> bool:
        """Wait `seconds`; True as soon as SIGTERM (or SIGINT) arrives."""
        end = time.monotonic() + seconds
        with selectors.DefaultSelector() as wait:
            wait.register(self.wake_r, selectors.EVENT_READ)
            while (left := end - time.monotonic()) > 0:
                wait.select(left)
                if any(sig in (signal.SIGTERM, signal.SIGINT) for sig in self._drain_signals()):
                    return True
        return False

    # -- one step --------------------------------------------------------------------------
    def srun_argv(self, nodes: Sequence[str], launch: int) -> list[str]:
        return [
            "srun", f"--nodes={len(nodes)}", f"--ntasks={len(nodes)}", "--ntasks-per-node=1",
            f"--nodelist={','.join(nodes)}", "--export=ALL",
            *(["--overlap"] if launch > 1 else []),
            *agent_argv(), *torchrun_step_argv(self.opts.torchrun, nodes),
        ]

    def run_step(self, attempt: int, launch: int, nodes: list[str]) -> StepResult:
        # A new secret per step: a straggler of an aborted step cannot speak in the next one.
        secret = new_secret()
        env = dict(self.env)
        env[SUPERVISOR_ENV] = f"{self.advertised}:{self.listen.getsockname()[1]}"
        env[HEARTBEAT_ENV] = f"{self.advertised}:{self.udp.getsockname()[1]}"
        env[ATTEMPT_ENV] = str(attempt)
        # The training world (bluevela/runtime/world.py): each agent hands it to torchrun.
        env[STEP_NODELIST_ENV] = compress(nodes)
        env[STEP_NUM_NODES_ENV] = str(len(nodes))
        env[SECRET_ENV] = secret  # the environment only: argv is world-readable in /proc
        # Whoever knows the store's key can write torchrun's pickled state, which every agent
        # unpickles: code execution as the job's user. So the id is random, and like the
        # endpoint it travels in the environment, never on srun's, the agent's or torchrun's argv.
        env.update(rdzv_env(new_rdzv_id(), nodes[0]))
        key = bytes.fromhex(secret)
        st = StepState(nodes=list(nodes), started=time.monotonic(),
                       line_key=derive(key, b"line"), beat_key=beat_key(key),
                       max_ranks=ranks_bound(self.opts.torchrun, len(nodes)))
        self.conns = st.conns
        self.step_failed = self.step_detected = None
        self.events.launch(attempt, launch, nodes, len([n for n in self.alloc if n not in
                                                        self.excluded]) - len(nodes), st.started)
        try:
            srun = subprocess.Popen(self.srun_argv(nodes, launch), env=env,
                                    stdin=subprocess.DEVNULL)
        except OSError as exc:
            return StepResult("failed", 127 if exc.errno == errno.ENOENT else 126,
                              f"cannot start srun: {exc.strerror or exc}")
        hang_checked = 0.0
        try:
            while True:
                self._pump(st, srun)
                now = time.monotonic()
                srun_settled = (st.srun_exit_at is not None
                                and now - st.srun_exit_at >= self.opts.settle_s)
                if self.signal_seen is not None:
                    # Checkpoint requested: wait for the step to end (Slurm's time limit and
                    # KillWait bound this).
                    if not st.unaccounted() or srun_settled:
                        reap(srun, 2.0)
                        exits = st.exits()
                        if (exits and not st.lost and set(exits.values()) == {0}
                                and not any(c.signalled for c in st.conns)):
                            return StepResult("ok", 0, "exit 0")  # done before the signal
                        return self._signal_result(exits, st.srun_rc)
                    continue
                if st.lost or st.first_failure is not None:
                    return self._end_step(st, srun, None)
                if not st.unaccounted():
                    reap(srun, 10.0)
                    return StepResult("ok", 0, "exit 0")
                if srun_settled:
                    if st.srun_rc == 0 and not st.by_node():
                        return StepResult("ok", 0, "exit 0")
                    rc = st.srun_rc or 1
                    return StepResult("failed", rc, f"srun exited {st.srun_rc} before every "
                                      "node agent reported")
                if now - hang_checked < HANG_CHECK_S:
                    continue
                hang_checked = now
                hang = find_hang(st.beats, st.started, now, self.opts.hang_timeout)
                if hang is not None:
                    return self._end_step(st, srun, hang)
        finally:
            if st.dropped > MAX_DROP_LOGS:
                _log(f"{st.dropped - MAX_DROP_LOGS} more connection(s) dropped in this step")
            for conn in st.conns:
                self._close(conn)
            if srun.poll() is None:
                srun.kill()
                srun.wait()

    def _pump(self, st: StepState, srun: subprocess.Popen[bytes]) -> None:
        """One round: signals, new agents, agent messages, beats, srun, node timeouts."""
        ready = {key.fileobj for key, _ in self.sel.select(TICK_S)}
        if self.listen not in ready and self.wake_r not in ready:
            # Beats and pings alone: taken in batches, a turn (and its checks over every
            # node) at most TURN_S after the last; not one turn per datagram (docs/scale.md).
            time.sleep(max(0.0, self.last_turn + TURN_S - time.monotonic()))
        now = self.last_turn = time.monotonic()
        for sig in self._drain_signals():
            self._on_signal(sig)
        if self.udp in ready:
            self._read_beats(st, now)
        # Reads before accepts: hellos already sent are taken before new connections can push
        # their senders out of the pending set.
        for conn in [c for c in st.conns if not c.closed and c.sock in ready]:
            try:
                msgs = conn.read(now)
            except ChannelError as exc:
                self._drop(st, conn, str(exc))
                continue
            if msgs is None:
                self._close(conn)
                if conn.node is None:
                    st.conns.remove(conn)
                elif conn.exit_rc is None:
                    st.lost.setdefault(conn.node, "its agent's connection closed: the node or "
                                       "its processes died")
                continue
            for msg in msgs:
                why = self._on_msg(st, conn, msg)
                if why is not None:
                    self._drop(st, conn, why)
                    break
                if (msg.get("t") == "exit" and conn.exit_rc not in (None, 0)
                        and st.first_failure is None and conn.node is not None):
                    st.first_failure = (conn.node, conn.exit_rc or 1)
                    st.failure_why = conn.why
        self.events.pump()  # the goodput events' copy, a bounded part a tick
        for conn in [c for c in st.conns if not c.closed and (c.chan.out or c.chan.broken)]:
            conn.chan.flush()  # what a slow reader left pending: whole lines only
            if conn.chan.broken is not None:
                self._drop(st, conn, conn.chan.broken)
        if self.listen in ready:
            self._accept(st, now)
        for conn in [c for c in st.conns if c.node is None]:
            if now - conn.opened > HELLO_DEADLINE_S:
                self._drop(st, conn, f"no signed hello in {HELLO_DEADLINE_S:.0f} s")
        if st.srun_rc is None and (rc := srun.poll()) is not None:
            st.srun_rc, st.srun_exit_at = rc, now
        by_node = st.by_node()
        for node in st.unaccounted():
            agent = by_node.get(node)
            if agent is None:
                if now - st.started > self.opts.connect_timeout:
                    st.lost[node] = f"its agent never connected in {self.opts.connect_timeout:.0f} s"
            elif now - agent.last_seen > self.opts.node_timeout:
                st.lost[node] = f"silent for {now - agent.last_seen:.0f} s (no agent ping)"

    def _end_step(self, st: StepState, srun: subprocess.Popen[bytes],
                  hang: Hang | None) -> StepResult:
        """End the step now: agents kill their torchrun; then every node has either answered
        (it is alive) or is lost (connection closed, or silent for --node-timeout); the hung
        srun (it would wait for a dead node until SlurmdTimeout) is killed here."""
        self.step_detected = time.monotonic()
        self.step_failed = failure_time(st.lost, {c.node: c.last_seen for c in st.conns if c.node},
                                        st.started, self.step_detected,
                                        hang.beat.last_progress if hang is not None else None)
        for conn in st.conns:
            if not conn.closed and conn.node is not None and conn.exit_rc is None:
                conn.send({"t": "abort"})
        deadline = time.monotonic() + self.opts.node_timeout + self.opts.abort_grace_s
        while st.unaccounted() and time.monotonic() < deadline:
            self._pump(st, srun)
        for node in st.unaccounted():
            st.lost[node] = "did not answer the abort"
        reap(srun, 0.5)
        lost_text = "; ".join(f"{n} lost ({why})" for n, why in st.lost.items())
        if hang is not None:
            return StepResult("hang", 1, hang.describe() + (f"; {lost_text}" if lost_text else ""),
                              dict(st.lost), hang.beat.node)
        if st.lost:
            return StepResult("lost", 1, lost_text, dict(st.lost))
        node, rc = st.first_failure or ("?", 1)
        if st.failure_why:
            return StepResult("failed", rc, f"exit {rc} ({st.failure_why}; not a lost node, so "
                              "no relaunch or requeue)")
        return StepResult("failed", rc, f"exit {rc} (rank failure on {node}; every node "
                          "answered, so no relaunch: torchrun --max-restarts retries in place)")

    def _signal_result(self, exits: dict[str, int], srun_rc: int | None) -> StepResult:
        codes = sorted(set(exits.values())) or [srun_rc if srun_rc is not None else -1]
        name = signal.Signals(self.signal_seen or signal.SIGUSR1).name
        termed = sum(c.termed for c in self.conns)
        if self.signal_seen == signal.SIGUSR1 and termed:
            # A script with no handler for bv's signal: torchrun's SIGTERM stop, not a kill.
            return StepResult("signal", 0, f"checkpoint signal {name} from Slurm; {termed} "
                              f"worker(s) had no handler for it after {USR1_UNCAUGHT_S:.0f} s "
                              "and were stopped with SIGTERM through torchrun (its grace "
                              f"period), no checkpoint from them; exited "
                              f"{','.join(map(str, codes))}, requeued by bv")
        if self.signal_seen == signal.SIGUSR1:
            return StepResult("signal", 0, f"checkpoint signal {name} from Slurm, workers "
                              f"exited {','.join(map(str, codes))}, requeued by bv")
        return StepResult("terminated", 128 + int(self.signal_seen or 15),
                          f"{name} from Slurm (scancel, operator requeue or preemption): "
                          f"workers asked to checkpoint, exited {','.join(map(str, codes))}")

    def _on_signal(self, sig: int) -> None:
        if sig not in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT):
            return
        first = self.signal_seen is None
        if first or sig != signal.SIGUSR1:
            self.signal_seen = signal.SIGTERM if sig == signal.SIGINT else sig
        if first:
            self.events.signal(time.monotonic())
            _log(f"{signal.Signals(sig).name} received: asking every worker to checkpoint")
            for conn in self.conns:
                if not conn.closed and conn.node is not None:
                    conn.send({"t": "usr1"})

    def _accept(self, st: StepState, now: float) -> None:
        # The pending cap grows with the step's agents that have not said hello yet: a
        # member's start storm (every agent of 1,024 nodes connects at once) must never push
        # its own hellos out; a non-member can still hold at most MAX_PENDING more, and the
        # oldest pending goes first (docs/scale.md).
        pending = [c for c in st.conns if c.node is None]
        cap = MAX_PENDING + max(0, len(st.nodes) - (len(st.conns) - len(pending)))
        for _ in range(MAX_ACCEPT_PER_TICK):
            try:
                sock, _ = self.listen.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # EMFILE and the like: the backlog waits, the loop goes on
                _log(f"accept: {exc.strerror or exc}")
                return
            if len(pending) >= cap:
                self._drop(st, pending.pop(0), f"more than {cap} connections without a hello")
            sock.setblocking(False)
            nonce = secrets.token_bytes(16)
            conn = Conn(sock, st.line_key, nonce, now)
            try:
                sock.send(challenge_line(nonce))
            except OSError:
                sock.close()
                continue
            st.conns.append(conn)
            pending.append(conn)
            self.sel.register(sock, selectors.EVENT_READ)

    def _close(self, conn: Conn) -> None:
        if conn.closed:
            return
        conn.closed = True
        try:
            self.sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        try:
            conn.sock.close()
        except OSError:
            pass

    def _drop(self, st: StepState, conn: Conn, why: str) -> None:
        """Close a connection that broke the protocol. One that was an agent of the step (it
        had the secret) counts as a lost node; any other is forgotten."""
        st.dropped += 1
        if st.dropped <= MAX_DROP_LOGS:
            try:
                host, port = conn.sock.getpeername()[:2]
                peer = f"{host}:{port}"
            except OSError:
                peer = "?"
            _log(f"dropped a connection from {safe_name(peer)}: {why}")
        self._close(conn)
        if conn.node is None:
            st.conns.remove(conn)
        elif conn.exit_rc is None:
            st.lost.setdefault(conn.node, f"its agent broke the protocol ({why})")

    def _read_beats(self, st: StepState, now: float) -> None:
        for _ in range(max(MAX_BEATS_PER_TICK, st.max_ranks // 4)):
            try:
                data = self.udp.recv(2048)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            if self.events.datagram(data, st.beat_key, st.max_ranks, now):
                continue  # a checkpoint record (goodput events), not a beat
            beat = parse_beat(data, st.beat_key)
            # A signed beat from this step's own ranks always passes these: a rank the step
            # cannot have, or progress older than the step, is not one of ours.
            if beat is None or beat.rank >= st.max_ranks or beat.age_s > now - st.started + 5:
                continue
            if not fresh_seq(st.seqs, (beat.rank, beat.pid), beat.seq, 4 * st.max_ranks):
                continue  # a replayed or reordered beat
            self.events.progress(now - beat.age_s)
            st.beats[beat.rank] = RankBeat(safe_name(beat.node), beat.step, now - beat.age_s,
                                           beat.in_collective, safe_name(beat.where, 200))

    def _on_msg(self, st: StepState, conn: Conn, msg: dict[str, object]) -> str | None:
        """Act on one signed message; a reason to drop the connection, or None."""
        kind = msg.get("t")
        if conn.node is None:
            node = msg.get("node")
            if kind != "hello" or not isinstance(node, str):
                return "a message before hello"
            if node not in st.members:
                return f"hello from {safe_name(node)}, not a node of this step"
            if node in st.agents:
                return f"a second hello from {node}"
            if node == st.nodes[0]:
                port = msg.get("port")
                if not isinstance(port, int) or not 1 <= port <= 65535:
                    return f"hello from the rendezvous node {node} without a port"
                st.rdzv_port = port
            conn.node = node
            st.agents[node] = conn
            if node == keeper_of(st.nodes, self.host):
                # a copy of the goodput events on a second node (events.CopyWriter): the
                # record of this attempt outlives this (the batch) node
                self.events.attach(conn.chan)
            if st.rdzv_port is not None:
                # Once the port is known, each later hello gets its own go: no walk over every
                # agent per hello (1,024 hellos x 1,024 agents at each step start).
                waiting = st.conns if node == st.nodes[0] else [conn]
                for c in waiting:
                    if c.node is not None and not c.go_sent and not c.closed:
                        c.send({"t": "go", "port": st.rdzv_port})
                        c.go_sent = True
            if self.signal_seen is not None:
                conn.send({"t": "usr1"})
        elif kind == "exit":
            rc, signalled = msg.get("rc"), msg.get("signalled")
            conn.exit_rc = rc if isinstance(rc, int) and 0 <= rc <= 255 else 1
            conn.signalled = signalled if isinstance(signalled, int) else 0
            termed = msg.get("termed")
            conn.termed = termed if isinstance(termed, int) else 0
            why = msg.get("why")
            conn.why = printable(why) if isinstance(why, str) else ""
        return None


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
