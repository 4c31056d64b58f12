"""The smaller holes of issue 33's launch core, each with the behaviour it must have: a pid
reused by another user, a torchrun SIGKILLed in the kernel, a UDP bind that fails after the
TCP bind, the supervisor's one shutdown path, `bv status`'s typed fields, and a hang timeout
of nan or inf refused at submit."""

from __future__ import annotations

import math
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

import bluevela.launch.step as step_mod
from bluevela.errors import LaunchError
from bluevela.launch import agent as agent_mod
from bluevela.launch import proctree
from bluevela.launch.attempts import banner, bv_attempts, end_line, record_line
from bluevela.launch.step import Endpoints, Signals
from bluevela.launch.submit import build_request
from bluevela.launch.supervisor import Options
from bluevela.site import load_site
from tests.conftest import REPO
from tests.step_script import GrowPlan, Launch, ScriptedSupervisor, scripted_job

# -- signal_pid, and the bounded waits on a SIGKILLed process -----------------------------------

def test_signal_pid_takes_a_pid_that_is_no_longer_ours_as_gone(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """EPERM: the worker's pid was reused by another user's process. Not a crash of the agent
    (which would be a lost node), and not a signal sent."""
    def kill(pid: int, sig: int) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(proctree.os, "kill", kill)
    assert proctree.signal_pid(12345, signal.SIGUSR1) is False


class UnkillableProc:
    """A process stuck in the kernel (D state): SIGKILL does not end it."""

    pid = 4242
    returncode = None

    def __init__(self) -> None:
        self.waits: list[float | None] = []

    def wait(self, timeout: float | None = None) -> int:
        self.waits.append(timeout)
        if timeout is None:
            raise AssertionError("an unbounded wait on a process that never ends")
        raise subprocess.TimeoutExpired("torchrun", timeout)

    def kill(self) -> None:
        pass

    def poll(self) -> None:
        return None


def test_reap_gives_up_on_a_process_sigkill_does_not_end() -> None:
    proc = UnkillableProc()
    proctree.reap(proc, 0.01)  # type: ignore[arg-type]
    assert proc.waits == [0.01, proctree.KILLED_WAIT_S]


def test_the_agent_does_not_wait_without_end_for_a_killed_torchrun(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The supervisor is gone: the agent kills its torchrun and ends, even when torchrun
    sits in the kernel after SIGKILL."""
    monkeypatch.setattr(agent_mod, "kill_tree", lambda proc: None)
    monkeypatch.setattr(proctree, "KILLED_WAIT_S", 0.01)
    agent = agent_mod.Agent.__new__(agent_mod.Agent)
    agent.copy = SimpleNamespace(gone=lambda: None)  # type: ignore[assignment]
    agent.proc = UnkillableProc()  # type: ignore[assignment]
    agent._supervisor_gone()
    assert agent.phase is agent_mod.Phase.DONE and agent.code == 1


# -- Endpoints -----------------------------------------------------------------------------------

@pytest.fixture
def signals() -> Iterator[Signals]:
    s = Signals()
    try:
        yield s
    finally:
        s.close()


def test_endpoints_close_the_tcp_socket_when_the_udp_bind_fails(
        monkeypatch: pytest.MonkeyPatch, signals: Signals) -> None:
    made: list[socket.socket] = []
    real = socket.socket

    class Sock(real):  # type: ignore[misc, valid-type]
        def __init__(self, family: int = -1, kind: int = -1, *a: Any) -> None:
            super().__init__(family, kind, *a)
            made.append(self)

        def bind(self, addr: Any) -> None:
            if self.type == socket.SOCK_DGRAM:
                raise OSError(98, "Address already in use")
            super().bind(addr)

    monkeypatch.setattr(step_mod.socket, "socket", Sock)
    with pytest.raises(OSError, match="in use"):
        Endpoints(["n1"], "localhost", signals)
    assert [s.type for s in made] == [socket.SOCK_STREAM, socket.SOCK_DGRAM]
    assert all(s.fileno() == -1 for s in made), "a socket of the failed Endpoints is open"


# -- Signals: the one way a signal reaches a decision -------------------------------------------

def test_a_signal_taken_outside_a_step_reaches_seen(signals: Signals) -> None:
    os.write(signals.wake_w, bytes([signal.SIGUSR1, signal.SIGINT]))
    assert signals.take() == [signal.SIGUSR1, signal.SIGINT]
    assert signals.seen == signal.SIGTERM and signals.stopping()


def test_wait_stop_keeps_what_it_saw(signals: Signals) -> None:
    os.write(signals.wake_w, bytes([signal.SIGUSR1]))
    assert signals.wait_stop(0.05) is False and signals.seen == signal.SIGUSR1
    os.write(signals.wake_w, bytes([signal.SIGTERM]))
    assert signals.wait_stop(5) is True and signals.stopping()


# -- the supervisor's one shutdown path ---------------------------------------------------------

def test_the_supervisor_closes_what_it_opened_when_a_step_raises() -> None:
    class Boom(ScriptedSupervisor):
        def run_step(self, attempt: int, launch: int, nodes: list[str]) -> Any:
            self.opened = self.start()
            raise RuntimeError("boom")

    with scripted_job() as log:
        sup = Boom(Options(nodes=1, torchrun=["torchrun", "t.py"]), ["n1"],
                   lambda i, _: Launch(), GrowPlan())
        closed: list[bool] = []
        log.close = lambda: closed.append(True)  # type: ignore[method-assign]
        with pytest.raises(RuntimeError, match="boom"):
            sup.run()
    signals, ends = sup.opened
    assert sup.ends is None and sup.signals is None and closed == [True]
    assert ends.listen.fileno() == -1 and ends.udp.fileno() == -1


# -- bv status: typed fields, not the end line's words -------------------------------------------

GROWN_CAUSE = ("n2 lost (its agent's connection closed: the node or its processes died); "
               "relaunching on n[1,3] (grown n3 in 12.5 s, same job, no Slurm requeue)")


def test_bv_status_reads_the_typed_record_not_the_words() -> None:
    reworded = ("n2 is gone; we carry on with n[1,3], n3 having joined after 12.5 seconds "
                "(requeued by bv? no)")
    text = "\n".join([
        banner(1, "7", ["n1", "n2"], "none"), end_line(1, reworded),
        record_line(1, "relaunch", ["n3"], 12.5),
        banner(2, "7", ["n1", "n3"], reworded), end_line(2, "exit 0"), record_line(2, "exit"),
        ""])
    got = [(a["grown"], a["grow_s"], a["slurm_requeue"]) for a in bv_attempts(text)]
    assert got == [("n3", 12.5, False), (None, None, False)]


def test_bv_status_still_reads_an_output_without_records() -> None:
    text = "\n".join([banner(1, "7", ["n1", "n2"], "none"), end_line(1, GROWN_CAUSE),
                      banner(2, "7", ["n1", "n3"], GROWN_CAUSE),
                      end_line(2, "checkpoint signal SIGUSR1 from Slurm, requeued by bv"), ""])
    got = [(a["grown"], a["grow_s"], a["slurm_requeue"]) for a in bv_attempts(text)]
    assert got == [("n3", 12.5, False), (None, None, True)]


def test_after_an_exit_a_later_attempt_is_slurms_own_requeue() -> None:
    text = "\n".join([banner(1, "7", ["n1"], "none"), end_line(1, "SIGTERM from Slurm"),
                      record_line(1, "exit"), banner(2, "7", ["n1"], "requeued by Slurm"), ""])
    assert [a["slurm_requeue"] for a in bv_attempts(text)] == [True, False]


@pytest.mark.parametrize("bad", [
    '{"next":"relaunch","grown":"n3","grow_s":"fast"}', '{"next":"maybe"}', '{"next":',
    '{"next":"relaunch","grown":"n3","grow_s":-1}', '["relaunch"]'])
def test_a_malformed_record_falls_back_to_the_words(bad: str) -> None:
    text = "\n".join([banner(1, "7", ["n1", "n2"], "none"), end_line(1, GROWN_CAUSE),
                      f"==== bv attempt 1 record: {bad} ====", ""])
    assert [(a["grown"], a["grow_s"]) for a in bv_attempts(text)] == [("n3", 12.5)]


def test_a_record_names_only_known_kinds() -> None:
    with pytest.raises(ValueError, match="next must be one of"):
        record_line(1, "retry")


# -- --hang-timeout at submit --------------------------------------------------------------------

@pytest.mark.parametrize("value", [math.nan, math.inf, -1.0])
def test_a_hang_timeout_that_is_not_a_finite_number_is_refused_at_submit(value: float) -> None:
    with pytest.raises(LaunchError, match="--hang-timeout must be >= 0 and finite"):
        build_request(load_site(REPO / "site.yaml"), "t.py", hang_timeout=value)


@pytest.mark.parametrize("value", ["nan", "inf"])
def test_bv_submit_says_so_in_one_line(value: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "bluevela", "submit", "--dry-run",
                           f"--hang-timeout={value}", "t.py"], capture_output=True, text=True,
                          timeout=60, cwd=REPO,
                          env={**os.environ, "BV_SITE": str(REPO / "site.yaml")})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "bv: error: --hang-timeout must be >= 0 and finite (0: off)"]
