"""The REAL in-job supervisor against N simulated node agents and N x 8 simulated ranks.

The supervisor runs as the batch script runs it (`python3 -P -m bluevela.launch.supervisor
--nodes=N ... -- torchrun --nproc-per-node=8 ...`, bluevela/launch/request.py) with stand-in
`srun`, `scontrol` and `squeue` first on PATH: Slurm is not the point here. The stand-in srun
starts no agent; it records the step it was given (the supervisor's addresses, the step's
secret, the nodes) and waits. This process then plays every node agent of the step (one
selectors loop, one non-blocking TCP connection per agent: challenge, signed hello, go,
a ping every `BV_PING_S`, exit; the messages of the real agent) and a child process plays
what every node's agent sends for its ranks (one signed `bvag1` aggregate per node per
`BV_HEARTBEAT_INTERVAL_S`, spread over the interval, carrying its 8 ranks' last beats, as
`launch/agent.py` `Aggregator` sends them) and every rank's `bvck1` checkpoint datagram
(straight to the supervisor, as the ranks send them), with the protocol's own formatters and
the step's own keys. The ranks' beats to their agent stay on the (simulated) node: the
supervisor never sees them.

One run of `run_scale()` is four launches of one supervisor (N nodes + 3 spares):
1. start storm, steady state, a save of all ranks, then one agent's connection closed;
2. (relaunched on a spare) start storm, then one agent silent (its pings and its ranks'
   beats dropped, the connection left open);
3. (on a spare) one rank's progress stops while its beats go on (a real hang);
4. (the hung node replaced by a spare) every agent exits 0: the supervisor exits 0.

Times are CLOCK_MONOTONIC, the same clock in every process of the machine.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import resource
import selectors
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from _common import loadavg

from bluevela.goodput.events_epilog import collect_files
from bluevela.protocol.channel import Channel, ChannelError, parse_challenge
from bluevela.protocol.keys import agg_key, beat_key, derive
from bluevela.protocol.messages import Agg, AggRank, CkptMsg, format_agg, format_ckpt

RANKS_PER_NODE = 8
SPARES = 3
PING_S = 1.0  # the real agent's (launch/agent.py PING_S)
AGENT_PID0 = 3_000_000  # the simulated agents' pids (their aggregates' sender)

SRUN = """
import json, os, signal, sys, time
out = os.environ["BV_SCALE_DIR"]
nodes = [a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--nodelist=")][0].split(",")
keys = ("BV_SUPERVISOR", "BV_HEARTBEAT", "BV_JOB_SECRET", "BV_RDZV_NODE", "BV_ATTEMPT",
        "BV_HEARTBEAT_INTERVAL_S", "BV_PING_S")
rec = {"pid": os.getpid(), "nodes": nodes, "t": time.monotonic(),
       "env": {k: os.environ.get(k, "") for k in keys}}
n = sum(1 for f in os.listdir(out) if f.startswith("srun.") and f.endswith(".json")) + 1
with open(os.path.join(out, "tmp.json"), "w") as fh:
    json.dump(rec, fh)
os.rename(os.path.join(out, "tmp.json"), os.path.join(out, "srun.%d.json" % n))
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
while True:
    signal.pause()
"""
SCONTROL = """
import os, sys
with open(os.path.join(os.environ["BV_SCALE_DIR"], "scontrol.log"), "a") as fh:
    fh.write(" ".join(sys.argv[1:]) + "\\n")
"""
SQUEUE = "import sys\nsys.exit(1)\n"




def proc_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def proc_mem_kb(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) in KiB."""
    rss = hwm = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1])
        elif line.startswith("VmHWM:"):
            hwm = int(line.split()[1])
    return rss, hwm


def udp_drops(port: int) -> int:
    """The kernel's drop count of the UDP socket bound to `port` (/proc/net/udp)."""
    for line in Path("/proc/net/udp").read_text().splitlines()[1:]:
        words = line.split()
        if int(words[1].rsplit(":", 1)[1], 16) == port:
            return int(words[-1])
    return 0


# --------------------------------------------------------------------------------------------
# The ranks and their agents' aggregates (a child process): the datagrams the supervisor gets


class _RankSim:
    """Every rank of the step and what its node's agent sends for it, in the child process:
    per node one signed aggregate (`bvag1`, `messages.format_agg`: the real agent's bytes)
    per beat interval, and the ranks' checkpoint datagrams (`bvck1`, straight from the ranks
    as before). Commands: ("step", host, port, secret_hex, nodes, interval_s), ("mute",
    node_index), ("stall", rank) -> its last progress, ("save", step) -> (datagrams sent,
    seconds), ("stop",), ("stats",) -> (aggregates sent, send errors, checkpoint datagrams
    sent, ranks' records in the aggregates sent), ("quit",)."""

    def __init__(self) -> None:
        self.udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.udp.setblocking(False)
        self.slots = 100  # a rank beats once per interval, in its slot of 10 ms
        self.slot = 0
        self.addr: tuple[str, int] | None = None
        self.key = b""
        self.agg_key = b""
        self.agg_seq: list[int] = []  # each node agent's aggregates sent
        self.rank_beats = 0  # ranks' records carried by the aggregates sent
        self.nodes: list[str] = []
        self.seq: list[int] = []
        self.stalled: dict[int, tuple[int, float]] = {}  # rank -> (its step, last progress)
        self.muted: set[int] = set()  # node indexes whose packets are dropped
        self.sent = self.errors = self.ckpts = 0
        self.pid0 = 1000
        self.next_t = time.monotonic()

    def command(self, cmd: tuple[Any, ...]) -> Any:
        """Act on one command; its answer, or None when it has none."""
        if cmd[0] == "step":
            self.addr, self.key = (cmd[1], cmd[2]), beat_key(bytes.fromhex(cmd[3]))
            self.agg_key = agg_key(bytes.fromhex(cmd[3]))
            self.nodes, self.slots, self.slot = cmd[4], max(1, round(cmd[5] * 100)), 0
            self.seq = [0] * (len(self.nodes) * RANKS_PER_NODE)
            self.agg_seq = [0] * len(self.nodes)
            self.stalled, self.muted = {}, set()
            self.pid0 += len(self.seq)
            self.next_t = time.monotonic()
        elif cmd[0] == "mute":
            self.muted.add(cmd[1])
        elif cmd[0] == "stall":
            self.stalled[cmd[1]] = (int(time.monotonic() * 5), time.monotonic())
            return self.stalled[cmd[1]][1]
        elif cmd[0] == "save":
            return self.save(cmd[1])
        elif cmd[0] == "stop":
            self.addr = None
        elif cmd[0] == "stats":
            return (self.sent, self.errors, self.ckpts, self.rank_beats)
        return None

    def _send(self, data: bytes) -> bool:
        assert self.addr is not None
        try:
            self.udp.sendto(data, self.addr)
            return True
        except OSError:
            self.errors += 1
            return False

    def save(self, step: int) -> tuple[int, float]:
        """Every live rank's checkpoint datagram at once, as ranks ending one save send them."""
        t0 = time.monotonic()
        for rank in range(len(self.seq)):
            if self.addr is None or rank // RANKS_PER_NODE in self.muted:
                continue
            self.seq[rank] += 1
            msg = CkptMsg(rank, step, self.pid0 + rank, self.seq[rank], 0.5, 0.0)
            self.ckpts += self._send(format_ckpt(msg, self.key))
        return self.ckpts, time.monotonic() - t0

    def tick(self) -> None:
        """The aggregates of this 10 ms slot: each node's agent once per interval, with its
        ranks' last beats (each rank beats once per interval in its own slot; the agent
        forwards the last one with its age brought up to the send, as `launch/agent.py`
        `Aggregator` does)."""
        now = time.monotonic()  # 5 training steps a second: a healthy rank's age is < 0.2 s
        for node in range(self.slot, len(self.nodes), self.slots):
            if node in self.muted:
                continue
            ranks = []
            for rank in range(node * RANKS_PER_NODE, (node + 1) * RANKS_PER_NODE):
                # the rank's last beat: in its slot, at most one interval ago
                beat_t = now - ((self.slot - rank) % self.slots) * 0.01
                step, last = self.stalled.get(rank, (int(beat_t * 5), int(beat_t * 5) / 5))
                ranks.append(AggRank(rank, self.pid0 + rank, step, max(0.0, now - last),
                                     False, "train.py:120:train_step"))
            self.agg_seq[node] += 1
            data = format_agg(Agg(self.nodes[node], AGENT_PID0 + node, self.agg_seq[node],
                                  tuple(ranks)), self.agg_key)
            self.sent += self._send(data)
            self.rank_beats += len(ranks)
        self.slot = (self.slot + 1) % self.slots
        self.next_t += 0.01
        if self.next_t < now - 0.5:  # far behind (an overloaded machine): no burst to catch up
            self.next_t = now


def _ranks_main(ctl: Connection) -> None:
    sim = _RankSim()
    while True:
        timeout = max(0.0, sim.next_t - time.monotonic()) if sim.addr else 1.0
        if ctl.poll(timeout):
            cmd = ctl.recv()
            if cmd[0] == "quit":
                return
            answer = sim.command(cmd)
            if answer is not None:
                ctl.send(answer)
        elif sim.addr is not None:
            sim.tick()


class Ranks:
    def __init__(self) -> None:
        ctx = multiprocessing.get_context("fork")
        self.ctl, child = ctx.Pipe()
        self.proc = ctx.Process(target=_ranks_main, args=(child,), daemon=True)
        self.proc.start()

    def send(self, *cmd: Any) -> None:
        self.ctl.send(cmd)

    def ask(self, *cmd: Any) -> Any:
        self.ctl.send(cmd)
        return self.ctl.recv()

    def close(self) -> None:
        try:
            self.ctl.send(("quit",))
        except OSError:
            pass
        self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()


# --------------------------------------------------------------------------------------------
# The node agents (this process, one selectors loop)


@dataclass
class Agent:
    index: int
    node: str
    sock: socket.socket | None = None
    chan: Channel | None = None
    inbuf: bytes = b""
    connect_at: float = 0.0
    connected_at: float | None = None
    hello_at: float | None = None
    go_at: float | None = None
    abort_at: float | None = None
    last_ping: float = 0.0
    tries: int = 0
    state: str = "new"  # connecting | challenge | waiting | running | silent | done
    dropped: str = ""  # why the supervisor closed on it, if it did
    events: int = 0  # copy messages (`ev`) received: the keeper's part


@dataclass
class StepRecord:
    launch: int
    nodes: list[str]
    srun_at: float
    first_connect: float = 0.0
    last_connected: float = 0.0
    last_hello: float = 0.0
    all_go: float | None = None
    aborts: list[float] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    retries: int = 0
    events: int = 0


class Agents:
    """Every node agent of the current step."""

    def __init__(self, rec: dict[str, Any], launch: int, on_end: str = "abort") -> None:
        self.env = rec["env"]
        self.srun_pid = int(rec["pid"])
        self.nodes: list[str] = rec["nodes"]
        self.secret = bytes.fromhex(self.env["BV_JOB_SECRET"])
        self.line_key = derive(self.secret, b"line")
        host, _, port = self.env["BV_SUPERVISOR"].rpartition(":")
        self.addr = (socket.gethostbyname(host), int(port))
        bhost, _, bport = self.env["BV_HEARTBEAT"].rpartition(":")
        self.beat_addr = (socket.gethostbyname(bhost), int(bport))
        self.rdzv = self.env["BV_RDZV_NODE"] or self.nodes[0]
        self.interval = float(self.env["BV_HEARTBEAT_INTERVAL_S"] or 1.0)  # runtime.heartbeat
        self.ping_s = float(self.env["BV_PING_S"] or PING_S)  # as launch/agent.py reads it
        self.sel = selectors.DefaultSelector()
        self.agents = [Agent(i, n) for i, n in enumerate(self.nodes)]
        self.record = StepRecord(launch, list(self.nodes), float(rec["t"]))
        self.on_end = on_end

    # -- connections -------------------------------------------------------------------------
    def _connect(self, a: Agent, now: float) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        a.sock, a.inbuf, a.chan, a.tries = sock, b"", None, a.tries + 1
        a.connect_at, a.state = now, "connecting"
        if not self.record.first_connect:
            self.record.first_connect = now
        err = sock.connect_ex(self.addr)
        if err not in (0, 115):  # EINPROGRESS
            self._retry(a, now)
            return
        self.sel.register(sock, selectors.EVENT_WRITE, a)

    def _retry(self, a: Agent, now: float) -> None:
        """As the real agent: a failed connect is tried again after 0.2 s, for 30 s."""
        self._forget(a)
        self.record.retries += 1
        a.state = "retry"
        a.connect_at = now + 0.2

    def _forget(self, a: Agent) -> None:
        if a.sock is not None:
            try:
                self.sel.unregister(a.sock)
            except (KeyError, ValueError):
                pass
            a.sock.close()
            a.sock = None

    def start(self) -> None:
        now = time.monotonic()
        for a in self.agents:
            self._connect(a, now)

    def _on_writable(self, a: Agent, now: float) -> None:
        assert a.sock is not None
        err = a.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if err:
            self._retry(a, now)
            return
        a.connected_at, a.state = now, "challenge"
        self.record.last_connected = max(self.record.last_connected, now)
        self.sel.modify(a.sock, selectors.EVENT_READ, a)

    def _on_readable(self, a: Agent, now: float) -> None:
        assert a.sock is not None
        try:
            data = a.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._closed(a, now)
            return
        if a.chan is None:
            a.inbuf += data
            if b"\n" not in a.inbuf:
                return
            line, _, rest = a.inbuf.partition(b"\n")
            nonce = parse_challenge(line + b"\n")
            if nonce is None:
                self._closed(a, now)
                return
            a.chan = Channel(a.sock, self.line_key, nonce, b"a")
            hello: dict[str, object] = {"t": "hello", "node": a.node, "pid": 100000 + a.index}
            if a.node == self.rdzv:
                hello["port"] = 29500
            a.chan.send(hello)
            a.hello_at, a.state, a.last_ping = now, "waiting", now
            self.record.last_hello = max(self.record.last_hello, now)
            data = rest
            if not data:
                return
        try:
            msgs = a.chan.feed(data)
        except ChannelError:
            self._closed(a, now)
            return
        for msg in msgs:
            kind = msg.get("t")
            if kind == "go" and a.go_at is None:
                a.go_at, a.state = now, "running"
            elif kind in ("ev", "ev_synced"):
                a.events += 1
            elif kind == "abort" and a.abort_at is None:
                a.abort_at = now
                self.record.aborts.append(now)
                self.exit(a, 1)

    def _closed(self, a: Agent, now: float) -> None:
        """The supervisor closed on this agent: the real agent exits (its node is lost)."""
        if a.state not in ("done", "silent"):
            a.dropped = f"closed by the supervisor in state {a.state}"
            self.record.dropped.append(a.node)
        self._forget(a)
        a.state = "done"

    def exit(self, a: Agent, rc: int) -> None:
        if a.chan is not None and a.sock is not None and a.state not in ("done", "silent"):
            a.chan.send({"t": "exit", "rc": rc, "node": a.node, "signalled": 0})
            a.chan.flush()
        self._forget(a)
        a.state = "done"

    # -- the loop ------------------------------------------------------------------------------
    def pump(self, timeout: float = 0.05) -> None:
        for key, mask in self.sel.select(timeout):
            a = key.data
            now = time.monotonic()
            if a.state == "connecting" and mask & selectors.EVENT_WRITE:
                self._on_writable(a, now)
            elif mask & selectors.EVENT_READ:
                self._on_readable(a, now)
        now = time.monotonic()
        for a in self.agents:
            if a.state == "retry" and now >= a.connect_at:
                self._connect(a, now)
            elif (a.state in ("waiting", "running") and a.chan is not None
                  and now - a.last_ping >= self.ping_s):
                a.chan.send({"t": "ping"})
                a.last_ping = now
        if self.record.all_go is None and all(a.go_at is not None for a in self.agents):
            self.record.all_go = max(a.go_at or 0.0 for a in self.agents)

    def run_for(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.pump(min(0.05, max(0.0, end - time.monotonic())))

    def run_until(self, done: Any, timeout: float) -> bool:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            self.pump(0.02)
            if done():
                return True
        return False

    def silence(self, a: Agent) -> float:
        """Its packets dropped from now on: no more pings, nothing read; the socket stays
        open (a cable pulled, not a process killed). Its last ping's time."""
        if a.sock is not None:
            self.sel.unregister(a.sock)
        a.state = "silent"
        return a.last_ping

    def close(self) -> None:
        for a in self.agents:
            if a.sock is not None:
                self._forget(a)
        self.sel.close()
        self.record.events = sum(a.events for a in self.agents)


# --------------------------------------------------------------------------------------------
# The run


@dataclass
class Result:
    n: int
    load: list[float] = field(default_factory=list)
    figures: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    steps: list[StepRecord] = field(default_factory=list)
    victims: list[str] = field(default_factory=list)  # the closed node, the silent node
    hung: tuple[int, str] = (-1, "")  # the rank whose progress stopped, and its node
    stdout: str = ""
    stderr: str = ""
    rc: int | None = None


class Harness:
    def __init__(self, tmp: Path, n: int, *, node_timeout: float = 10.0,
                 hang_timeout: float = 10.0, steady_s: float = 10.0,
                 nofile: int | None = 1024, failures: bool = True) -> None:
        self.dir, self.n = tmp, n
        self.nofile = nofile  # the supervisor's soft limit of open files (a login shell's)
        self.failures = failures  # False: start, steady state and the save only
        self.node_timeout, self.hang_timeout, self.steady_s = node_timeout, hang_timeout, steady_s
        self.alloc = [f"sn{i:05d}" for i in range(1, n + SPARES + 1)]
        bindir = tmp / "bin"
        bindir.mkdir(parents=True, exist_ok=True)
        for name, body in (("srun", SRUN), ("scontrol", SCONTROL), ("squeue", SQUEUE)):
            path = bindir / name
            path.write_text(f"#!{sys.executable} -P\n{body}")
            path.chmod(0o755)
        self.events_dir = tmp / "events"
        self.events_dir.mkdir(exist_ok=True)
        self.events_dir.chmod(0o1777)
        prof = os.environ.get("BV_SCALE_PROFILE")  # a cProfile output path, for a look inside
        self.argv = [sys.executable, "-P", *(["-m", "cProfile", "-o", prof] if prof else []),
                     "-m", "bluevela.launch.supervisor", f"--nodes={n}",
                     f"--spare-nodes={SPARES}", f"--hang-timeout={hang_timeout:g}",
                     f"--node-timeout={node_timeout:g}", "--", "torchrun",
                     f"--nproc-per-node={RANKS_PER_NODE}", "--max-restarts=0", "train.py"]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM", "BV_"))}
        repo = str(Path(__file__).resolve().parent.parent)
        self.env = {**env, "PATH": f"{bindir}:{os.environ['PATH']}", "SLURM_JOB_ID": "77",
                    "SLURM_JOB_NODELIST": ",".join(self.alloc), "SLURM_RESTART_COUNT": "0",
                    "BV_SCALE_DIR": str(tmp), "BV_EVENTS_DIR": str(self.events_dir),
                    "PYTHONPATH": repo}
        self.proc: subprocess.Popen[bytes] | None = None
        self.result = Result(n)

    # -- plumbing ----------------------------------------------------------------------------
    def _start(self) -> None:
        self.out = open(self.dir / "out.txt", "wb")  # noqa: SIM115 - closed in _stop
        self.err = open(self.dir / "err.txt", "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(self.argv, env=self.env, cwd=self.dir, stdout=self.out,
                                     stderr=self.err, stdin=subprocess.DEVNULL,
                                     start_new_session=True, preexec_fn=self._limits)

    def _limits(self) -> None:
        """As Slurm starts a batch step: the submit shell's limits (PropagateResourceLimits),
        whose soft limit of open files is often 1,024."""
        if self.nofile is not None:
            hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
            resource.setrlimit(resource.RLIMIT_NOFILE, (self.nofile, hard))

    def _stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        for launch in range(1, 10):
            path = self.dir / f"srun.{launch}.json"
            if path.exists():
                try:
                    os.kill(json.loads(path.read_text())["pid"], signal.SIGKILL)
                except (ProcessLookupError, ValueError, KeyError):
                    pass
        self.out.close()
        self.err.close()
        self.result.stdout = (self.dir / "out.txt").read_text(errors="replace")
        self.result.stderr = (self.dir / "err.txt").read_text(errors="replace")

    def _next_step(self, launch: int, timeout: float, on_end: str = "abort") -> Agents:
        path = self.dir / f"srun.{launch}.json"
        end = time.monotonic() + timeout
        while not path.exists():
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"the supervisor exited {self.proc.returncode} before launch "
                                   f"{launch}: {(self.dir / 'err.txt').read_text()[-2000:]}")
            if time.monotonic() > end:
                raise RuntimeError(f"no launch {launch} in {timeout:.0f} s")
            time.sleep(0.005)
        agents = Agents(json.loads(path.read_text()), launch, on_end)
        agents.start()
        return agents

    def _started(self, agents: Agents, name: str) -> None:
        """Step start: first connect -> the go to all; connected -> released."""
        assert self.proc is not None
        c0 = proc_cpu_s(self.proc.pid)
        ok = agents.run_until(lambda: agents.record.all_go is not None,
                              timeout=60 + self.n / 20)
        r, f = agents.record, self.result.figures
        if not ok:
            got = sum(1 for a in agents.agents if a.go_at is not None)
            raise RuntimeError(f"{name}: {got} of {self.n} agents got their go; dropped "
                               f"{len(r.dropped)}: {(self.dir / 'err.txt').read_text()[-1500:]}")
        assert r.all_go is not None
        f[f"{name}.start_s"] = r.all_go - r.first_connect
        f[f"{name}.release_after_last_connect_s"] = r.all_go - r.last_connected
        f[f"{name}.srun_to_go_s"] = r.all_go - r.srun_at
        f[f"{name}.start_cpu_s"] = proc_cpu_s(self.proc.pid) - c0
        f[f"{name}.connect_retries"] = r.retries
        f[f"{name}.dropped"] = len(r.dropped)
        self.result.load.append(loadavg())

    def _abort_latency(self, agents: Agents, since: float, timeout: float) -> float:
        ok = agents.run_until(lambda: bool(agents.record.aborts), timeout)
        if not ok:
            raise RuntimeError(f"no abort in {timeout:.0f} s: "
                               f"{(self.dir / 'err.txt').read_text()[-1500:]}")
        # Let the others answer the abort (the step ends when every node did).
        agents.run_until(lambda: all(a.state == "done" or a.state == "silent"
                                     for a in agents.agents), 5.0)
        return min(agents.record.aborts) - since

    # -- the scenario --------------------------------------------------------------------------
    @staticmethod
    def _all_exit(agents: Agents, ranks: Ranks) -> None:
        ranks.send("stop")
        for a in agents.agents:
            agents.exit(a, 0)
        os.kill(agents.srun_pid, signal.SIGTERM)
        agents.close()

    def run(self, ranks: Ranks) -> Result:
        self._start()
        assert self.proc is not None
        res = self.result
        try:
            agents = self._launch(1, 30, ranks)
            self._steady_and_save(agents, ranks)
            if not self.failures:  # the steady state alone: every agent exits 0
                self._all_exit(agents, ranks)
                res.steps.append(agents.record)
                res.rc = self.proc.wait(timeout=30)
                return res
            self._closed(agents, ranks)
            self._silent(self._launch(2, 30, ranks), ranks)
            self._hang(self._launch(3, self.node_timeout + 30, ranks), ranks)
            agents = self._next_step(4, 30)  # everyone exits 0
            agents.run_until(lambda: agents.record.all_go is not None, 60 + self.n / 20)
            self._all_exit(agents, ranks)
            res.steps.append(agents.record)
            res.rc = self.proc.wait(timeout=30)
        finally:
            ranks.send("stop")
            self._stop()
        self._epilog_read()
        return res

    def _launch(self, launch: int, timeout: float, ranks: Ranks) -> Agents:
        """The step's agents connected and released, its ranks beating."""
        agents = self._next_step(launch, timeout)
        self._started(agents, f"step{launch}")
        ranks.send("step", *agents.beat_addr, agents.env["BV_JOB_SECRET"], agents.nodes,
                   agents.interval)
        return agents

    def _steady_and_save(self, agents: Agents, ranks: Ranks) -> None:
        assert self.proc is not None
        f, port, pid = self.result.figures, agents.beat_addr[1], self.proc.pid
        agents.run_for(min(3.0, self.steady_s))  # the beats reach their rate
        c0, t0, d0 = proc_cpu_s(pid), time.monotonic(), udp_drops(port)
        st0 = ranks.ask("stats")
        agents.run_for(self.steady_s)
        c1, t1, d1 = proc_cpu_s(pid), time.monotonic(), udp_drops(port)
        st1 = ranks.ask("stats")
        s0, s1 = st0[0], st1[0]
        f["steady.rank_beats_per_s"] = (st1[3] - st0[3]) / (t1 - t0)
        rss, hwm = proc_mem_kb(pid)
        f["steady.cpu_pct"] = 100 * (c1 - c0) / (t1 - t0)
        f["steady.rss_mb"] = rss / 1024
        f["steady.hwm_mb"] = hwm / 1024
        f["steady.beats_sent_per_s"] = (s1 - s0) / (t1 - t0)
        f["steady.beats_dropped"] = d1 - d0
        f["steady.beats_received_pct"] = 100 * (1 - (d1 - d0) / max(1, s1 - s0))
        self.result.load.append(loadavg())
        d0 = udp_drops(port)
        f["save.datagrams_sent"], f["save.burst_s"] = ranks.ask("save", 1000)
        agents.run_for(1.0)
        f["save.dropped"] = udp_drops(port) - d0
        f["step1.aborts_before_failure"] = len(agents.record.aborts)

    def _ended(self, agents: Agents, ranks: Ranks) -> None:
        self.result.load.append(loadavg())
        ranks.send("stop")
        agents.close()
        self.result.steps.append(agents.record)

    def _closed(self, agents: Agents, ranks: Ranks) -> None:
        """One agent's connection closed (its node died), its ranks silent."""
        victim = agents.agents[-1]
        self.result.victims.append(victim.node)
        ranks.send("mute", victim.index)
        t_fail = time.monotonic()
        agents._forget(victim)
        victim.state = "done"
        self.result.figures["lost_closed.decision_s"] = self._abort_latency(agents, t_fail, 30)
        self._ended(agents, ranks)

    def _silent(self, agents: Agents, ranks: Ranks) -> None:
        """One agent's packets dropped from now on (and its ranks'), the socket left open."""
        agents.run_for(1.5)
        f = self.result.figures
        f["step2.aborts_before_failure"] = len(agents.record.aborts)
        victim = agents.agents[-1]
        self.result.victims.append(victim.node)
        ranks.send("mute", victim.index)
        t_fail = agents.silence(victim)
        f["lost_silent.decision_s"] = self._abort_latency(agents, t_fail, self.node_timeout + 30)
        self._ended(agents, ranks)

    def _hang(self, agents: Agents, ranks: Ranks) -> None:
        """One rank's progress stops; its beats go on, with a growing age."""
        agents.run_for(1.5)
        f = self.result.figures
        f["step3.aborts_before_failure"] = len(agents.record.aborts)
        hung = (self.n // 2) * RANKS_PER_NODE + 3
        self.result.hung = (hung, agents.nodes[self.n // 2])
        t_stall = ranks.ask("stall", hung)
        f["hang.decision_s"] = self._abort_latency(agents, t_stall, self.hang_timeout + 30)
        self._ended(agents, ranks)

    def _epilog_read(self) -> None:
        """The epilog's read of the supervisor's events (as the job's user, uid: ours)."""
        f = self.result.figures
        t0 = time.monotonic()
        found = collect_files(77, 0, socket.gethostname(), os.getuid(),
                              {"BV_EVENTS_DIR": str(self.events_dir)})
        f["epilog.read_s"] = time.monotonic() - t0
        f["epilog.launches"] = len(found.record["launches"]) if found is not None else 0
        # The `ckpt` line of the save names how many ranks' datagrams it folded.
        ranks, size = 0, 0
        for path in self.events_dir.iterdir():
            if path.is_file():
                size += path.stat().st_size
                for line in path.read_text().splitlines():
                    ev = json.loads(line)
                    if ev.get("e") == "ckpt":
                        ranks = max(ranks, int(ev.get("ranks", 0)))
        f["save.ranks_recorded"] = ranks
        f["events.bytes"] = size


def run_scale(tmp: Path, n: int, **kw: Any) -> Result:
    ranks = Ranks()
    try:
        return Harness(tmp, n, **kw).run(ranks)
    finally:
        ranks.close()


def main() -> None:
    import argparse
    import tempfile

    p = argparse.ArgumentParser()
    p.add_argument("n", type=int)
    p.add_argument("--node-timeout", type=float, default=10.0)
    p.add_argument("--hang-timeout", type=float, default=10.0)
    p.add_argument("--steady", type=float, default=10.0)
    p.add_argument("--nofile", type=int, default=1024)
    a = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="bv-scale-") as tmp:
        res = run_scale(Path(tmp), a.n, node_timeout=a.node_timeout,
                        hang_timeout=a.hang_timeout, steady_s=a.steady, nofile=a.nofile)
        print(json.dumps({"n": res.n, "load": res.load, "rc": res.rc, **res.figures}, indent=1))
        print(res.stdout[-3000:])
        print(res.stderr[-3000:])


if __name__ == "__main__":
    main()
