"""One training step of the in-job supervisor: the srun it started, the node agents that
connect back, the ranks' beats, until the step ends one way (`outcome.StepEnd`).

The supervisor (bluevela/launch/supervisor.py) opens its `Endpoints` once (the agents' TCP
port, the ranks' UDP port, the signals' wakeup pipe) and runs one `Step` per launch. A step
pumps (`Step.pump`: signals, beats, agent lines, new connections, srun, node deadlines) until
it can say how it ended (`Step.run`):

- every agent reported exit 0 -> OK; a rank failed on nodes that all answered -> FAILED;
- a node lost (its connection closed or broke the protocol, silent for --node-timeout, never
  connected) or the hang watchdog fired: the step is aborted (`Step.end`): agents kill their
  torchrun, a node that does not answer the abort is lost too, srun is killed here -> LOST or
  HANG, with the reason for each lost node as a typed `outcome.Loss`;
- SIGUSR1 / SIGTERM: every agent is told to forward SIGUSR1 to its workers (at SIGUSR1 with
  the job's time left when its limit is near: bluevela/launch/usr1_wait.py); once the step
  has ended -> SIGNAL (requeue) or TERMINATED.

Only the step's own processes can speak to it (bluevela/protocol/): a new secret per
step, an HMAC on every line and beat, a hello only from a node of the step and once, caps on
line size and connections, a hello deadline; a bad message drops that message or connection,
never the supervisor. Standard library only.
"""

from __future__ import annotations

import enum
import logging
import os
import secrets
import selectors
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from bluevela.goodput.outcome import Loss, StepEnd
from bluevela.launch.events_copy import keeper_of
from bluevela.launch.events_log import EventLog
from bluevela.launch.proctree import reap, wait_killed
from bluevela.launch.step_result import StepResult, failure_time, lost_text
from bluevela.launch.usr1_wait import USR1_UNCAUGHT_S, USR1_WAIT_MAX_S, LimitClock, usr1_request
from bluevela.launch.watchdog import Hang, RankBeat, find_hang
from bluevela.protocol.channel import Channel, ChannelError, challenge_line
from bluevela.protocol.messages import AGG_MAGIC, Agg, fresh_seq, parse_agg, parse_beat
from bluevela.protocol.names import printable, safe_name

logger = logging.getLogger(__name__)

TICK_S = 0.2
HELLO_DEADLINE_S = 5.0  # a connection without a signed hello by then is closed
MAX_PENDING = 64  # connections without a hello yet; the oldest goes when one more comes
# A connection accepted in one tick is read in the next three before it can be pushed out
# (64 pending / 16 a tick): an agent's hello, sent on the challenge, is read in time.
MAX_ACCEPT_PER_TICK = 16
MAX_BEATS_PER_TICK = 512  # then signals and agents get their turn (a flood cannot starve them)
# (or a quarter of the step's ranks: a turn takes 1/4 s of beats at most, with TURN_S in between)
UDP_RCVBUF = 16 << 20  # bytes asked for the beat socket's receive buffer (rmem_max caps it)
UDP_RECV = 16384  # bytes read of one datagram (an aggregate is messages.AGG_MAX_BYTES at most)
TURN_S = 0.01  # a turn woken by datagrams or agents' lines alone waits for this since the last
# ... or 50 us per node of the step, up to 0.1 s: a turn's passes over every connection cost
# O(nodes), so turns a second fall as nodes grow and their sum stays flat (docs/scale.md).
TURN_PER_NODE_S = 50e-6
TURN_MAX_S = 0.1
HANG_CHECK_S = 0.2  # the hang watchdog's look over every rank's last progress, this often
DEADLINE_CHECK_S = 0.1  # the look over every node's last ping and pending hello, this often
MAX_DROP_LOGS = 3  # per step; the rest are counted
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
INF = float("inf")
E = TypeVar("E", bound=enum.Enum)


_AGG_HEAD = AGG_MAGIC.encode() + b" "


def log(line: str) -> None:
    sys.stderr.write(f"bv supervisor: {line}\n")
    sys.stderr.flush()


# --------------------------------------------------------------------------------------------
# What the supervisor listens on


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


class Signals:
    """SIGUSR1, SIGTERM and SIGINT through a wakeup pipe: the handlers do nothing, the loops
    read the numbers. `seen`: the signal the job acts on (SIGTERM wins over SIGUSR1)."""

    def __init__(self) -> None:
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self.wake_w, False)
        self.seen: int | None = None

    def install(self) -> None:
        signal.set_wakeup_fd(self.wake_w, warn_on_full_buffer=False)
        for sig in (signal.SIGUSR1, *STOP_SIGNALS):
            signal.signal(sig, lambda *_: None)  # the wakeup fd carries the number

    def drain(self) -> list[int]:
        try:
            return list(os.read(self.wake_r, 1024))
        except BlockingIOError:
            return []

    def note(self, sig: int) -> bool:
        """Take `sig` into `seen`; True when it is the job's first signal."""
        if sig not in (signal.SIGUSR1, *STOP_SIGNALS):
            return False
        first = self.seen is None
        if first or sig != signal.SIGUSR1:
            self.seen = signal.SIGTERM if sig == signal.SIGINT else sig
        return first

    def close(self) -> None:
        old = signal.set_wakeup_fd(-1)
        if old != self.wake_w:  # not ours: leave it as it was
            signal.set_wakeup_fd(old)
        for fd in (self.wake_r, self.wake_w):
            os.close(fd)

    def take(self) -> list[int]:
        """The signals that came since the last look, each taken into `seen`: the one way a
        signal reaches a decision, whatever the supervisor is doing (a step's pump, a grow,
        a requeue's wait)."""
        sigs = self.drain()
        for sig in sigs:
            self.note(sig)
        return sigs

    def stopping(self) -> bool:
        """SIGTERM (or SIGINT) seen: Slurm is ending the job."""
        return self.seen == signal.SIGTERM

    def wait_stop(self, seconds: float) -> bool:
        """Wait `seconds`; True as soon as SIGTERM (or SIGINT) arrives (or had arrived)."""
        end = time.monotonic() + seconds
        with selectors.DefaultSelector() as wait:
            wait.register(self.wake_r, selectors.EVENT_READ)
            while not self.stopping() and (left := end - time.monotonic()) > 0:
                wait.select(left)
                self.take()
        return self.stopping()


class Endpoints:
    """The agents' TCP port and the ranks' UDP port (bound once, on `bind_address`), and the
    selector over them and the signals' pipe."""

    def __init__(self, alloc: Sequence[str], host: str, signals: Signals) -> None:
        addr = bind_address(alloc, host)
        self.advertised = "127.0.0.1" if addr == "127.0.0.1" else host
        # Bound in order; whatever was opened is closed again when a later bind fails (a
        # supervisor that cannot start must not leave a listening port behind).
        opened: list[socket.socket] = []
        try:
            listen = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            opened.append(listen)
            listen.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listen.bind((addr, 0))
            # Every agent of the allocation connects at once at a step's start: a backlog of
            # them all (the kernel caps it at net.core.somaxconn), else the rest wait out SYN
            # retries.
            listen.listen(max(256, 2 * len(alloc)))
            listen.setblocking(False)
            udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            opened.append(udp)
            # A save of all ranks is 8 x nodes checkpoint datagrams within milliseconds: a
            # receive buffer for them (the kernel caps it at net.core.rmem_max; docs/scale.md).
            udp.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, UDP_RCVBUF)
            udp.bind((addr, 0))
            udp.setblocking(False)
        except OSError:
            for sock in opened:
                sock.close()
            raise
        self.listen, self.udp = listen, udp
        # selectors (epoll): no FD_SETSIZE limit, whatever the number of connections.
        self.sel = selectors.DefaultSelector()
        for fileobj in (self.listen, self.udp, signals.wake_r):
            self.sel.register(fileobj, selectors.EVENT_READ)

    def close(self) -> None:
        self.sel.close()
        self.listen.close()
        self.udp.close()

    def line_addr(self) -> str:
        return f"{self.advertised}:{self.listen.getsockname()[1]}"

    def beat_addr(self) -> str:
        return f"{self.advertised}:{self.udp.getsockname()[1]}"


# --------------------------------------------------------------------------------------------
# One step


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
        self.waited = USR1_UNCAUGHT_S  # how long the agent held the signal for them
        self.why = ""  # the agent's own reason with a failed exit (e.g. no torchrun)
        self.go_sent = False
        self.aborted = False  # told to abort: no go follows
        self.closed = False

    def send(self, msg: dict[str, object]) -> None:
        self.chan.send(msg)

    def read(self, now: float) -> list[dict[str, object]] | None:
        """Messages now readable; None on EOF/error. Raises ChannelError (drop the peer)."""
        msgs = self.chan.receive()
        if msgs:
            self.last_seen = now
        return msgs

    def took_exit(self, msg: dict[str, object]) -> None:
        rc, signalled, termed, why = (msg.get("rc"), msg.get("signalled"), msg.get("termed"),
                                      msg.get("why"))
        self.exit_rc = rc if isinstance(rc, int) and 0 <= rc <= 255 else 1
        self.signalled = signalled if isinstance(signalled, int) else 0
        self.termed = termed if isinstance(termed, int) else 0
        waited = msg.get("waited")
        if type(waited) is int and 0 <= waited <= USR1_WAIT_MAX_S:
            self.waited = float(waited)
        self.why = printable(why) if isinstance(why, str) else ""


@dataclass(frozen=True)
class StepConfig:
    """What bounds a step (the supervisor's options)."""

    settle_s: float = 2.0  # srun gone this long with agents unaccounted: the step has ended
    node_timeout: float = 10.0
    connect_timeout: float = 120.0
    abort_grace_s: float = 5.0
    hang_timeout: float = 0.0


@dataclass
class StepState:
    nodes: list[str]
    started: float
    line_key: bytes = b""
    beat_key: bytes = b""
    agg_key: bytes = b""  # the agents' aggregates of their ranks' beats
    max_ranks: int = 1
    world: int | None = None  # the step's exact world size, when torchrun's command says it
    rdzv_port: int | None = None  # reported by the rendezvous node's agent
    conns: list[Conn] = field(default_factory=list)
    beats: dict[int, RankBeat] = field(default_factory=dict)
    # rank -> its last progress (inf once finished): what the watchdog looks at first
    progress: dict[int, float] = field(default_factory=dict)
    seqs: dict[tuple[int, int], int] = field(default_factory=dict)  # (rank, pid) -> last seq
    agg_seqs: dict[tuple[int, int], int] = field(default_factory=dict)  # (node #, pid) -> seq
    refused_aggs: int = 0  # aggregates refused (unsigned, stale, replayed, wrong node or rank)
    gone: set[tuple[int, int]] = field(default_factory=set)  # (rank, pid) restarted: refused
    restarts_logged: int = 0
    lost: dict[str, Loss] = field(default_factory=dict)
    first_failure: tuple[str, int] | None = None  # (node, rc) of the first non-zero exit
    failure_why: str = ""  # what the first failed node's agent said about it, if anything
    srun_rc: int | None = None
    srun_exit_at: float | None = None
    dropped: int = 0  # connections dropped for a protocol error
    agents: dict[str, Conn] = field(default_factory=dict)  # node -> its agent, from its hello
    members: frozenset[str] = field(init=False, default=frozenset())  # `nodes`, for lookups
    node_index: dict[str, int] = field(init=False, default_factory=dict)  # node -> its place

    def __post_init__(self) -> None:
        self.members = frozenset(self.nodes)
        self.node_index = {n: i for i, n in enumerate(self.nodes)}

    def per_node(self) -> int:
        """Ranks one node of the step can have (the step's bound over its nodes)."""
        return max(1, -(-self.max_ranks // max(1, len(self.nodes))))

    def by_node(self) -> dict[str, Conn]:
        """Each node's agent (set at its hello, kept once closed): not to be modified."""
        return self.agents

    def training_ended(self) -> bool:
        """Every rank of the step said its training is over and none acted on the checkpoint
        request: a request that came too late to be acted on, and nothing to requeue for."""
        return (self.world is not None and len(self.beats) == self.world
                and all(b.finished and not b.at_request for b in self.beats.values()))

    def exits(self) -> dict[str, int]:
        return {n: c.exit_rc for n, c in self.by_node().items() if c.exit_rc is not None}

    def _unaccounted(self) -> Iterator[str]:
        lost, agents = self.lost, self.agents
        return (n for n in self.nodes
                if n not in lost and ((c := agents.get(n)) is None or c.exit_rc is None))

    def unaccounted(self) -> list[str]:
        """Step nodes that neither reported an exit nor are lost."""
        return list(self._unaccounted())

    def all_accounted(self) -> bool:
        """`not unaccounted()`, ending at the first node still to hear from (O(1) while the
        step runs: the loop asks every turn)."""
        return next(self._unaccounted(), None) is None

    def record(self, rank: int, beat: RankBeat) -> None:
        """A rank's last beat, and its progress as the watchdog's first look reads it."""
        self.beats[rank] = beat
        self.progress[rank] = INF if beat.finished else beat.last_progress


def go_message(st: StepState, node: str, port: int) -> dict[str, object]:
    """What tells `node`'s agent to start torchrun: the store's port (on the step's first
    node) and, since torch's static rendezvous needs no join (issue 37), the node's place in
    the step (its node rank: its index in the step's node list, the store's host 0) and the
    step's node count. Sent once the port is known (`StepState.rdzv_port`)."""
    return {"t": "go", "port": port, "node_rank": st.node_index[node],
            "nnodes": len(st.nodes)}


class StepPhase(enum.Enum):
    """Where a step is. A phase changes only as `STEP_TRANSITIONS` allows (`Step._to`)."""

    STARTING = "starting"  # srun started; some node's agent has not said hello yet
    RUNNING = "running"  # every node's agent said hello and was told to go
    SIGNALLED = "signalled"  # SIGUSR1/SIGTERM: workers asked to checkpoint; waits for the end
    ENDING = "ending"  # aborted (a lost node, a failed rank, a hang): waits for the answers
    DONE = "done"  # `Step.result` says how it ended


STEP_TRANSITIONS: dict[StepPhase, frozenset[StepPhase]] = {
    StepPhase.STARTING: frozenset({StepPhase.RUNNING, StepPhase.SIGNALLED, StepPhase.ENDING,
                                   StepPhase.DONE}),
    StepPhase.RUNNING: frozenset({StepPhase.SIGNALLED, StepPhase.ENDING, StepPhase.DONE}),
    StepPhase.SIGNALLED: frozenset({StepPhase.DONE}),
    StepPhase.ENDING: frozenset({StepPhase.DONE}),
    StepPhase.DONE: frozenset(),
}

# What an agent's hello is answered with in each phase: told to start torchrun (`go`, once
# the rendezvous port is known; in SIGNALLED followed by the checkpoint request), or told to
# stop at once (`abort`: the step is ending; a torchrun started now would be killed at the
# deadline as a node that did not answer). A hello in DONE is never read (the step is closed).
HELLO_ANSWER: dict[StepPhase, str] = {
    StepPhase.STARTING: "go",
    StepPhase.RUNNING: "go",
    StepPhase.SIGNALLED: "go",
    StepPhase.ENDING: "abort",
}


class TransitionError(RuntimeError):
    """A phase change its table does not allow: a bug of the supervisor, never the job's."""


def check_transition(table: Mapping[E, frozenset[E]], old: E, new: E) -> None:
    """Raise TransitionError unless `table` lets `old` become `new`."""
    if new not in table[old]:
        raise TransitionError(f"{old.name} -> {new.name} is not a transition of this table")


class Step:
    """One srun step, from its start to how it ended: a state machine over `StepPhase`.

    `pump()` does the I/O and hands each event to its handler (`on_message`, `on_closed`,
    `on_signal`); `advance(now)` moves the phase on. Both read the clock only through the
    `now` they are given: a test drives them with scripted events (tests/step_script.py)."""

    def __init__(self, st: StepState, srun: subprocess.Popen[bytes], ends: Endpoints,
                 signals: Signals, events: EventLog, host: str, cfg: StepConfig,
                 clock: LimitClock | None = None) -> None:
        self.st = st
        self.clock = clock  # the job's time limit, learned at the first SIGUSR1 (the supervisor's)
        self.srun = srun
        self.ends = ends
        self.signals = signals
        self.events = events
        self.host = host
        self.cfg = cfg
        self.last_turn = 0.0  # when the loop's last turn began (`pump`)
        self.backlog = False  # the last turn left datagrams unread (its cap): no wait
        self.hang_checked = 0.0
        self.deadlines_checked = 0.0
        self.phase = StepPhase.STARTING
        self.result: StepResult | None = None  # set on DONE
        # ENDING: the abort's deadline, the hang that caused it, and when the failure happened
        self.end_deadline = INF
        self.hang: Hang | None = None
        self.failed_at: float | None = None
        self.detected_at: float | None = None
        if signals.seen is not None:  # a signal came before this step (between two steps)
            self._to(StepPhase.SIGNALLED)

    def _to(self, phase: StepPhase) -> None:
        check_transition(STEP_TRANSITIONS, self.phase, phase)
        self.phase = phase

    def run(self) -> StepResult:
        try:
            while self.result is None:
                self.pump()
                self.advance(time.monotonic())
            return self.result
        finally:
            self._close_all()

    def _done(self, result: StepResult) -> None:
        self._to(StepPhase.DONE)
        self.result = result

    def advance(self, now: float) -> None:
        """Move the phase on at `now` (after a pump): the step's end once it is known."""
        if self.phase is StepPhase.SIGNALLED:
            self._advance_signalled(now)
        elif self.phase is StepPhase.ENDING:
            self._advance_ending(now)
        elif self.phase is not StepPhase.DONE:
            self._advance_running(now)

    def _settled(self, now: float) -> bool:
        st = self.st
        return st.srun_exit_at is not None and now - st.srun_exit_at >= self.cfg.settle_s

    def _advance_signalled(self, now: float) -> None:
        # Checkpoint requested: wait for the step to end (Slurm's time limit and KillWait bound
        # this). A node lost meanwhile is not waited for, and goes into the result.
        st = self.st
        if st.lost:
            # An agent still waiting for `go` has no worker to checkpoint, and once a node is
            # lost (the rendezvous node above all) it may never get one: told to stop now, it
            # answers at once instead of holding the step until Slurm's kill.
            for conn in st.agents.values():
                if not conn.go_sent and not conn.aborted and not conn.closed \
                        and conn.exit_rc is None:
                    self._abort(conn)
        if self._settled(now) or st.all_accounted():
            self._done(self._after_signal(now))

    def _advance_running(self, now: float) -> None:
        """STARTING or RUNNING."""
        st = self.st
        if st.lost or st.first_failure is not None:
            self.begin_end(now, None)
            return
        if st.all_accounted():
            reap(self.srun, 10.0)
            self._done(StepResult(StepEnd.OK, 0, "exit 0"))
            return
        if self._settled(now):
            if st.srun_rc == 0 and not st.by_node():
                self._done(StepResult(StepEnd.OK, 0, "exit 0"))
            else:
                self._done(StepResult(StepEnd.FAILED, st.srun_rc or 1,
                                      f"srun exited {st.srun_rc} before every node agent "
                                      "reported"))
            return
        if now - self.hang_checked < HANG_CHECK_S:
            return
        self.hang_checked = now
        # Most looks end here: the oldest progress of a watched rank, over plain floats in C.
        if now - min(st.progress.values(), default=now) < self.cfg.hang_timeout:
            return
        hang = find_hang(st.beats, now, self.cfg.hang_timeout)
        if hang is not None:
            self.begin_end(now, hang)

    # -- events ----------------------------------------------------------------------------
    def on_signal(self, sig: int, now: float) -> None:
        """SIGUSR1/SIGTERM/SIGINT. STARTING or RUNNING: every agent is asked to checkpoint
        (SIGNALLED). ENDING: only noted (the step is aborted; the supervisor's decision reads
        `Signals.seen`). SIGNALLED: noted (a SIGTERM after SIGUSR1 makes the end TERMINATED)."""
        first = self.signals.note(sig)
        if self.signals.seen is None:
            return  # not a signal of ours
        if first:
            self.events.signal(now)
        if self.phase not in (StepPhase.STARTING, StepPhase.RUNNING):
            return
        self._to(StepPhase.SIGNALLED)
        request = self._usr1_request()
        near = (f" (the time limit in {request['left_s']} s)" if "left_s" in request else "")
        log(f"{signal.Signals(sig).name} received: asking every worker to checkpoint{near}")
        for conn in self.st.conns:
            if not conn.closed and conn.node is not None:
                conn.send(request)

    def on_message(self, conn: Conn, msg: dict[str, object], now: float) -> str | None:
        """Act on one signed message; a reason to drop the connection, or None."""
        del now  # the connection's last_seen is set by its read
        st = self.st
        if conn.node is None:
            return self._on_hello(conn, msg)
        if msg.get("t") == "gone":
            self._forget(conn.node, msg.get("ranks"))
        elif msg.get("t") == "exit":
            conn.took_exit(msg)
            # A non-zero exit is the step's failure unless the step was already ending (then
            # it is the answer to the abort).
            if (conn.exit_rc not in (None, 0) and st.first_failure is None
                    and self.phase in (StepPhase.STARTING, StepPhase.RUNNING)):
                st.first_failure = (conn.node, conn.exit_rc or 1)
                st.failure_why = conn.why
        return None

    def on_closed(self, conn: Conn) -> None:
        """The agent's connection closed (EOF): a node of the step that did not report its
        exit is lost, in any phase; a connection without a hello is forgotten."""
        self._close(conn)
        if conn.node is None:
            self.st.conns.remove(conn)
        elif conn.exit_rc is None:
            self.st.lost.setdefault(conn.node, Loss.closed())

    def _forget(self, node: str, ranks: object) -> None:
        """A node's agent says these ranks' processes went away before their training ended
        (torchrun restarted its workers): the hang watchdog forgets their last beats, as at
        the step's start it has none, until the new processes beat. Only the node's own ranks,
        only while the step runs; their old processes' beats are refused from now on."""
        st = self.st
        if self.phase not in (StepPhase.STARTING, StepPhase.RUNNING) or not isinstance(
                ranks, list):
            return
        forgot = []
        for item in ranks[:st.per_node()]:
            if not (isinstance(item, list) and len(item) == 2
                    and all(type(x) is int and x >= 0 for x in item)):
                continue
            rank, pid = item
            beat = st.beats.get(rank)
            if beat is None or beat.node != node or beat.finished:
                continue
            if len(st.gone) >= 4 * st.max_ranks:
                st.gone.clear()  # a bound; an old process's late beat is then only a beat
            st.gone.add((rank, pid))
            del st.beats[rank]
            st.progress.pop(rank, None)
            forgot.append(rank)
        if forgot and st.restarts_logged < MAX_DROP_LOGS:
            st.restarts_logged += 1
            log(f"rank(s) {','.join(map(str, forgot))} on {node} restarted: the hang watchdog "
                "waits for their first beat again")

    # -- the end ---------------------------------------------------------------------------
    def begin_end(self, now: float, hang: Hang | None) -> None:
        """ENDING: agents kill their torchrun. Every connected agent must answer by the
        deadline or is lost; a node whose agent has not connected yet is told `abort` at its
        hello and is lost only past --connect-timeout (never for its slowness alone)."""
        st = self.st
        self._to(StepPhase.ENDING)
        self.hang = hang
        self.detected_at = now
        self.failed_at = failure_time(st.lost, {c.node: c.last_seen for c in st.conns if c.node},
                                      st.started, now,
                                      hang.beat.last_progress if hang is not None else None)
        for conn in st.conns:
            if not conn.closed and conn.node is not None and conn.exit_rc is None:
                self._abort(conn)
        self.end_deadline = now + self.cfg.node_timeout + self.cfg.abort_grace_s

    def _abort(self, conn: Conn) -> None:
        conn.aborted = True
        conn.send({"t": "abort"})

    def _awaited(self) -> list[str]:
        """ENDING: the nodes whose agent was told to abort and has neither answered nor is
        lost."""
        st = self.st
        return [n for n, c in st.agents.items() if n not in st.lost and c.exit_rc is None]

    def _advance_ending(self, now: float) -> None:
        st = self.st
        awaited = self._awaited()
        if awaited and now < self.end_deadline:
            return
        for node in awaited:
            st.lost[node] = Loss.no_abort_answer()
        # srun ends on its own once every node's agent has: not with a node lost (it waits
        # for that node's tasks), so it is killed at once then (issue 37: 0.5 s of every
        # crash's step end was this wait, always in vain).
        reap(self.srun, 0.0 if st.lost else 0.5)
        hang = self.hang
        kind, rc, cause = self._ended_how(hang)
        self._done(StepResult(kind, rc, cause, dict(st.lost), hang.beat.node if hang else None,
                              self.failed_at, self.detected_at, hang.rank if hang else None))

    def _close_all(self) -> None:
        if self.st.dropped > MAX_DROP_LOGS:
            log(f"{self.st.dropped - MAX_DROP_LOGS} more connection(s) dropped in this step")
        for conn in self.st.conns:
            self._close(conn)
        if self.srun.poll() is None:
            self.srun.kill()
            wait_killed(self.srun)

    # -- the pump --------------------------------------------------------------------------
    def pump(self) -> None:
        """One round: signals, new agents, agent messages, beats, srun, node timeouts."""
        ready = {key.fileobj for key, _ in self.ends.sel.select(TICK_S)}
        if not self.backlog and self.ends.listen not in ready and self.signals.wake_r not in ready:
            # Beats and pings alone: taken in batches, a turn (and its checks over every
            # node) at most TURN_S after the last; not one turn per datagram (docs/scale.md).
            turn = min(TURN_MAX_S, max(TURN_S, TURN_PER_NODE_S * len(self.st.nodes)))
            time.sleep(max(0.0, self.last_turn + turn - time.monotonic()))
        now = self.last_turn = time.monotonic()
        for sig in self.signals.drain():
            self.on_signal(sig, now)
        if self.ends.udp in ready:
            self._read_beats(now)
        # Reads before accepts: hellos already sent are taken before new connections can push
        # their senders out of the pending set.
        for conn in [c for c in self.st.conns if not c.closed and c.sock in ready]:
            self._read_agent(conn, now)
        self.events.pump()  # the goodput events' copy, a bounded part a tick
        for conn in [c for c in self.st.conns if not c.closed and (c.chan.out or c.chan.broken)]:
            conn.chan.flush()  # what a slow reader left pending: whole lines only
            if conn.chan.broken is not None:
                self._drop(conn, conn.chan.broken)
        if self.ends.listen in ready:
            self._accept(now)
        self._deadlines(now)

    def _deadlines(self, now: float) -> None:
        st = self.st
        if st.srun_rc is None and (rc := self.srun.poll()) is not None:
            st.srun_rc, st.srun_exit_at = rc, now
        # The passes over every connection and node, DEADLINE_CHECK_S apart (not every turn:
        # 1,024 nodes' passes 20 times a second were a fifth of the steady CPU).
        if now - self.deadlines_checked < DEADLINE_CHECK_S:
            return
        self.deadlines_checked = now
        for conn in [c for c in st.conns if c.node is None]:
            if now - conn.opened > HELLO_DEADLINE_S:
                self._drop(conn, f"no signed hello in {HELLO_DEADLINE_S:.0f} s")
        by_node = st.by_node()
        for node in st.unaccounted():
            agent = by_node.get(node)
            if agent is None:
                if now - st.started > self.cfg.connect_timeout:
                    st.lost[node] = Loss.never_connected(self.cfg.connect_timeout)
            elif now - agent.last_seen > self.cfg.node_timeout:
                st.lost[node] = Loss.silent(now - agent.last_seen)

    def _read_agent(self, conn: Conn, now: float) -> None:
        try:
            msgs = conn.read(now)
        except ChannelError as exc:
            self._drop(conn, str(exc))
            return
        if msgs is None:
            self.on_closed(conn)
            return
        for msg in msgs:
            why = self.on_message(conn, msg, now)
            if why is not None:
                self._drop(conn, why)
                return

    def _usr1_request(self) -> dict[str, object]:
        """The checkpoint request: at SIGUSR1 with the job's time left when its limit is near
        (the agents' wait for a handler follows it); at SIGTERM, or the limit unknown, bare."""
        if self.signals.seen != signal.SIGUSR1 or self.clock is None:
            return {"t": "usr1"}
        return usr1_request(self.clock.left())

    def _accept(self, now: float) -> None:
        st = self.st
        # The pending cap grows with the step's agents that have not said hello yet: a
        # member's start storm (every agent of 1,024 nodes connects at once) must never push
        # its own hellos out; a non-member can still hold at most MAX_PENDING more, and the
        # oldest pending goes first (docs/scale.md).
        pending = [c for c in st.conns if c.node is None]
        cap = MAX_PENDING + max(0, len(st.nodes) - (len(st.conns) - len(pending)))
        # As many as fit without pushing one out (a member's whole storm in one turn: the
        # turns, each O(nodes), stay few), then MAX_ACCEPT_PER_TICK that may push the oldest
        # out (a flood's pace, as before: an accepted agent is read before it can go).
        for _ in range(MAX_ACCEPT_PER_TICK + max(0, cap - len(pending))):
            try:
                sock, _ = self.ends.listen.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # EMFILE and the like: the backlog waits, the loop goes on
                log(f"accept: {exc.strerror or exc}")
                return
            if len(pending) >= cap:
                self._drop(pending.pop(0), f"more than {cap} connections without a hello")
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
            self.ends.sel.register(sock, selectors.EVENT_READ)

    def _close(self, conn: Conn) -> None:
        if conn.closed:
            return
        conn.closed = True
        try:
            self.ends.sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        try:
            conn.sock.close()
        except OSError:
            pass

    def _drop(self, conn: Conn, why: str) -> None:
        """Close a connection that broke the protocol. One that was an agent of the step (it
        had the secret) counts as a lost node; any other is forgotten."""
        st = self.st
        st.dropped += 1
        if st.dropped <= MAX_DROP_LOGS:
            try:
                host, port = conn.sock.getpeername()[:2]
                peer = f"{host}:{port}"
            except OSError:
                peer = "?"
            log(f"dropped a connection from {safe_name(peer)}: {why}")
        self._close(conn)
        if conn.node is None:
            st.conns.remove(conn)
        elif conn.exit_rc is None:
            st.lost.setdefault(conn.node, Loss.protocol(why))

    def _read_beats(self, now: float) -> None:
        st = self.st
        self.backlog = True  # until a read finds nothing more (a save's burst of 8 N datagrams)
        for _ in range(max(MAX_BEATS_PER_TICK, st.max_ranks // 4)):
            try:
                data = self.ends.udp.recv(UDP_RECV)
            except OSError:  # nothing more now (BlockingIOError), or the socket failed
                self.backlog = False
                return
            if data.startswith(_AGG_HEAD):
                self._take_agg(parse_agg(data, st.agg_key, st.max_ranks), now)
                continue
            if self.events.datagram(data, st.beat_key, st.max_ranks, now):
                continue  # a checkpoint record (goodput events), not a beat
            # A rank's own beat: ranks whose agent could not aggregate beat here directly.
            beat = parse_beat(data, st.beat_key)
            # A signed beat from this step's own ranks always passes these: a rank the step
            # cannot have, or progress older than the step, is not one of ours.
            if beat is None or beat.rank >= st.max_ranks or beat.age_s > now - st.started + 5:
                continue
            if not fresh_seq(st.seqs, (beat.rank, beat.pid), beat.seq, 4 * st.max_ranks):
                continue  # a replayed or reordered beat
            if st.gone and (beat.rank, beat.pid) in st.gone:
                continue  # a restarted rank's old process
            self.events.progress(now - beat.age_s)
            st.record(beat.rank, RankBeat(safe_name(beat.node), beat.step, now - beat.age_s,
                                          beat.in_collective, safe_name(beat.where, 200),
                                          beat.finished, beat.at_request))

    def _take_agg(self, agg: Agg | None, now: float) -> bool:
        """A node agent's aggregate: each of its ranks' last beats into the hang watchdog's
        records, as a rank's own beat would be. Refused whole (False) when it did not parse
        (unsigned, oversized, malformed, a rank outside the step), names a node not of this
        step, holds more ranks than a node has or progress older than the step, or is not
        newer than the last from that node's agent (a replay)."""
        st = self.st
        life = now - st.started + 5
        node_no = st.node_index.get(agg.node) if agg is not None else None
        if (agg is None or node_no is None or len(agg.ranks) > st.per_node()
                or any(r.age_s > life for r in agg.ranks)
                or not fresh_seq(st.agg_seqs, (node_no, agg.pid), agg.seq, 4 * len(st.nodes))):
            st.refused_aggs += 1
            return False
        self.events.progress(now - min(r.age_s for r in agg.ranks))
        for r in agg.ranks:
            if st.gone and (r.rank, r.pid) in st.gone:
                continue  # a restarted rank's old process (a datagram sent before its end)
            st.record(r.rank, RankBeat(agg.node, r.step, now - r.age_s, r.in_collective,
                                       r.where, r.finished, r.at_request))
        return True

    def _on_hello(self, conn: Conn, msg: dict[str, object]) -> str | None:
        st = self.st
        node = msg.get("node")
        if msg.get("t") != "hello" or not isinstance(node, str):
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
            # a copy of the goodput events on a second node (events_copy.CopyWriter): the
            # record of this attempt outlives this (the batch) node
            self.events.attach(conn.chan)
        if HELLO_ANSWER.get(self.phase, "abort") == "abort":
            # The step is ending: this agent must not start a torchrun (it would be killed at
            # the deadline as a node that did not answer, and its healthy node excluded).
            self._abort(conn)
        else:
            if st.rdzv_port is not None:
                # Once the port is known, each later hello gets its own go: no walk over
                # every agent per hello (1,024 hellos x 1,024 agents at each step start).
                for c in st.conns if node == st.nodes[0] else [conn]:
                    if c.node is not None and not c.go_sent and not c.aborted \
                            and not c.closed:
                        c.send(go_message(st, c.node, st.rdzv_port))
                        c.go_sent = True
            if self.phase is StepPhase.SIGNALLED:
                conn.send(self._usr1_request())
        if self.phase is StepPhase.STARTING and len(st.agents) == len(st.nodes):
            self._to(StepPhase.RUNNING)
        return None

    # -- how it ended ----------------------------------------------------------------------
    def _ended_how(self, hang: Hang | None) -> tuple[StepEnd, int, str]:
        st = self.st
        lost = lost_text(st.lost)
        if hang is not None:
            return StepEnd.HANG, 1, hang.describe() + (f"; {lost}" if lost else "")
        if st.lost:
            return StepEnd.LOST, 1, lost
        node, rc = st.first_failure or ("?", 1)
        if st.failure_why:
            return StepEnd.FAILED, rc, (f"exit {rc} ({st.failure_why}; not a lost node, so no "
                                        "relaunch or requeue)")
        return StepEnd.FAILED, rc, (f"exit {rc} (rank failure on {node}; every node answered, "
                                    "so no relaunch: torchrun --max-restarts retries in place)")

    def _after_signal(self, now: float) -> StepResult:
        st = self.st
        reap(self.srun, 2.0)
        self._read_beats(now)  # the ranks' last word on how their training ended
        exits = st.exits()
        if (exits and not st.lost and set(exits.values()) == {0}
                and not any(c.signalled for c in st.conns)):
            return StepResult(StepEnd.OK, 0, "exit 0")  # done before the signal
        if exits and not st.lost and set(exits.values()) == {0} and st.training_ended():
            return StepResult(StepEnd.OK, 0, "exit 0 (the training ended before the checkpoint "
                              "signal could be acted on: nothing to requeue for)")
        termed = [c for c in st.conns if c.termed]
        # A node lost in the checkpoint window goes into the result: the requeue lets go of
        # it (else the job waits in COMPLETING for SlurmdTimeout) and the goodput end names it.
        return signal_result(self.signals.seen, exits, st.srun_rc,
                             sum(c.termed for c in termed),
                             max((c.waited for c in termed), default=USR1_UNCAUGHT_S),
                             lost=dict(st.lost))


def signal_result(seen: int | None, exits: dict[str, int], srun_rc: int | None,
                  termed: int, waited: float = USR1_UNCAUGHT_S,
                  lost: Mapping[str, Loss] | None = None) -> StepResult:
    """A step that ended after the checkpoint signal (SIGNAL: requeue) or Slurm's SIGTERM
    (TERMINATED). `waited`: how long the agents held the signal for the `termed` workers;
    `lost`: nodes lost meanwhile (in the result: let go of at the requeue, named in the
    goodput end)."""
    lost = dict(lost or {})
    if not lost:
        return _signal_result(seen, exits, srun_rc, termed, waited)
    res = _signal_result(seen, exits, srun_rc, termed, waited)
    return StepResult(res.kind, res.rc, f"{res.cause}; {lost_text(lost)}", lost)


def _signal_result(seen: int | None, exits: dict[str, int], srun_rc: int | None,
                   termed: int, waited: float) -> StepResult:
    codes = ",".join(map(str, sorted(set(exits.values()))
                         or [srun_rc if srun_rc is not None else -1]))
    name = signal.Signals(seen or signal.SIGUSR1).name
    if seen == signal.SIGUSR1 and termed:
        # A script with no handler for bv's signal: torchrun's SIGTERM stop, not a kill.
        return StepResult(StepEnd.SIGNAL, 0, f"checkpoint signal {name} from Slurm; {termed} "
                          f"worker(s) had no handler for it after {waited:.0f} s and "
                          "were stopped with SIGTERM through torchrun (its grace period), no "
                          f"checkpoint from them; exited {codes}, requeued by bv")
    if seen == signal.SIGUSR1:
        return StepResult(StepEnd.SIGNAL, 0, f"checkpoint signal {name} from Slurm, workers "
                          f"exited {codes}, requeued by bv")
    return StepResult(StepEnd.TERMINATED, 128 + int(seen or 15),
                      f"{name} from Slurm (scancel, operator requeue or preemption): workers "
                      f"asked to checkpoint, exited {codes}")
