"""A seam to drive the launch core with scripted events (issue 33), as torch elastic's tests
script `_monitor_workers`: the REAL `Step` and `Supervisor` (bluevela/launch/step.py,
supervisor.py), their own message path (signed lines over socket pairs read by the step's
`_read_agent`, signal numbers in the signals' wakeup pipe, the step's `_deadlines`), a fake
clock, a fake srun and scripted node agents (`NodeScript`). Only `Step.pump`'s I/O wait is
replaced: each pump is one tick of the script.

The driver uses nothing that issue 33 added, so the randomized test can be pointed at the code
before it (``PYTHONPATH=<a worktree of 18227e1>``) to see which holes it finds there.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import bluevela.launch.step as step_mod
import bluevela.launch.supervisor as sup_mod
from bluevela.goodput.outcome import Loss, StepEnd
from bluevela.launch.events_log import EventLog
from bluevela.launch.policy import Grow, Grown
from bluevela.launch.step import Conn, Endpoints, Signals, Step, StepConfig, StepState
from bluevela.launch.step_result import StepResult
from bluevela.protocol.channel import Channel
from bluevela.protocol.keys import derive

KEY = derive(b"k" * 32, b"line")
TICK = 0.05
PING = 1.0
CFG = StepConfig(settle_s=1.0, node_timeout=3.0, connect_timeout=8.0, abort_grace_s=1.0)


class Stuck(AssertionError):
    """The step did not end within the script's time."""


@dataclass
class NodeScript:
    """One node's agent, times from the step's start (seconds). Defaults: a healthy node
    that says hello at once and trains until told otherwise."""

    hello_at: float | None = 0.0  # None: its agent never connects
    fail_at: float | None = None  # once running: torchrun exits 1 (a rank failure)
    done_at: float | None = None  # once running: torchrun exits 0 (the training is over)
    die_at: float | None = None  # the connection closes (the node died)
    mute_at: float | None = None  # it stops pinging and answering (a silent node)
    ckpt_s: float = 0.3  # after a checkpoint request: exits 0 this long after
    abort_s: float | None = 0.2  # after an abort: answers (its exit) this long after; None:
    # never (its torchrun will not die), while it still pings

    def dies(self) -> bool:
        return self.die_at is not None or self.mute_at is not None

    def healthy(self, connect_timeout: float) -> bool:
        """Alive for the whole step and connecting within the connect timeout."""
        return (not self.dies() and self.hello_at is not None
                and self.hello_at < connect_timeout)


class FakeTime:
    """What step.py reads of the `time` module, on the script's clock."""

    def __init__(self) -> None:
        self.t = 1000.0

    def monotonic(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        self.t += max(0.0, seconds)

    def time(self) -> float:
        return self.t


class FakeSrun:
    """srun: ends (with the agents' worst status) once every node's agent has exited; hangs
    while one is dead or missing, until killed (as a real srun waits for SlurmdTimeout)."""

    pid = 0

    def __init__(self) -> None:
        self.rc: int | None = None

    def poll(self) -> int | None:
        return self.rc

    def wait(self, timeout: float | None = None) -> int:
        if self.rc is None:
            raise subprocess.TimeoutExpired("srun", timeout or 0)
        return self.rc

    def kill(self) -> None:
        if self.rc is None:
            self.rc = -9


@dataclass
class AgentModel:
    node: str
    script: NodeScript
    rdzv: bool
    sock: socket.socket | None = None
    chan: Channel | None = None
    got: list[str] = field(default_factory=list)  # what the supervisor told it, in order
    gos: list[dict[str, object]] = field(default_factory=list)  # its go messages, whole
    started = False
    usr1 = False
    gone = False  # dead, muted, or exited (its channel closed)
    exit_at: float | None = None
    exit_rc = 0
    last_ping = -1e9

    def act(self, now: float, t: float, step: Step) -> None:
        """One tick at `t` seconds into the step (`now`: the step's clock)."""
        s = self.script
        if self.gone:
            return
        if self.sock is None:
            if s.hello_at is not None and t >= s.hello_at:
                self._connect(now, step)
            return
        assert self.chan is not None
        if s.die_at is not None and t >= s.die_at:
            self.sock.close()
            self.gone = True
            return
        if s.mute_at is not None and t >= s.mute_at:
            self.gone = True  # its socket stays open: silent, not closed
            return
        for msg in self.chan.receive() or []:
            kind = str(msg.get("t"))
            self.got.append(kind)
            if kind == "go":
                self.gos.append(msg)
            if kind == "go" and "abort" not in self.got:
                self.started = True
                if self.usr1:
                    self._exit_in(t + s.ckpt_s, 0)
            elif kind == "abort" and s.abort_s is not None:
                self._exit_in(t + s.abort_s, 143 if self.started else 1, first=True)
            elif kind == "usr1":
                self.usr1 = True
                if self.started:
                    self._exit_in(t + s.ckpt_s, 0)
        if self.started and self.exit_at is None:
            if s.fail_at is not None and t >= s.fail_at:
                self._exit_in(t, 1)
            elif s.done_at is not None and t >= s.done_at:
                self._exit_in(t, 0)
        if self.exit_at is not None and t >= self.exit_at:
            self.chan.send({"t": "exit", "rc": self.exit_rc, "node": self.node,
                            "signalled": 1 if self.usr1 and self.started else 0, "termed": 0})
            self.chan.close()
            self.gone = True
            return
        if t - self.last_ping >= PING:
            self.chan.send({"t": "ping"})
            self.last_ping = t

    def _exit_in(self, at: float, rc: int, first: bool = False) -> None:
        if self.exit_at is None or (first and at < self.exit_at):
            self.exit_at, self.exit_rc = at, rc

    def _connect(self, now: float, step: Step) -> None:
        theirs, ours = socket.socketpair()
        theirs.setblocking(False)
        ours.setblocking(False)
        nonce = secrets.token_bytes(16)
        step.st.conns.append(Conn(theirs, KEY, nonce, now))
        self.sock = ours
        self.chan = Channel(ours, KEY, nonce, b"a")
        hello: dict[str, object] = {"t": "hello", "node": self.node, "pid": 1}
        if self.rdzv:
            hello["port"] = 29500
        self.chan.send(hello)

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()


class StepDriver:
    """Runs one real `Step` over scripted agents and signals (`signals_at`: (t, signal))."""

    def __init__(self, nodes: Sequence[str], scripts: dict[str, NodeScript], signals: Signals,
                 ends: Endpoints, events: EventLog, clock: FakeTime,
                 signals_at: Sequence[tuple[float, int]] = (), cfg: StepConfig = CFG,
                 max_s: float = 60.0) -> None:
        self.clock = clock
        self.t0 = clock.t
        self.signals_at = sorted(signals_at)
        self.signals = signals
        self.max_s = max_s
        self.srun = FakeSrun()
        self.agents = {n: AgentModel(n, scripts.get(n, NodeScript()), i == 0)
                       for i, n in enumerate(nodes)}
        st = StepState(nodes=list(nodes), started=clock.t, line_key=KEY, max_ranks=len(nodes))
        self.step = Step(st, self.srun, ends, signals, events, "batch-host", cfg)  # type: ignore[arg-type]
        self.step.pump = self.pump  # type: ignore[method-assign]
        self.ended_at: float | None = None
        self.delivered: list[tuple[float, int]] = []  # (t, signal) written to the pipe

    def pump(self) -> None:
        clock, step, st = self.clock, self.step, self.step.st
        clock.t += TICK
        now, t = clock.t, clock.t - self.t0
        if t > self.max_s:
            raise Stuck(f"the step did not end in {self.max_s:.0f} s")
        while self.signals_at and self.signals_at[0][0] <= t:
            sig = self.signals_at.pop(0)[1]
            os.write(self.signals.wake_w, bytes([sig]))
            self.delivered.append((t, sig))
        for agent in self.agents.values():
            agent.act(now, t, step)
        if self.srun.rc is None and all(a.gone and a.exit_at is not None
                                        for a in self.agents.values()):
            self.srun.rc = max(a.exit_rc for a in self.agents.values())
        # What Step.pump does with what came: signals, the agents' lines, the deadlines.
        for sig in self.signals.drain():
            handler: Any = getattr(step, "on_signal", None)
            if handler is not None:
                handler(sig, now)
            else:  # the code before issue 33
                step._on_signal(sig)  # type: ignore[attr-defined]
        for conn in [c for c in st.conns if not c.closed]:
            step._read_agent(conn, now)
        step._deadlines(now)

    def run(self) -> StepResult:
        try:
            with fake_time(self.clock):
                return self.step.run()
        finally:
            self.ended_at = self.clock.t - self.t0
            for agent in self.agents.values():
                agent.close()


@contextmanager
def fake_time(clock: FakeTime) -> Iterator[None]:
    real = step_mod.time
    step_mod.time = clock  # type: ignore[assignment]
    try:
        yield
    finally:
        step_mod.time = real


# --------------------------------------------------------------------------------------------
# The supervisor over scripted steps


class RecordingLog(EventLog):
    """The goodput events as calls (no file)."""

    def __init__(self) -> None:
        super().__init__(None, "batch-host")
        self.launches: list[list[str]] = []
        self.ends: list[tuple[StepEnd, dict[str, Loss]]] = []
        self.requeues = 0

    def launch(self, attempt: int, launch: int, nodes: list[str], spares: int,
               started_mono: float) -> None:
        self.launches.append(list(nodes))

    def step_ended(self, kind: StepEnd, cause: str, lost: Any, *args: Any,
                   **kwargs: Any) -> None:
        self.ends.append((kind, dict(lost)))

    def requeue(self) -> None:
        self.requeues += 1


@dataclass
class Launch:
    """One launch of a scripted job: the node scripts and the signals of its step."""

    scripts: dict[str, NodeScript] = field(default_factory=dict)
    signals_at: list[tuple[float, int]] = field(default_factory=list)


@dataclass
class GrowPlan:
    ok: bool = True
    sigterm: bool = False  # SIGTERM reaches the supervisor during the grow (it stops it)


class FakeSlurm:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def _done(self) -> Any:
        return SimpleNamespace(ok=True, terminated=False, describe=lambda: "ok")

    def keep_only(self, nodelist: str) -> Any:
        self.calls.append(f"keep_only {nodelist}")
        return self._done()

    def requeue(self) -> Any:
        self.calls.append("requeue")
        return self._done()

    def time_left(self) -> None:
        return None


class ScriptedSupervisor(sup_mod.Supervisor):
    """The real supervisor loop; its steps are `StepDriver`s, its grow and Slurm scripted."""

    def __init__(self, opts: sup_mod.Options, alloc: Sequence[str],
                 launches: Callable[[int, Sequence[str]], Launch], grow: GrowPlan) -> None:
        super().__init__(opts, {"SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": ",".join(alloc)})
        self.alloc = list(alloc)
        self.launches = launches
        self.grow_plan = grow
        self.clock_ = FakeTime()
        self.slurm = FakeSlurm()  # type: ignore[assignment]
        self.results: list[StepResult] = []
        self.drivers: list[StepDriver] = []
        self.grows: list[Grow] = []
        self.sigterm_seen = False  # a SIGTERM was delivered before the job's last decision

    def _history(self) -> tuple[int, str]:
        return 0, "none"

    def run_step(self, attempt: int, launch: int, nodes: list[str]) -> StepResult:
        signals, ends = self.start()
        plan = self.launches(launch, nodes)
        self.events.launch(attempt, launch, nodes, 0, self.clock_.t)
        driver = StepDriver(nodes, plan.scripts, signals, ends, self.events, self.clock_,
                            plan.signals_at)
        self.drivers.append(driver)
        result = driver.run()
        self.sigterm_seen |= any(s == signal.SIGTERM for _, s in driver.delivered)
        self.results.append(result)
        return result

    def grow(self, want: Grow) -> Grown:
        self.grows.append(want)
        assert self.signals is not None
        if self.grow_plan.sigterm:
            os.write(self.signals.wake_w, bytes([signal.SIGTERM]))
            self.sigterm_seen = True
            return Grown(why="the job is ending (SIGTERM): grow stopped")
        if not self.grow_plan.ok:
            return Grown(why="no node came by the deadline")
        new = f"g{len(self.grows)}"
        self.alloc = [*want.keep, new]
        return Grown((new,), 1.5, "", tuple(want.lost) if not want.alive else ())


@contextmanager
def scripted_job() -> Iterator[RecordingLog]:
    """The process-wide pieces a supervisor touches, made inert for the test: no signal
    handlers installed, no events file, no wait after a requeue."""
    log = RecordingLog()
    install, open_, wait = (Signals.__dict__["install"], EventLog.__dict__["open"],
                            sup_mod.REQUEUE_WAIT_S)
    Signals.install = lambda self: None  # type: ignore[method-assign]
    EventLog.open = classmethod(lambda cls, env, host, **kw: log)  # type: ignore[method-assign,assignment]
    sup_mod.REQUEUE_WAIT_S = 0.0
    try:
        yield log
    finally:
        Signals.install = install  # type: ignore[method-assign]
        EventLog.open = open_  # type: ignore[method-assign]
        sup_mod.REQUEUE_WAIT_S = wait
