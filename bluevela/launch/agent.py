"""The node agent: the one task ``srun`` starts on each node of a step.

    python3 -P -m bluevela.launch.agent -- torchrun [options] script [args]

The supervisor (bluevela/launch/supervisor.py) starts it with ``srun`` for every step, with
the step's secret, the supervisor's address and the rendezvous node in the environment. The
agent connects back (the signed line channel, bluevela/protocol/channel.py), says hello (with a
free port for the c10d store on the rendezvous node), pings (every ``BV_PING_S``, the
supervisor's fifth of its node timeout; else every second), and moves through
four phases:

- WAITING: no torchrun yet. ``go`` (with the store's port, this node's rank in the step and
  the node count: torch's static rendezvous, issue 37) starts torchrun; ``abort`` ends the
  agent with 1.
- RUNNING: torchrun runs. ``usr1`` (or a SIGUSR1 from srun) sends SIGUSR1 to every worker
  once it handles it (a worker that never does gets torchrun's SIGTERM stop after the wait
  of bluevela/launch/usr1_wait.py: ``BV_USR1_WAIT_S``, else what the job's time left allows
  when the request carries it, else 30 s); ``abort`` moves to ABORTING.
- ABORTING: torchrun's group got SIGTERM; ABORT_KILL_S later everything under it is killed.
- DONE: torchrun ended (or could not start): one ``exit`` message with its status, then the
  agent exits with it. When the supervisor is gone the agent kills torchrun's tree and ends.

The goodput events the supervisor streams (``ev``) are appended to this node's copy
(`events_copy.CopyWriter`) in any phase.

The ranks' heartbeats come to the agent, not to the supervisor (`Aggregator`): torchrun's
``BV_HEARTBEAT`` names a loopback UDP port of the agent's; each beat is verified there as the
supervisor verified it (signed with the step's beat key: a beat from another user of the node
does not pass; its seq must rise per rank and process), and every beat interval the agent
sends the supervisor ONE signed datagram with each local rank's last beat (`messages.Agg`),
its age brought up to the send. The supervisor's hang watchdog then sees every rank as before
(the first stuck rank is named with its node) from one datagram a node instead of one a rank.
Checkpoint datagrams still go straight to the supervisor (``BV_CHECKPOINT_ADDR``). Node
liveness stays on the line channel (the pings). Standard library only: it runs on every node
of a job.
"""

from __future__ import annotations

import enum
import errno
import os
import selectors
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence

from bluevela.launch import warm
from bluevela.launch.events_copy import CopyWriter
from bluevela.launch.proctree import (
    catches,
    kill_group,
    kill_tree,
    signal_pid,
    wait_killed,
    worker_pids,
)
from bluevela.launch.rdzv_guard import GuardUnavailable, torchrun_start
from bluevela.launch.usr1_wait import USR1_WAIT_ENV, explicit_wait, handler_wait, request_left
from bluevela.protocol.channel import Channel, ChannelError, read_challenge
from bluevela.protocol.keys import SECRET_ENV, agg_key, beat_key, line_key, secret_from_env
from bluevela.protocol.messages import (
    AGG_MAX_RANKS,
    Agg,
    AggRank,
    Beat,
    format_agg,
    fresh_seq,
    parse_beat,
)
from bluevela.protocol.names import printable, safe_name
from bluevela.runtime.heartbeat import CKPT_ENV, ENV_ADDR, interval, parse_addr
from bluevela.runtime.world import training_env

SUPERVISOR_ENV = "BV_SUPERVISOR"  # HOST:PORT of the supervisor's line channel
# torchrun's rendezvous, in the environment only (/proc/PID/environ: the owner and root).
RDZV_ENDPOINT_ENV = "PET_RDZV_ENDPOINT"
RDZV_NODE_ENV = "BV_RDZV_NODE"  # the step's first node, where the store runs
NODE_RANK_ENV = "PET_NODE_RANK"  # torchrun's --node-rank: this node's place in the step (go)
STATIC_FLAG = "--rdzv-backend=static"  # on torchrun's argv: the supervisor's choice per step
PING_S = 1.0
PING_ENV = "BV_PING_S"  # seconds between pings (the supervisor's, from its node timeout)
TICK_S = 0.2
CONNECT_FOR_S = 30.0
# An aborted step is broken (a peer is gone, or it hangs): no checkpoint can complete, so
# torchrun's SIGTERM is followed by SIGKILL to everything under it soon after (bv's ranks
# take SIGTERM as a checkpoint request and hold on up to their grace: nothing to wait for).
# Issue 37: 0.5 s before, the largest part of a crash's step end.
ABORT_KILL_S = 0.1
# While aborting, the loop looks at torchrun this often (else every TICK_S): its end is the
# step's end on this node, and nothing else wakes the loop for it.
ABORT_TICK_S = 0.02
# A node with a worker that never installed a SIGUSR1 handler gets torchrun's own stop
# (SIGTERM to torchrun: forwarded to the workers, SIGKILL 30 s later), never SIGUSR1's kill:
# after 30 s, the job's BV_USR1_WAIT_S, or what its time left allows (usr1_wait.py).
LOCAL_MAX_RANKS = 1024  # ranks one node can have (the supervisor's bound per node)
BEATS_PER_READ = 4096  # beats read per turn at most (then the channel gets its turn)


def agent_argv() -> list[str]:
    """The agent's command, before torchrun's argv. -P: the job's working directory is not on
    the agent's import path (a module planted there, e.g. select.py, would run as the job's
    user inside every node agent)."""
    return [sys.executable, "-P", "-m", "bluevela.launch.agent", "--"]


def endpoint_env(host: str, port: int, node_rank: int | None = None) -> dict[str, str]:
    """torchrun's ``--rdzv-endpoint`` (the agent adds it once the rendezvous node's agent has
    found a free port there) and, for its static rendezvous, ``--node-rank``: through the
    environment."""
    env = {RDZV_ENDPOINT_ENV: f"{host}:{port}"}
    if node_rank is not None:
        env[NODE_RANK_ENV] = str(node_rank)
    return env


def parse_go(msg: Mapping[str, object]) -> tuple[int, int | None, int | None] | None:
    """A ``go``'s (port, node rank, node count), or None when it is malformed (then it is
    ignored, as a go without a port always was). The supervisor sends all three (issue 37:
    torch's static rendezvous); a go without the rank and count starts torchrun without them."""
    port, rank, nnodes = msg.get("port"), msg.get("node_rank"), msg.get("nnodes")
    if type(port) is not int or not 1 <= port <= 65535:
        return None
    if rank is None and nnodes is None:
        return port, None, None
    if type(rank) is not int or type(nnodes) is not int or not 0 <= rank < nnodes:
        return None
    return port, rank, nnodes


def free_port() -> int:
    """A TCP port free on this node now, the kernel's pick: torchrun's c10d store binds it
    moments later. A fixed port (29500) could be taken first by any user of the node."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("", 0))
        return int(probe.getsockname()[1])


def _log(line: str) -> None:
    sys.stderr.write(f"bv supervisor: {line}\n")
    sys.stderr.flush()


def _seconds(text: str | None, default: float) -> float:
    try:
        value = float(text) if text else default
    except ValueError:
        return default
    return value if 0 <= value <= 600 else default


# --------------------------------------------------------------------------------------------
# The channel to the supervisor


def connect(addr: str, node: str, key: bytes) -> Channel | None:
    """The signed channel to the supervisor at `addr` (HOST:PORT), retried for
    CONNECT_FOR_S; None (said on stderr) when it cannot be reached."""
    host, _, port = addr.rpartition(":")
    deadline = time.monotonic() + CONNECT_FOR_S
    while True:
        sock: socket.socket | None = None
        try:
            sock = socket.create_connection((host, int(port)), timeout=5)
            nonce = read_challenge(sock)
            if nonce is None:
                raise OSError("no challenge from the supervisor")
            return Channel(sock, key, nonce, b"a")
        except (OSError, ValueError) as exc:
            if sock is not None:
                sock.close()
            if time.monotonic() > deadline:
                _log(f"agent on {safe_name(node)}: cannot reach the supervisor at "
                     f"{safe_name(addr)}: {exc}")
                return None
            time.sleep(0.2)


def _receive(chan: Channel) -> list[dict[str, object]] | None:
    """The supervisor's messages now readable; None when it is gone or its line does not
    verify (then the channel cannot be trusted either)."""
    try:
        return chan.receive()
    except ChannelError as exc:
        _log(f"agent: {exc} from the supervisor")
        return None


# --------------------------------------------------------------------------------------------
# The ranks' beats, aggregated


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: it exists
        return True
    return True


class Aggregator:
    """This node's ranks' beats, received on a loopback UDP port, sent on to the supervisor
    as one signed aggregate per beat interval (`messages.Agg`).

    A beat counts only when it verifies with the step's beat key, names a rank below
    `max_rank` (LOCAL_MAX_RANKS ranks kept at most), and its seq rises for its (rank, pid)
    (a replayed or reordered beat changes nothing). The newest beat of each rank is kept with
    the time it came; a rank whose process is gone is forgotten (torchrun restarted it, maybe
    on another node: an old beat of it must not keep coming back with a growing age)."""

    def __init__(self, node: str, secret: bytes, upstream: tuple[str, int],
                 max_rank: int = 1 << 20) -> None:
        self.node = node
        self.beat_key = beat_key(secret)
        self.agg_key = agg_key(secret)
        self.upstream = upstream
        self.max_rank = max_rank
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)  # the ranks' beats
        # The aggregates leave by a socket of their own: one bound to loopback cannot send
        # to another host (EINVAL).
        self.out = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            self.sock.bind(("127.0.0.1", 0))
            self.sock.setblocking(False)
            self.out.setblocking(False)
        except OSError:
            self.close()
            raise
        self.pid = os.getpid()
        self.seq = 0
        self.ranks: dict[int, tuple[Beat, float]] = {}  # rank -> (its newest beat, received)
        self.seqs: dict[tuple[int, int], int] = {}  # (rank, pid) -> last seq
        self.refused = 0  # datagrams that did not verify or were stale
        self.last_sent = 0.0
        # Ranks whose end (finished, and how) the supervisor has not been sent yet: sent at
        # once, and kept for that send even when the rank's process is already gone (it
        # tells the supervisor whether a late checkpoint signal is a reason to requeue).
        self.news: set[int] = set()
        # (rank, pid) of ranks whose process went away before their training ended: torchrun
        # restarted them (--max-restarts). The supervisor is told (a `gone` line) so that its
        # hang watchdog forgets their last beat: a restart and a checkpoint load longer than
        # the hang timeout is not a hang (issue 33).
        self.restarted: set[tuple[int, int]] = set()
        self.send_error = ""  # the first failed send's reason (said once on stderr)

    def addr(self) -> str:
        return f"127.0.0.1:{self.sock.getsockname()[1]}"

    def close(self) -> None:
        self.sock.close()
        self.out.close()

    def read(self, now: float) -> int:
        """Take the beats waiting now (BEATS_PER_READ at most); how many counted."""
        took = 0
        for _ in range(BEATS_PER_READ):
            try:
                data = self.sock.recv(2048)
            except OSError:  # nothing more now (BlockingIOError), or the socket failed
                break
            if self.take(data, now):
                took += 1
        return took

    def take(self, data: bytes, now: float) -> bool:
        """One datagram: True when it is a fresh beat of this step's ranks."""
        beat = parse_beat(data, self.beat_key)
        if (beat is None or beat.rank >= self.max_rank
                or (beat.rank not in self.ranks and len(self.ranks) >= LOCAL_MAX_RANKS)
                or not fresh_seq(self.seqs, (beat.rank, beat.pid), beat.seq,
                                 4 * LOCAL_MAX_RANKS)):
            self.refused += 1
            return False
        prev = self.ranks.get(beat.rank)
        if beat.finished and (prev is None or (prev[0].finished, prev[0].at_request)
                              != (beat.finished, beat.at_request)):
            self.news.add(beat.rank)
        self.ranks[beat.rank] = (beat, now)
        return True

    def datagrams(self, now: float) -> list[bytes]:
        """The signed aggregates of every rank heard from whose process is alive, each rank's
        age brought up to `now` (AGG_MAX_RANKS a datagram)."""
        gone = {r for r, (b, _) in self.ranks.items() if not _alive(b.pid)}
        entries = [AggRank(b.rank, b.pid, b.step, b.age_s + max(0.0, now - at),
                           b.in_collective, b.where, b.finished, b.at_request)
                   for b, at in (self.ranks[r] for r in sorted(self.ranks))
                   if b.rank not in gone or b.rank in self.news]
        for rank in gone:
            beat = self.ranks.pop(rank)[0]
            if not beat.finished:
                self.restarted.add((rank, beat.pid))
        self.news.clear()
        out = []
        for i in range(0, len(entries), AGG_MAX_RANKS):
            self.seq += 1
            out.append(format_agg(Agg(self.node, self.pid, self.seq,
                                      tuple(entries[i:i + AGG_MAX_RANKS])), self.agg_key))
        return out

    def send(self, now: float) -> int:
        """Send the aggregates now (non-blocking: a full buffer skips this interval's)."""
        self.last_sent = now
        sent = 0
        for data in self.datagrams(now):
            try:
                self.out.sendto(data, self.upstream)
                sent += 1
            except (BlockingIOError, InterruptedError):
                pass
            except OSError as exc:  # unreachable, a refusal: said once, tried next interval
                if not self.send_error:
                    self.send_error = exc.strerror or str(exc)
                    _log(f"agent on {safe_name(self.node)}: cannot send the ranks' beats to "
                         f"the supervisor: {self.send_error}")
        return sent


def make_aggregator(node: str, secret: bytes, env: Mapping[str, str]) -> Aggregator | None:
    """The aggregator toward the supervisor's beat port (``BV_HEARTBEAT`` of the step); None
    when it has none or no loopback port can be had (the ranks then beat to the supervisor
    directly, as before)."""
    addr = parse_addr(env.get(ENV_ADDR, ""))
    if addr is None:
        return None
    try:
        info = socket.getaddrinfo(addr[0], addr[1], socket.AF_INET, socket.SOCK_DGRAM)
        host, port = info[0][4][:2]
        return Aggregator(node, secret, (str(host), int(port)))
    except OSError as exc:
        _log(f"agent on {safe_name(node)}: no beat aggregation ({exc}): ranks beat to the "
             "supervisor directly")
        return None


# --------------------------------------------------------------------------------------------
# The state machine


class Phase(enum.Enum):
    WAITING = "waiting for go"
    RUNNING = "running"
    ABORTING = "aborting"
    DONE = "done"


class Agent:
    """One node's agent on a connected channel; `run()` returns its exit status."""

    def __init__(self, chan: Channel, node: str, torchrun: Sequence[str],
                 env: Mapping[str, str], beats: Aggregator | None = None) -> None:
        self.chan = chan
        self.beats = beats
        self.beat_every = interval(env)
        self.node = node
        self.torchrun = list(torchrun)
        self.env = env
        self.rdzv_node = env.get(RDZV_NODE_ENV, "") or node
        self.copy = CopyWriter(env, node)  # the goodput events, when this node keeps them
        self.usr1_explicit = explicit_wait(env.get(USR1_WAIT_ENV))
        self.usr1_end: float | None = None  # monotonic: the job's time limit, when near
        self.ping_s = min(30.0, max(0.2, _seconds(env.get(PING_ENV), PING_S)))
        self.phase = Phase.WAITING
        self.code = 1  # the exit status, once DONE
        # torchrun once the supervisor says go (or the warm start's ranks: launch/warm.py)
        self.proc: subprocess.Popen[bytes] | warm.WarmRun | None = None
        self.node_rank: int | None = None  # this node's place in the step, from go
        self.nnodes: int | None = None  # the step's node count, from go
        self.want_usr1 = False
        self.usr1_at: float | None = None
        self.signalled: set[int] = set()  # workers sent SIGUSR1
        self.termed = 0  # workers that had no SIGUSR1 handler: torchrun was sent SIGTERM for them
        self.aborting_at = 0.0
        self.last_ping = 0.0
        self.wake_r = -1

    def hello(self) -> None:
        msg: dict[str, object] = {"t": "hello", "node": self.node, "pid": os.getpid()}
        if self.node == self.rdzv_node:
            msg["port"] = free_port()
        self.chan.send(msg)

    def run(self) -> int:
        sel = self._install()
        while self.phase is not Phase.DONE:
            tick = ABORT_TICK_S if self.phase is Phase.ABORTING else TICK_S
            self._tick({key.fileobj for key, _ in sel.select(tick)})
        return self.code

    def _install(self) -> selectors.BaseSelector:
        """Signals wake the select loop; SIGUSR1 (srun may forward one) is handled in it."""
        self.chan.sock.setblocking(False)
        signal.signal(signal.SIGUSR1, lambda *_: None)
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_w, False)
        os.set_blocking(wake_r, False)
        signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
        # SIGTERM: Slurm signals torchrun and the workers directly (proctrack); stay to report.
        signal.signal(signal.SIGTERM, lambda *_: None)
        signal.signal(signal.SIGINT, lambda *_: None)
        self.wake_r = wake_r
        sel = selectors.DefaultSelector()
        sel.register(self.chan.sock, selectors.EVENT_READ)
        sel.register(wake_r, selectors.EVENT_READ)
        if self.beats is not None:
            sel.register(self.beats.sock, selectors.EVENT_READ)
        return sel

    def _tick(self, ready: set[object]) -> None:
        if self.wake_r in ready:
            self._read_signals()
        if self.beats is not None:
            now = time.monotonic()
            if self.beats.sock in ready:
                self.beats.read(now)
            if self.beats.ranks and (self.beats.news
                                     or now - self.beats.last_sent >= self.beat_every):
                self.beats.send(now)
            if self.beats.restarted:
                self.chan.send({"t": "gone", "ranks": sorted(map(list, self.beats.restarted))})
                self.beats.restarted.clear()
        self.chan.flush()  # lines a slow reader left pending: whole lines only (Channel.send)
        if self.chan.broken is not None:
            _log(f"agent on {safe_name(self.node)}: the channel to the supervisor broke "
                 f"({self.chan.broken})")
        if self.chan.broken is not None or self.chan.sock in ready:
            msgs = None if self.chan.broken is not None else _receive(self.chan)
            if msgs is None:
                self._supervisor_gone()
                return
            for msg in msgs:
                self._on_msg(msg)
                if self.phase is Phase.DONE:
                    return
        if self.proc is None:
            if self.phase is Phase.ABORTING:
                self._finish(1)
                return
        else:
            self._watch(self.proc)
            if self.phase is Phase.DONE:
                return
        self._ping()

    def _read_signals(self) -> None:
        try:
            if signal.SIGUSR1 in os.read(self.wake_r, 1024):
                self.want_usr1 = True
        except BlockingIOError:
            pass

    def _on_msg(self, msg: dict[str, object]) -> None:
        kind = msg.get("t")
        if kind in ("ev", "ev_synced"):
            self.copy.feed(msg)
        elif kind == "usr1":
            self.want_usr1 = True
            left = request_left(msg)
            if left is not None:
                end = time.monotonic() + left
                self.usr1_end = end if self.usr1_end is None else min(self.usr1_end, end)
            elif "left_s" in msg:
                _log(f"agent on {safe_name(self.node)}: a checkpoint request with a bad "
                     "left_s: ignored")
        elif kind == "go" and self.phase is Phase.WAITING:
            go = parse_go(msg)
            if go is not None:
                port, self.node_rank, self.nnodes = go
                self._start(port)
        elif kind == "abort" and self.phase in (Phase.WAITING, Phase.RUNNING):
            self.phase = Phase.ABORTING
            self.aborting_at = time.monotonic()
            if self.proc is not None:
                kill_group(self.proc, signal.SIGTERM)

    def _start(self, port: int) -> None:
        try:
            # torch's own torchrun runs with its rendezvous state unpickled through an
            # allow-list (the store has no authentication), this node named its host or not.
            start = torchrun_start(self.torchrun, host=self.node == self.rdzv_node, env=self.env)
        except GuardUnavailable as exc:  # the step's failure, as a torchrun that cannot start
            if self.node == self.rdzv_node:  # once a step (the end line carries it too)
                _log(f"agent on {safe_name(self.node)}: {exc}")
            self._finish(126, str(exc))
            return
        if start.note and self.node == self.rdzv_node:  # said once a step, not once a node
            _log(f"agent on {safe_name(self.node)}: {start.note}")
        if warm.enabled(self.env) and self._start_warm(port, start.env):
            return
        try:
            self.proc = subprocess.Popen(
                start.argv, start_new_session=True,
                env={**training_env(self.env, self.torchrun), **start.env,
                     **endpoint_env(self.rdzv_node, port, self.static_rank()), **self._beat_env()})
        except OSError as exc:
            # A missing or unrunnable torchrun is the step's failure (the shell's 127/126),
            # not a lost node: no relaunch or requeue would mend it.
            why = (f"cannot start {printable(self.torchrun[0])} on {safe_name(self.node)}: "
                   f"{exc.strerror or exc}")
            _log(f"agent: {why}")
            self._finish(127 if exc.errno == errno.ENOENT else 126, why)
            return
        self.phase = Phase.RUNNING

    def _start_warm(self, port: int, guard_env: Mapping[str, str]) -> bool:
        """The warm start (site.yaml launch.warm_start; launch/warm.py): this node's ranks
        forked by its warm parent (else one started here, cold). False when the command is
        one only torchrun runs (the same answer on every node: torchrun then runs)."""
        env = {**training_env(self.env, self.torchrun), **guard_env,
               **endpoint_env(self.rdzv_node, port), **self._beat_env()}
        go = {"node_rank": getattr(self, "node_rank", None),
              "nnodes": getattr(self, "nnodes", None)}
        try:
            run = warm.launch(self.torchrun, env, go, self.node, self.rdzv_node, port)
        except OSError as exc:  # no zygote here: torchrun here alone would split the step
            why = f"no warm start on {safe_name(self.node)}: {exc.strerror or exc}"
            _log(f"agent: {why}")
            self._finish(126, why)
            return True
        if isinstance(run, str):
            if self.node == self.rdzv_node:
                _log(f"agent on {safe_name(self.node)}: torchrun, not the warm start: {run}")
            return False
        if self.node == self.rdzv_node or run.how != "warm":
            _log(f"agent on {safe_name(self.node)}: ranks forked by "
                 + {"warm": "the node's warm parent",
                    "warming": "the node's warm parent (it was still importing)"}.get(
                        run.how, "a cold parent (no warm one on the node)"))
        self.proc = run
        self.phase = Phase.RUNNING
        return True

    def static_rank(self) -> int | None:
        """The node rank torchrun is told: with the static rendezvous only (c10d, kept for
        --max-restarts, assigns its own and warns about one given)."""
        return self.node_rank if STATIC_FLAG in self.torchrun else None

    def _beat_env(self) -> dict[str, str]:
        """The ranks beat to this agent; their checkpoint datagrams go to the supervisor."""
        if self.beats is None:
            return {}
        return {ENV_ADDR: self.beats.addr(), CKPT_ENV: self.env.get(ENV_ADDR, "")}

    def _watch(self, proc: subprocess.Popen[bytes] | warm.WarmRun) -> None:
        """RUNNING or ABORTING: forward SIGUSR1, kill an aborted tree, report torchrun's end."""
        if self.want_usr1:
            self._forward_usr1(proc)
        if (self.phase is Phase.ABORTING
                and time.monotonic() - self.aborting_at > ABORT_KILL_S):
            kill_tree(proc)
        rc = proc.poll()
        if rc is not None:
            self._finish(rc if rc >= 0 else 128 - rc)

    def _forward_usr1(self, proc: subprocess.Popen[bytes] | warm.WarmRun) -> None:
        """A worker still importing has no handler yet and SIGUSR1 would kill it: wait for its
        handler (bluevela.runtime, or bv's framework integration), `usr1_wait` at most; a
        worker that never installs one is not killed by a signal it did not ask for: torchrun
        gets SIGTERM, the stop torchrun users expect (docs/byos.md)."""
        if self.usr1_at is None:
            self.usr1_at = time.monotonic()
        late = time.monotonic() - self.usr1_at > self.usr1_wait
        uncaught = 0
        for pid in (proc.workers() if isinstance(proc, warm.WarmRun)
                    else worker_pids(proc.pid)):
            if pid in self.signalled:
                continue
            if catches(pid, signal.SIGUSR1):
                if signal_pid(pid, signal.SIGUSR1):
                    self.signalled.add(pid)
            elif late:
                uncaught += 1
        if uncaught and not self.termed:
            self.termed = uncaught
            _log(f"agent on {safe_name(self.node)}: {uncaught} worker(s) without a SIGUSR1 "
                 f"handler after {self.usr1_wait:.0f} s: SIGTERM to torchrun (it stops its "
                 "workers, SIGKILL 30 s later)")
            signal_pid(proc.pid, signal.SIGTERM)

    @property
    def usr1_wait(self) -> float:
        """Seconds to hold the checkpoint signal for a worker without a handler, from the
        first request (usr1_wait.handler_wait: the time left measured from then)."""
        left = None
        if self.usr1_end is not None:
            left = self.usr1_end - (self.usr1_at if self.usr1_at is not None else time.monotonic())
        return handler_wait(self.usr1_explicit, left)

    def _ping(self) -> None:
        if time.monotonic() - self.last_ping >= self.ping_s:
            self.chan.send({"t": "ping"})
            self.last_ping = time.monotonic()

    def _finish(self, code: int, why: str = "") -> None:
        """DONE: the one exit message (torchrun's status, or why it could not start), after
        the ranks' last beats (how each one's training ended) have gone out."""
        if self.beats is not None:
            now = time.monotonic()
            self.beats.read(now)
            if self.beats.news:
                self.beats.send(now)
        msg: dict[str, object] = {"t": "exit", "rc": code, "node": self.node,
                                  "signalled": len(self.signalled), "termed": self.termed}
        if self.termed:
            msg["waited"] = round(self.usr1_wait)  # the wait those workers had: the end line
        if why:
            msg["why"] = why
        self.chan.send(msg)
        self.chan.close(linger_s=5.0)
        self.code = code
        self.phase = Phase.DONE

    def _supervisor_gone(self) -> None:
        """DONE without a report: do not leave training running."""
        self.copy.gone()
        if self.proc is not None:
            kill_tree(self.proc)
            wait_killed(self.proc)  # bounded: a torchrun stuck in the kernel is Slurm's
        self.code = 1
        self.phase = Phase.DONE


# --------------------------------------------------------------------------------------------
# Entry


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--"]:
        args = args[1:]
    node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    if not args:
        _log("agent: no torchrun command")
        return 2
    secret = secret_from_env()
    if secret is None:
        _log(f"agent on {safe_name(node)}: no job secret ({SECRET_ENV}) in the environment")
        return 1
    chan = connect(os.environ.get(SUPERVISOR_ENV, ""), node, line_key(secret))
    if chan is None:
        return 1
    agent = Agent(chan, node, args, os.environ, make_aggregator(node, secret, os.environ))
    agent.hello()
    return agent.run()


if __name__ == "__main__":
    sys.exit(main())
