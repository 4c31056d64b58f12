"""bluevela/launch/rdzv_guard.py: torchrun's rendezvous state unpickled through an allow-list,
and when the node agent uses it (the attack through a real TCPStore and a real torchrun:
tests/test_rdzv_secret.py); the store's host outlives every node's shutdown (two real torchruns
on this machine, one stopped at the exit barrier)."""

from __future__ import annotations

import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from bluevela.launch.rdzv_guard import (
    LINGER_S,
    HeldStore,
    finish_rendezvous,
    guarded_argv,
    guarded_pickle,
    install,
    loads,
)


class Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, ...]:
        return (exec, (f"open({str(self.marker)!r}, 'w').close()",))


def test_the_real_state_round_trips() -> None:
    dr = pytest.importorskip("torch.distributed.elastic.rendezvous.dynamic_rendezvous")
    state = dr._RendezvousState()
    node = dr._NodeDesc("gpu001", 4242, 0)
    state.round, state.complete = 3, True
    state.deadline = datetime.now(UTC) + timedelta(seconds=30)
    state.participants[node] = 0
    state.wait_list.add(dr._NodeDesc("gpu002", 17, 0))
    state.redundancy_list.add(node)
    state.last_heartbeats[node] = datetime.now(UTC)
    back = loads(pickle.dumps(state))
    assert isinstance(back, dr._RendezvousState)
    assert vars(back) == vars(state)


@pytest.mark.parametrize("protocol", [2, pickle.DEFAULT_PROTOCOL, pickle.HIGHEST_PROTOCOL])
def test_a_pickle_that_runs_code_is_refused(tmp_path: Path, protocol: int) -> None:
    marker = tmp_path / "pwned"
    data = pickle.dumps(Payload(marker), protocol=protocol)
    with pytest.raises(pickle.UnpicklingError, match=r"exec is not part of torchrun.s rendezvous state"):
        loads(data)
    assert not marker.exists()
    pickle.loads(data)  # what torch's own pickle.loads does with it
    assert marker.exists()


def test_install_puts_the_guard_where_torch_unpickles(tmp_path: Path) -> None:
    dr = pytest.importorskip("torch.distributed.elastic.rendezvous.dynamic_rendezvous")
    saved = dr.pickle, dr.get_method_name
    try:
        install()
        assert dr.pickle is not pickle and dr.pickle.loads is loads
        assert dr.pickle.dumps is pickle.dumps and dr.pickle.PickleError is pickle.PickleError
        with pytest.raises(pickle.PickleError):  # what torchrun catches: "state is corrupt"
            dr.pickle.loads(pickle.dumps(Payload(tmp_path / "x")))
        assert guarded_pickle().UnpicklingError is pickle.UnpicklingError
    finally:
        dr.pickle, dr.get_method_name = saved


def test_install_names_rendezvous_events_without_inspect_stack(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's get_method_name (the name of every rendezvous event) calls inspect.stack(),
    which reads a source line for every frame; under the guard's `python -m` each of runpy's
    frozen frames costs a scan of every loaded module (~3 ms a call, two per event, a dozen
    events on each node's way to its ranks: issue 23's slower relaunch). The guard's version gives
    torch the same names from the frames themselves."""
    dr = pytest.importorskip("torch.distributed.elastic.rendezvous.dynamic_rendezvous")
    import inspect

    saved = dr.pickle, dr.get_method_name
    torchs = dr.get_method_name

    def record(name_of: object) -> str:  # as torch's _record(): get_method_name()
        return name_of()  # type: ignore[operator,no-any-return]

    def join_op(name_of: object) -> str:  # the function whose name the event carries
        return record(name_of)

    try:
        install()
        assert dr.get_method_name is not torchs
        assert join_op(dr.get_method_name) == join_op(torchs) == "join_op"
        assert dr.get_method_name(10_000) == torchs(10_000) == "no_method_name"
        monkeypatch.setattr(inspect, "stack", lambda *a, **k: pytest.fail("inspect.stack"))
        assert join_op(dr.get_method_name) == "join_op"
    finally:
        dr.pickle, dr.get_method_name = saved


def _script(path: Path, body: str) -> Path:
    path.write_text(body)
    path.chmod(0o755)
    return path


TORCHRUN = ("# -*- coding: utf-8 -*-\nimport re\nimport sys\nfrom torch.distributed.run import "
            "main\nif __name__ == '__main__':\n    sys.exit(main())\n")


def test_guarded_argv_only_for_torchs_torchrun_of_this_python(tmp_path: Path) -> None:
    python = str(tmp_path / "venv" / "bin" / "python3")
    bindir = tmp_path / "venv" / "bin"
    bindir.mkdir(parents=True)
    torchrun = _script(bindir / "torchrun", f"#!{bindir}/python\n{TORCHRUN}")
    argv = ["torchrun", "--nnodes=2", "train.py", "--lr", "1"]
    assert guarded_argv(argv, python, path=str(bindir)) == [
        python, "-P", "-m", "bluevela.launch.rdzv_guard", str(torchrun), *argv[1:]]
    # Another environment's torchrun: bluevela may not import there; run it as it is.
    other = tmp_path / "other"
    other.mkdir()
    _script(other / "torchrun", f"#!/opt/elsewhere/bin/python\n{TORCHRUN}")
    assert guarded_argv(argv, python, path=str(other)) is None
    # Not torch's torchrun (a site's wrapper, bv's test stand-ins), missing, or empty.
    wrap = tmp_path / "wrap"
    wrap.mkdir()
    _script(wrap / "torchrun", f"#!{bindir}/python\nimport os\n")
    assert guarded_argv(argv, python, path=str(wrap)) is None
    assert guarded_argv(["no-such-torchrun"], python, path=str(bindir)) is None
    # A pyenv shim runs the same name of the current version: the torchrun beside `python`.
    shims = tmp_path / "shims"
    shims.mkdir()
    _script(shims / "torchrun", '#!/usr/bin/env bash\nprogram="${0##*/}"\n'
            'exec "/root/.pyenv/libexec/pyenv" exec "$program" "$@"\n')
    assert guarded_argv(argv, python, path=str(shims)) == [
        python, "-P", "-m", "bluevela.launch.rdzv_guard", str(torchrun), *argv[1:]]
    assert guarded_argv([], python) is None


def test_this_pythons_torchrun_is_guarded() -> None:
    torchrun = Path(sys.executable).parent / "torchrun"
    if not torchrun.exists():
        pytest.skip(f"no {torchrun}")
    argv = guarded_argv([str(torchrun), "x.py"])
    assert argv is not None and argv[3] == "bluevela.launch.rdzv_guard"


# A worker that needs no torch: node 1's ends at once, node 0's when the test says.
WORKER = """import os, sys, time
if os.environ["GROUP_RANK"] == "0":
    while not os.path.exists(sys.argv[1]):
        time.sleep(0.05)
print("worker of node", os.environ["GROUP_RANK"], "done", flush=True)
"""


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _until(what: str, test: object, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not (callable(test) and test()):
        assert time.monotonic() < deadline, f"no {what} in {timeout:.0f} s"
        time.sleep(0.05)


@pytest.mark.timeout(180)
def test_the_store_outlives_the_other_nodes_shutdown(tmp_path: Path) -> None:
    """torch 2.13's end-of-step race, made certain: node 1 reaches the exit barrier first and
    is stopped there (SIGSTOP: a node the scheduler left behind), node 0 (the store's host)
    passes the barrier. Before the fix node 0's torchrun exited and took the store with it:
    node 1 woke to a dead store ("recvValue failed", "failed to shutdown the rendezvous"; one
    step earlier it is "Error waiting on exit barrier" with a traceback). Now node 0's guard
    keeps the store until node 1 has finished too, then exits at once."""
    torchrun = shutil.which("torchrun")
    if torchrun is None or guarded_argv([torchrun]) is None:
        pytest.skip("no torch torchrun for this Python")
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    go, port = tmp_path / "go", _free_port()
    env = {**os.environ, "LOGLEVEL": "INFO"}

    def start(node: int) -> subprocess.Popen[bytes]:
        argv = guarded_argv([torchrun, "--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d",
                             f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=byos",
                             "--rdzv-conf", f"is_host={int(node == 0)}", str(worker), str(go)])
        assert argv is not None
        with open(tmp_path / f"node{node}.log", "wb") as log:
            return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                    cwd=tmp_path)

    def log(node: int) -> str:
        return (tmp_path / f"node{node}.log").read_text(errors="replace")

    host = start(0)
    other = start(1)
    try:
        _until("node 1 at the exit barrier",
               lambda: "Waiting 300 seconds for other agents" in log(1) or other.poll(), 120)
        assert other.poll() is None, log(1)
        os.kill(other.pid, signal.SIGSTOP)
        go.touch()
        _until("node 0 past the exit barrier", lambda: "Done waiting for other agents" in log(0)
               or host.poll() is not None, 60)
        time.sleep(2.0)  # torch's own end: node 0 closes the rendezvous and exits in < 1 s
        assert host.poll() is None, f"the store's host left before node 1 finished:\n{log(0)}"
        os.kill(other.pid, signal.SIGCONT)
        resumed = time.monotonic()
        assert other.wait(60) == 0, log(1)
        assert host.wait(60) == 0, log(0)
        took = time.monotonic() - resumed
    finally:
        for proc in (host, other):
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)
                proc.kill()
                proc.wait()
    for text in (log(0), log(1)):
        assert "Traceback" not in text and "recvValue" not in text, text
        assert "failed to shutdown the rendezvous" not in text, text
        assert "Error waiting on exit barrier" not in text and "bv rdzv_guard" not in text, text
    assert "Done waiting for other agents" in log(1)
    assert took < LINGER_S, took  # the host left once node 1 had finished, not at the bound


def test_the_host_waits_at_most_the_bound_and_a_late_node_finds_no_store() -> None:
    dist = pytest.importorskip("torch.distributed")
    port = _free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, multi_tenant=True)
    client = dist.TCPStore("127.0.0.1", port, is_master=False)
    # Node 1 of 3 finished first; the host waits for a node that never comes: the bound.
    assert finish_rendezvous(HeldStore(client, "r", host=False), 3, linger_s=5) is None
    started = time.monotonic()
    note = finish_rendezvous(HeldStore(server, "r", host=True), 3, linger_s=0.5)
    assert 0.5 <= time.monotonic() - started < 3
    assert note == ("bv rdzv_guard: 1 of 3 nodes' torchrun did not finish within 0 s: "
                    "the rendezvous store closes now\n")
    # All in: no wait at all once the last one has added itself.
    started = time.monotonic()
    assert finish_rendezvous(HeldStore(client, "s", host=False), 2) is None
    assert finish_rendezvous(HeldStore(server, "s", host=True), 2) is None
    assert finish_rendezvous(HeldStore(server, "t", host=False), 1) is None
    assert time.monotonic() - started < 1
    # The host is gone: the late node has nothing left to do, quietly and at once.
    del server
    with pytest.raises(RuntimeError):
        client.add("probe", 1)
    started = time.monotonic()
    assert finish_rendezvous(HeldStore(client, "u", host=False), 2) is None
    assert time.monotonic() - started < 2
