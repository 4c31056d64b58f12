"""bluevela/launch/rdzv_guard.py: torchrun's rendezvous state unpickled through an allow-list,
and when the node agent uses it (the attack through a real TCPStore and a real torchrun:
tests/launch/test_rdzv_secret.py); the store's host outlives every node's shutdown (two real torchruns
on this machine, one stopped at the exit barrier)."""

from __future__ import annotations

import json
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
    GuardUnavailable,
    HeldStore,
    finish_rendezvous,
    guard_plan,
    guarded_argv,
    guarded_pickle,
    install,
    launcher_python,
    loads,
    torchrun_start,
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
        return name_of()  # type: ignore[operator]

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
@pytest.mark.parametrize("backend", ["static", "c10d"])
def test_the_store_outlives_the_other_nodes_shutdown(tmp_path: Path, backend: str) -> None:
    """torch 2.13's end-of-step race, made certain: node 1 reaches the exit barrier first and
    is stopped there (SIGSTOP: a node the scheduler left behind), node 0 (the store's host)
    passes the barrier. Before the fix node 0's torchrun exited and took the store with it:
    node 1 woke to a dead store ("recvValue failed", "failed to shutdown the rendezvous"; one
    step earlier it is "Error waiting on exit barrier" with a traceback). Now node 0's guard
    keeps the store until node 1 has finished too, then exits at once: with c10d (a step with
    --max-restarts) and with the static rendezvous bv uses otherwise (issue 37; before it the
    guard held c10d's store only, and the static host left at once)."""
    torchrun = shutil.which("torchrun")
    if torchrun is None or guarded_argv([torchrun]) is None:
        pytest.skip("no torch torchrun for this Python")
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    go, port = tmp_path / "go", _free_port()
    env = {**os.environ, "LOGLEVEL": "INFO"}

    def start(node: int) -> subprocess.Popen[bytes]:
        rdzv = ([f"--node-rank={node}"] if backend == "static"
                else ["--rdzv-conf", f"is_host={int(node == 0)}"])
        argv = guarded_argv([torchrun, "--nnodes=2", "--nproc-per-node=1",
                             f"--rdzv-backend={backend}", f"--rdzv-endpoint=127.0.0.1:{port}",
                             "--rdzv-id=byos", *rdzv, str(worker), str(go)])
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


# --------------------------------------------------------------------------------------------
# Every launcher form pip, uv and conda write (issue 33 §2): the guard finds the real Python

LAUNCHERS = Path(__file__).resolve().parents[1] / "data" / "launchers"
REC = "/tmp/rec"
LONG = f"{REC}/{'d' * 60}/{'e' * 60}"


@pytest.mark.parametrize(("name", "venv_bin"), [
    ("pip-short", f"{REC}/short/venv/bin"),
    ("pip-long-path", f"{LONG}/venv/bin"),
    ("pip-space", f"{REC}/with space/venv/bin"),
    ("uv-short", f"{REC}/short/venv-uv/bin"),
    ("uv-long-path", f"{LONG}/venv-uv/bin"),
    ("uv-space", f"{REC}/with space/venv-uv/bin"),
    ("conda-entry-point-space", f"{REC}/conda envs/train/bin"),
])
def test_recorded_launchers_are_guarded(tmp_path: Path, name: str, venv_bin: str) -> None:
    """tests/data/launchers/ (pip 23.2.1 and uv 0.13.9 recorded, conda's from its source):
    before, every #!/bin/sh trampoline (a path over 127 bytes or with a space) made the
    guard return None and torch's torchrun ran unguarded without a word."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    torchrun = bindir / "torchrun"
    shutil.copyfile(LAUNCHERS / name, torchrun)
    torchrun.chmod(0o755)
    python = f"{venv_bin}/python3"
    argv = ["torchrun", "--nnodes=2", "train.py"]
    assert guarded_argv(argv, python, path=str(bindir)) == [
        python, "-P", "-m", "bluevela.launch.rdzv_guard", str(torchrun), *argv[1:]]
    # The same launcher with another environment's bv: not guarded (bluevela may not import).
    assert guarded_argv(argv, "/opt/other/bin/python3", path=str(bindir)) is None
    with pytest.raises(GuardUnavailable, match="another environment than bv's"):
        guard_plan(argv, "/opt/other/bin/python3", str(bindir))


def test_uv_relocatable_and_conda_env_launchers(tmp_path: Path) -> None:
    """uv's relocatable venv runs the Python beside the (real) script; conda's long-prefix
    rewrite (#!/usr/bin/env python3.11) runs the first python3.11 on the job's PATH."""
    venv = tmp_path / "venv" / "bin"
    venv.mkdir(parents=True)
    shutil.copyfile(LAUNCHERS / "uv-relocatable", venv / "torchrun")
    (venv / "torchrun").chmod(0o755)
    linked = tmp_path / "links"
    linked.mkdir()
    (linked / "torchrun").symlink_to(venv / "torchrun")
    head = (LAUNCHERS / "uv-relocatable").read_bytes()
    assert launcher_python(str(linked / "torchrun"), head) == str(venv / "python")
    argv = ["torchrun", "t.py"]
    assert guarded_argv(argv, str(venv / "python3"), path=str(linked)) is not None
    # conda: python3.11 resolved on PATH; its directory decides, as for any other form.
    conda = tmp_path / "conda" / "bin"
    conda.mkdir(parents=True)
    shutil.copyfile(LAUNCHERS / "conda-long-prefix", conda / "torchrun")
    (conda / "torchrun").chmod(0o755)
    (conda / "python3.11").symlink_to(sys.executable)
    assert guarded_argv(argv, str(conda / "python3"), path=str(conda)) == [
        str(conda / "python3"), "-P", "-m", "bluevela.launch.rdzv_guard",
        str(conda / "torchrun"), "t.py"]
    (conda / "python3.11").unlink()  # no python3.11 on the job's PATH: nothing to compare
    with pytest.raises(GuardUnavailable, match="names its Python in no form"):
        guard_plan(argv, str(conda / "python3"), str(conda))


def _shim_wheel(out: Path) -> Path:
    """A wheel whose one entry point is torch's: `torchrun = torch.distributed.run:main`
    (what torch's own wheel declares), written by hand: no build backend needed."""
    import zipfile

    wheel = out / "trshim-0.0.1-py3-none-any.whl"
    info = "trshim-0.0.1.dist-info"
    files = {
        "trshim/__init__.py": "",
        f"{info}/METADATA": "Metadata-Version: 2.1\nName: trshim\nVersion: 0.0.1\n",
        f"{info}/WHEEL": ("Wheel-Version: 1.0\nGenerator: bluevela-tests\nRoot-Is-Purelib: "
                          "true\nTag: py3-none-any\n"),
        f"{info}/entry_points.txt": "[console_scripts]\ntorchrun = torch.distributed.run:main\n",
    }
    with zipfile.ZipFile(wheel, "w") as zf:
        for name, body in files.items():
            zf.writestr(name, body)
        zf.writestr(f"{info}/RECORD", "".join(f"{n},,\n" for n in files) + f"{info}/RECORD,,\n")
    return wheel


def _venv_with_torchrun(where: Path, wheel: Path) -> Path:
    """A real venv (the system's site-packages visible: torch and bluevela import) with the
    wheel installed by pip, which writes the launcher its own way for this path."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages",
                    str(where)], check=True, timeout=120)
    p = subprocess.run([sys.executable, "-m", "pip", "--python", str(where / "bin" / "python3"),
                        "install", "-q", "--no-deps", "--no-index", "--no-compile", str(wheel)],
                       capture_output=True, text=True, timeout=300, check=False,
                       env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    assert p.returncode == 0, p.stderr
    return where


# The worker says whether its torchrun is the guard: its parent's command line.
GUARD_PROBE = """import os
argv = open(f"/proc/{os.getppid()}/cmdline", "rb").read().split(b"\\0")
print("GUARDED" if b"bluevela.launch.rdzv_guard" in argv else "UNGUARDED", flush=True)
"""


@pytest.mark.timeout(300)
def test_real_venvs_at_a_long_path_and_with_a_space_run_torchrun_guarded(tmp_path: Path) -> None:
    """The reproduction of issue 33 §2: venvs made by `python -m venv` at a path over 127
    bytes and at one with a space, torchrun installed by pip: pip writes the #!/bin/sh
    trampoline, and the guard used to return None (torch's torchrun ran unguarded). Now the
    agent's command runs torchrun through the guard, for real."""
    pytest.importorskip("torch.distributed.run")
    wheel = _shim_wheel(tmp_path)
    long_base = tmp_path / ("l" * 70) / ("m" * 40)
    venvs = [_venv_with_torchrun(long_base / "venv", wheel),
             _venv_with_torchrun(tmp_path / "with space" / "venv", wheel)]
    probe = tmp_path / "probe.py"
    probe.write_text(GUARD_PROBE)
    for venv in venvs:
        bindir = venv / "bin"
        first = (bindir / "torchrun").read_bytes().split(b"\n", 1)[0]
        assert first == b"#!/bin/sh", first  # pip's trampoline: the form the guard missed
        python = str(bindir / "python3")
        argv = guarded_argv(["torchrun", "--standalone", "--nproc-per-node=1", str(probe)],
                            python, path=str(bindir))
        assert argv is not None and argv[0] == python
        p = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=tmp_path,
                           check=False, env={**os.environ, "PATH": f"{bindir}:{os.defpath}"})
        assert p.returncode == 0 and "GUARDED" in p.stdout.split(), p.stdout + p.stderr


# --------------------------------------------------------------------------------------------
# When the guard cannot apply: said in the job's output, and the step fails unless the site
# opted out (site.yaml launch.rdzv_guard: optional -> BV_RDZV_GUARD in the batch script)

# Not torch's torchrun (a site's wrapper): records its environment, exits 0.
WRAPPER = """import json, os, sys
json.dump({k: os.environ.get(k) for k in ("PET_RDZV_CONF", "BV_RDZV_IS_HOST")},
          open(os.path.join(sys.argv[-1], "wrapper.env"), "w"))
"""


def _agent_run(tmp_path: Path, torchrun: Path, guard: str | None,
               node: str = "node1") -> tuple[dict[str, object], str]:
    """The real node agent on `torchrun` told `go` by a test supervisor: its exit message
    and its stderr (what lands in the job's output)."""
    from bluevela.protocol.keys import SECRET_ENV
    from tests.supervisor_standins import AgentLine

    line = AgentLine()
    env = {k: v for k, v in os.environ.items() if not k.startswith("BV_")}
    env.update(BV_SUPERVISOR=line.address, SLURMD_NODENAME=node,
               BV_RDZV_NODE="node1", **{SECRET_ENV: line.secret})
    if guard is not None:
        env["BV_RDZV_GUARD"] = guard
    err = tmp_path / f"agent-{guard}.err"
    with open(err, "wb") as errf:
        agent = subprocess.Popen([sys.executable, "-P", "-m", "bluevela.launch.agent", "--",
                                  str(torchrun), str(tmp_path)], env=env, stderr=errf,
                                 cwd=tmp_path)
        try:
            line.accept()
            hello = line.next()
            line.send({"t": "go", "port": hello.get("port", 40000)})
            msg = line.until("exit")
            agent.wait(timeout=30)
        finally:
            if agent.poll() is None:
                agent.kill()
                agent.wait()
            line.close()
    return msg, err.read_text()


@pytest.mark.timeout(120)
def test_an_unguardable_torchrun_fails_the_step_unless_the_site_allows_it(
        tmp_path: Path) -> None:
    """Before, the agent ran whatever guarded_argv could not guard, silently. Now: exit 126
    with the reason (the supervisor's end line), nothing started; with the site's opt-out it
    runs, the job's output says it is unguarded, and is_host still reaches torchrun
    (PET_RDZV_CONF: torchrun's --rdzv-conf from the environment)."""
    wrapper = _script(tmp_path / "torchrun", f"#!{sys.executable}\n{WRAPPER}")
    msg, err = _agent_run(tmp_path, wrapper, None)
    assert msg["rc"] == 126, msg
    why = str(msg["why"])
    assert "cannot run through bv's rendezvous guard" in why and "not torch's torchrun" in why
    assert "launch.rdzv_guard: optional" in why and why in err
    assert not (tmp_path / "wrapper.env").exists()
    msg, err = _agent_run(tmp_path, wrapper, "optional")
    assert msg["rc"] == 0, (msg, err)
    assert "torchrun runs WITHOUT bv's rendezvous guard" in err
    assert json.loads((tmp_path / "wrapper.env").read_text()) == {
        "PET_RDZV_CONF": "is_host=1", "BV_RDZV_IS_HOST": None}
    # Any other value is not an opt-out.
    msg, _ = _agent_run(tmp_path, wrapper, "off")
    assert msg["rc"] == 126, msg


def test_torchrun_start_names_the_host_on_every_node(tmp_path: Path) -> None:
    bindir = tmp_path / "venv" / "bin"
    bindir.mkdir(parents=True)
    _script(bindir / "torchrun", f"#!{bindir}/python\n{TORCHRUN}")
    env = {"PATH": str(bindir)}
    python = str(bindir / "python3")
    host = torchrun_start(["torchrun", "t.py"], host=True, env=env, python=python)
    client = torchrun_start(["torchrun", "t.py"], host=False, env=env, python=python)
    assert host.argv == client.argv == [python, "-P", "-m", "bluevela.launch.rdzv_guard",
                                        str(bindir / "torchrun"), "t.py"]
    assert (host.env, client.env, host.note) == ({"BV_RDZV_IS_HOST": "1"},
                                                 {"BV_RDZV_IS_HOST": "0"}, "")
    wrap = tmp_path / "wrap"
    wrap.mkdir()
    _script(wrap / "torchrun", "#!/bin/sh\nexec torchrun \"$@\"\n")
    opted = torchrun_start(["torchrun"], host=False, python=python,
                           env={"PATH": str(wrap), "BV_RDZV_GUARD": "optional",
                                "PET_RDZV_CONF": "read_timeout=90"})
    assert opted.env == {"PET_RDZV_CONF": "read_timeout=90,is_host=0"}


@pytest.mark.timeout(240)
def test_a_squatted_rendezvous_port_fails_the_host_instead_of_being_joined(
        tmp_path: Path) -> None:
    """torch 2.13 guesses is_host from the endpoint's name; when the port is taken its guess
    falls back to a client of whoever holds it (reproduced first: the step runs on the
    squatter's store). Named by bv (BV_RDZV_IS_HOST=1 on the step's first node), the host's
    torchrun fails with bv's line. The squatter is a TCPStore server that bound the port
    first, as another user of the node would (root here: no other uid imports this torch)."""
    dist = pytest.importorskip("torch.distributed")
    torchrun = shutil.which("torchrun")
    if torchrun is None or guarded_argv([torchrun]) is None:
        pytest.skip("no torch torchrun for this Python")
    port = _free_port()
    squatter = dist.TCPStore("127.0.0.1", port, is_master=True, multi_tenant=True)
    worker = tmp_path / "worker.py"
    worker.write_text("print('WORKER RAN', flush=True)\n")
    argv = guarded_argv([torchrun, "--nnodes=1", "--nproc-per-node=1", "--rdzv-backend=c10d",
                         f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=squat", str(worker)])
    assert argv is not None
    base = {k: v for k, v in os.environ.items() if k != "BV_RDZV_IS_HOST"}
    try:
        joined = subprocess.run(argv, capture_output=True, text=True, timeout=120,
                                cwd=tmp_path, env=base, check=False)
        named = subprocess.run(argv, capture_output=True, text=True, timeout=120,
                               cwd=tmp_path, env={**base, "BV_RDZV_IS_HOST": "1"}, check=False)
    finally:
        del squatter
    assert joined.returncode == 0 and "WORKER RAN" in joined.stdout, joined.stderr
    assert named.returncode != 0 and "WORKER RAN" not in named.stdout
    assert (f"bv rdzv_guard: cannot host the rendezvous store at 127.0.0.1:{port}: the port "
            "is taken") in named.stderr


def test_the_site_decides_and_the_batch_script_says_it_last(tmp_path: Path) -> None:
    """site.yaml launch.rdzv_guard: required (default) or optional, validated; the batch
    script exports it after the job's own environment, so a job's --env cannot opt out."""
    import yaml

    from bluevela.errors import SiteConfigError
    from bluevela.launch.submit import build_request
    from bluevela.site_file import parse_site
    from tests.conftest import REPO

    doc = yaml.safe_load((REPO / "site.yaml").read_text())
    default = parse_site(yaml.safe_dump(doc), tmp_path / "site.yaml")
    assert default.launch.rdzv_guard == "required"
    doc.setdefault("launch", {})["rdzv_guard"] = "optional"
    site = parse_site(yaml.safe_dump(doc), tmp_path / "site.yaml")
    text = build_request(site, "train.py", env=("BV_RDZV_GUARD=required",)).materialize()
    lines = text.splitlines()
    assert lines.index("export BV_RDZV_GUARD=optional") > lines.index(
        "export BV_RDZV_GUARD=required")
    text = build_request(default, "train.py", env=("BV_RDZV_GUARD=optional",)).materialize()
    assert text.splitlines()[-2] == "export BV_RDZV_GUARD=required"
    doc["launch"]["rdzv_guard"] = "off"
    with pytest.raises(SiteConfigError, match="rdzv_guard"):
        parse_site(yaml.safe_dump(doc), tmp_path / "site.yaml")


@pytest.mark.timeout(180)
def test_the_real_supervisor_ends_the_step_with_the_reason_not_a_requeue(tmp_path: Path) -> None:
    """Two nodes, the real supervisor and agents (tests/supervisor_standins.py), a torchrun
    that is not torch's and no opt-out: the job ends with 126 and an end line that says why
    (not a lost node: no relaunch, no requeue), and the job's output says it once, not once
    a node."""
    from tests.supervisor_standins import Job

    job = Job(tmp_path, ("n1", "n2"), extra_env={"BV_RDZV_GUARD": "required"}).start()
    try:
        assert job.wait(120) == 126
    finally:
        job.kill()
    err = (tmp_path / "err.txt").read_text()
    out = (tmp_path / "out.txt").read_text()
    assert err.count("cannot run through bv's rendezvous guard") == 1, err
    assert "==== bv attempt 1 ended: exit 126 (torchrun cannot run through bv's rendezvous " \
           "guard" in out and "not a lost node, so no relaunch or requeue" in out, out
    assert "attempt 2" not in out
    assert not list(tmp_path.glob("rdzv-id.*"))  # no torchrun ran on any node


def test_a_pyenv_shim_for_a_venv_without_torchrun_is_another_environment(tmp_path: Path) -> None:
    """A venv whose torch comes from elsewhere has no torchrun of its own; the pyenv shim on
    PATH would run the pyenv version's (before: run unguarded without a word)."""
    shims = tmp_path / "shims"
    shims.mkdir()
    _script(shims / "torchrun", '#!/usr/bin/env bash\nprogram="${0##*/}"\n'
            'exec "/root/.pyenv/libexec/pyenv" exec "$program" "$@"\n')
    venv = tmp_path / "venv" / "bin"
    venv.mkdir(parents=True)
    with pytest.raises(GuardUnavailable, match="is a pyenv shim, and the job's Python .* has "
                                               "no torchrun beside it"):
        guard_plan(["torchrun", "t.py"], str(venv / "python3"), str(shims))
