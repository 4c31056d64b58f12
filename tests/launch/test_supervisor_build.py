"""A supervisor a test can build: constructing one reads its environment and opens nothing
(no socket, no name lookup); `start()` binds its ports; its decisions after a step are the
policy's (bluevela/launch/policy.py) applied to its own allocation."""

from __future__ import annotations

import os
import socket

import pytest

from bluevela.goodput.outcome import Loss, LossKind, StepEnd
from bluevela.launch.policy import Exit, Relaunch, Requeue
from bluevela.launch.step_result import StepResult
from bluevela.launch.supervisor import Options, Supervisor

ENV = {"SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "node[1-4]", "BV_JOB_SECRET": "aa" * 32,
       "PET_RDZV_ID": "stale"}


def sockets() -> set[str]:
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:"):
            out.add(target)
    return out


def no_network(*_: object, **__: object) -> None:
    raise AssertionError("building a supervisor must not touch the network")


def test_building_one_opens_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    before = sockets()
    with monkeypatch.context() as m:
        for name in ("socket", "gethostbyname", "getaddrinfo", "create_connection"):
            m.setattr(socket, name, no_network)
        sup = Supervisor(Options(nodes=3, spare_nodes=1, torchrun=["torchrun", "t.py"]),
                         env=dict(ENV))
    assert sockets() == before
    assert sup.ends is None and sup.signals is None
    assert sup.alloc == ["node1", "node2", "node3", "node4"] and sup.job == "42"
    assert "BV_JOB_SECRET" not in sup.env and "PET_RDZV_ID" not in sup.env  # never inherited
    signals, ends = sup.start()
    try:
        assert len(sockets() - before) == 2  # the agents' TCP port and the ranks' UDP port
        assert sup.start() == (signals, ends)  # once
        env = sup.step_env(1, ["node1", "node2"], "bb" * 32)
        assert env["BV_SUPERVISOR"].endswith(f":{ends.listen.getsockname()[1]}"), env
        assert env["BV_HEARTBEAT"].endswith(f":{ends.udp.getsockname()[1]}"), env
    finally:
        sup.close()
    assert sockets() == before


def test_one_node_listens_on_loopback_only() -> None:
    sup = Supervisor(Options(nodes=1, torchrun=["torchrun", "t.py"]),
                     env={"SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "node1"})
    _, ends = sup.start()
    try:
        assert ends.listen.getsockname()[0] == "127.0.0.1" == ends.udp.getsockname()[0]
        assert ends.line_addr().startswith("127.0.0.1:")
    finally:
        sup.close()


def test_its_decisions_are_the_policys_on_its_own_allocation() -> None:
    sup = Supervisor(Options(nodes=3, spare_nodes=1, torchrun=["torchrun", "t.py"]),
                     env=dict(ENV))
    step = ["node1", "node2", "node3"]
    lost = StepResult(StepEnd.LOST, 1, "node2 lost (x)", {"node2": Loss.closed()})
    action = sup.decide(lost, step, 1)
    assert action == Relaunch(("node1", "node3", "node4"),
                              "node2 lost (x); relaunching on node[1,3-4] (spare node4)",
                              {"node2": Loss.closed()})
    assert sup.excluded == {"node2": Loss.closed()}
    # The spare is used: the next lost node has no room, and growth is off here.
    again = sup.decide(StepResult(StepEnd.LOST, 1, "node4 lost (y)", {"node4": Loss.silent(10)}),
                       list(action.nodes), 2)
    assert isinstance(again, Requeue) and again.release == ("node4",)
    assert "no node grown (job growth is off" in again.cause
    assert {n: loss.kind for n, loss in sup.excluded.items()} == {
        "node2": LossKind.CLOSED, "node4": LossKind.SILENT}
    assert sup.decide(StepResult(StepEnd.OK, 0, "exit 0"), step, 3) == Exit(0, "exit 0")


def test_a_tests_supervisor_leaves_no_descriptor() -> None:
    before = set(os.listdir("/proc/self/fd"))
    for _ in range(20):
        sup = Supervisor(Options(nodes=1, torchrun=["torchrun", "t.py"]),
                         env={"SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "node1"})
        sup.start()
        sup.close()
    assert set(os.listdir("/proc/self/fd")) == before
