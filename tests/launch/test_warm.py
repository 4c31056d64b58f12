"""The warm start (bluevela/launch/warm.py), on this machine without the cluster: a real warm
server, its zygotes and their forked ranks as local processes (the zygotes pre-import `json`
instead of torch, to be quick), the agent's side (`warm.launch`, `WarmRun`) driving them.
tests/launch/test_recovery_cluster.py (spare-warm) runs it in a real job across a node crash.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from bluevela.launch import warm
from bluevela.launch.proctree import catches, children

NODE = "n2"
ARGV = ["torchrun", "--nnodes=2", "--rdzv-backend=static", "--nproc-per-node=2",
        "--max-restarts=0"]
SCRIPT = """\
import json, os, signal, sys, time
out = os.environ["OUT"]
rank = os.environ["LOCAL_RANK"]
def wrote(*_):
    open(os.path.join(out, "usr1-" + rank), "w").close()
    sys.exit(0)
signal.signal(signal.SIGUSR1, wrote)
info = {"name": __name__, "argv": sys.argv, "cwd": os.getcwd(), "path0": sys.path[0],
        "env": dict(os.environ), "pid": os.getpid()}
with open(os.path.join(out, ".rank-" + rank), "w") as fh:
    json.dump(info, fh)
os.replace(os.path.join(out, ".rank-" + rank), os.path.join(out, "rank-" + rank))
if os.environ.get("RAISE_" + rank):
    raise ValueError("a bad step")
time.sleep(float(os.environ.get("SLEEP_" + rank, "0")))
sys.exit(int(os.environ.get("CODE_" + rank, "0")))
"""


def _until(what: str, cond: Callable[[], object], timeout: float = 30.0) -> object:
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        assert time.monotonic() < deadline, f"no {what} after {timeout:.0f} s"
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.fixture()
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    sockets = tmp_path / "sockets"
    out = tmp_path / "out"
    out.mkdir()
    (tmp_path / "script.py").write_text(SCRIPT)
    values = {"SLURM_JOB_ID": "77", warm.DIR_ENV: str(sockets), warm.PREIMPORT_ENV: "json",
              "BV_STEP_NODELIST": "n1,n2", "PET_RDZV_ID": "run77", "OUT": str(out),
              "PATH": os.environ.get("PATH", "")}
    for key, value in values.items():
        monkeypatch.setenv(key, value)  # a cold zygote gets the agent's environment
    monkeypatch.chdir(tmp_path)
    return values


@pytest.fixture()
def server(env: dict[str, str]) -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen([sys.executable, "-m", "bluevela.launch.warm", "serve"],
                            env={**os.environ, **env, "SLURMD_NODENAME": NODE})
    _until("the server's socket", lambda: os.path.exists(warm.socket_path(env, NODE)))
    yield proc
    if proc.poll() is None:
        proc.terminate()
        proc.wait(timeout=10)


def _warm_run(env: dict[str, str], extra: dict[str, str] | None = None,
              argv: list[str] | None = None) -> warm.WarmRun:
    """A step's ranks from the node's warm zygote once one is ready (bounded)."""
    request = warm.request_of([*(argv or ARGV), "script.py", "a", "b"], {**env, **(extra or {})},
                              {"node_rank": 1, "nnodes": 2}, NODE, "n1", 4242)
    assert isinstance(request, dict)
    got = _until("a ready zygote", lambda: warm._from_server(warm.socket_path(env, NODE)))
    assert isinstance(got, tuple)
    run = warm.WarmRun(got[0], got[1], "warm" if got[2] else "warming")
    warm.send_request(run, request)
    return run


def _ranks(env: dict[str, str]) -> dict[str, dict[str, object]]:
    out = Path(env["OUT"])
    return {p.name[5:]: json.loads(p.read_text()) for p in out.glob("rank-*")}


def _end(run: warm.WarmRun, timeout: float = 30.0) -> int:
    _until("the ranks' end", lambda: run.poll() is not None, timeout)
    assert run.rc is not None
    return run.rc


# --------------------------------------------------------------------------------------------
# The command and the world: pure


def test_plan_of_runs_bvs_torchrun_command_and_refuses_what_it_cannot_run_alike() -> None:
    plan = warm.plan_of([*ARGV, "train.py", "--lr", "1"])
    assert plan == warm.Plan(2, 0, False, "train.py", ("--lr", "1"))
    plan = warm.plan_of(["python", "-m", "torch.distributed.run", "--nnodes", "1",
                         "--rdzv_backend=c10d", "--nproc_per_node", "3", "-m", "pkg.train", "x"])
    assert plan == warm.Plan(3, 0, True, "pkg.train", ("x",))
    for extra, why in (("--max-restarts=2", "--max-restarts > 0"),
                       ("--log-dir=/x", "--log-dir"), ("--tee=3", "--tee"),
                       ("--local-ranks-filter=0", "--local-ranks-filter"),
                       ("--nproc-per-node=gpu", "needs a number"),
                       ("--rdzv-backend=etcd", "etcd"), ("--no-python", "--no-python")):
        got = warm.plan_of([*ARGV, extra, "train.py"])
        assert isinstance(got, str) and why in got, (extra, got)
    assert isinstance(warm.plan_of(["torchrun", "--nproc-per-node=1"]), str)  # no script


def test_rank_envs_set_every_name_torchs_elastic_agent_sets() -> None:
    """The names are read from torch's own agent (local_elastic_agent._start_workers)."""
    import importlib.util

    spec = importlib.util.find_spec("torch")  # its file read, torch not imported
    if spec is None or spec.origin is None:
        pytest.skip("torch is not installed")
    source = (Path(spec.origin).parent / "distributed" / "elastic" / "agent" / "server"
              / "local_elastic_agent.py").read_text()
    block = source[source.index("worker_env = {"):source.index("}", source.index("worker_env = {"))]
    names = set(re.findall(r'"([A-Z_]+)":', block)) | {"LOCAL_RANK"}
    plan = warm.plan_of([*ARGV, "t.py"])
    assert isinstance(plan, warm.Plan)
    envs = warm.rank_envs(plan, 1, 2, ("n1", 4242), "run77", "1")
    request = warm.request_of([*ARGV, "t.py"], {}, {"node_rank": 1, "nnodes": 2}, NODE, "n1", 4242)
    assert isinstance(request, dict)
    common = request["env"]
    assert isinstance(common, dict)
    for env in envs:
        assert names <= set(env) | set(common), names - set(env) - set(common)
    assert [(e["RANK"], e["LOCAL_RANK"], e["GROUP_RANK"]) for e in envs] == [("2", "0", "1"),
                                                                             ("3", "1", "1")]
    assert {(e["WORLD_SIZE"], e["LOCAL_WORLD_SIZE"], e["GROUP_WORLD_SIZE"], e["MASTER_ADDR"],
             e["MASTER_PORT"], e["TORCHELASTIC_RUN_ID"], e["TORCHELASTIC_RESTART_COUNT"],
             e["OMP_NUM_THREADS"]) for e in envs} == {("4", "2", "2", "n1", "4242", "run77",
                                                      "0", "1")}


def test_world_of_takes_the_go_message_else_the_step_with_the_rendezvous_node_first() -> None:
    env = {"BV_STEP_NODELIST": "node[1-3]"}
    assert warm.world_of({"node_rank": 2, "nnodes": 3}, env, "node1", "node2") == (2, 3)
    assert warm.world_of({}, env, "node2", "node2") == (0, 3)
    assert warm.world_of({}, env, "node1", "node2") == (1, 3)
    assert warm.world_of({}, env, "node3", "node2") == (2, 3)
    assert warm.world_of({}, env, "node9", "node2") is None
    assert warm.world_of({"node_rank": True, "nnodes": 3}, env, "node3", "node2") == (2, 3)


def test_socket_dir_refuses_a_link_an_open_or_foreign_directory(tmp_path: Path) -> None:
    good = tmp_path / "good"
    assert warm.socket_dir({warm.DIR_ENV: str(good)}) == str(good)
    assert good.stat().st_mode & 0o777 == 0o700
    open_dir = tmp_path / "open"
    open_dir.mkdir(mode=0o755)
    open_dir.chmod(0o755)
    link = tmp_path / "link"
    link.symlink_to(good)
    for path in (open_dir, link):
        with pytest.raises(warm.WarmError, match="refused"):
            warm.socket_dir({warm.DIR_ENV: str(path)})
    with pytest.raises(warm.WarmError, match="must be uid"):
        warm.socket_dir({warm.DIR_ENV: str(good)}, uid=os.getuid() + 1)


def test_the_site_turns_it_on_for_the_job_and_the_servers_step_covers_the_allocation() -> None:
    from bluevela.launch.request import SubmitRequest

    base = SubmitRequest(script="train.py", nodes=2)
    assert "BV_WARM_START" not in base.materialize()
    on = SubmitRequest(script="train.py", nodes=2, warm_start=True).materialize()
    assert "\nexport BV_WARM_START=1\n" in on
    assert on.index("export BV_WARM_START=1") < on.index("\nexec ")
    argv = warm.server_step_argv(["node1", "node2", "node3"], "/py")
    assert argv[:1] == ["srun"] and "--overlap" in argv and "--no-kill" in argv
    assert "--nodelist=node1,node2,node3" in argv and "--ntasks-per-node=1" in argv
    assert argv[-5:] == ["/py", "-P", "-m", "bluevela.launch.warm", "serve"]
    assert warm.start_servers(["node1"], {}) is None  # off: no step


def test_site_yaml_launch_warm_start(tmp_path: Path) -> None:
    import yaml

    from bluevela.launch.submit import build_request
    from bluevela.site import load_site

    data = yaml.safe_load((Path(__file__).resolve().parents[2] / "site.yaml").read_text())
    site = tmp_path / "site.yaml"
    site.write_text(yaml.safe_dump(data))
    assert load_site(site).launch.warm_start is False
    data["launch"]["warm_start"] = True
    site.write_text(yaml.safe_dump(data))
    loaded = load_site(site)
    assert loaded.launch.warm_start is True
    assert build_request(loaded, script="train.py", nodes=1).warm_start is True


def test_site_yaml_launch_warm_preimport(tmp_path: Path) -> None:
    """The site's modules for the warm parents, exported by the batch script unless the job
    gave its own (`--env BV_WARM_PREIMPORT=...`); anything but module names refused."""
    import yaml

    from bluevela.errors import SiteConfigError
    from bluevela.launch.submit import build_request
    from bluevela.site import load_site

    data = yaml.safe_load((Path(__file__).resolve().parents[2] / "site.yaml").read_text())
    site = tmp_path / "site.yaml"
    site.write_text(yaml.safe_dump(data))
    assert load_site(site).launch.warm_preimport == ["torch", "torch._dynamo"]
    data["launch"].update(warm_start=True, warm_preimport=["torch", "lightning.pytorch"])
    site.write_text(yaml.safe_dump(data))
    req = build_request(load_site(site), script="train.py", nodes=1)
    text = req.materialize()
    line = 'export BV_WARM_PREIMPORT="${BV_WARM_PREIMPORT:-torch,lightning.pytorch}"'
    assert f"\n{line}\n" in text and text.index(line) < text.index("\nexec ")
    own = subprocess.run(["bash", "-c", f"{line}; echo $BV_WARM_PREIMPORT"], capture_output=True,
                         text=True, env={"BV_WARM_PREIMPORT": "torch,transformers"}, check=True)
    assert own.stdout.strip() == "torch,transformers"
    for bad in (["torch; rm -rf /"], [], ["lightning..pytorch"], ["$(id)"]):
        data["launch"]["warm_preimport"] = bad
        site.write_text(yaml.safe_dump(data))
        with pytest.raises(SiteConfigError, match="warm_preimport"):
            load_site(site)


def test_a_preimport_that_makes_a_cuda_context_sends_the_node_cold(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The decision without a GPU: torch says its CUDA is initialised after the imports (the
    GPU test below makes a real context)."""
    torch = pytest.importorskip("torch")
    warm._preimport({warm.PREIMPORT_ENV: "json"})  # torch is imported here, CUDA is not
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(warm.WarmError, match="initialised CUDA"):
        warm._preimport({warm.PREIMPORT_ENV: "json"})


def test_a_preimport_the_jobs_python_lacks_is_left_out_and_a_broken_one_fails(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A site's list may name a framework some jobs' Python lacks: those jobs' parents stay
    warm without it. A module that is there but fails to import fails the parent."""
    (tmp_path / "bv_test_broken_mod.py").write_text("import bv_test_no_such_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    warm._preimport({warm.PREIMPORT_ENV: "json,bv_test_not_installed,bv_test_absent.sub"})
    assert "json" in sys.modules and "bv_test_not_installed" not in sys.modules
    with pytest.raises(ModuleNotFoundError, match="bv_test_no_such_dependency"):
        warm._preimport({warm.PREIMPORT_ENV: "json,bv_test_broken_mod"})


@pytest.mark.gpu
def test_a_real_cuda_context_in_the_warm_parent_is_refused(tmp_path: Path) -> None:
    (tmp_path / "bv_cuda_at_import.py").write_text("import torch\ntorch.cuda.init()\n")
    code = ("from bluevela.launch import warm\n"
            "try:\n    warm._preimport({warm.PREIMPORT_ENV: 'bv_cuda_at_import'})\n"
            "except warm.WarmError as exc:\n    print('refused', exc)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(tmp_path)},
                          timeout=300, check=False)
    assert proc.stdout.startswith("refused"), proc.stdout + proc.stderr


# --------------------------------------------------------------------------------------------
# The processes


def test_ranks_forked_warm_get_torchruns_environment_argv_cwd_and_main(
        env: dict[str, str], server: subprocess.Popen[bytes], tmp_path: Path) -> None:
    run = _warm_run(env)
    assert _end(run) == 0
    ranks = _ranks(env)
    assert set(ranks) == {"0", "1"}
    for local, info in ranks.items():
        rank_env = info["env"]
        assert isinstance(rank_env, dict)
        assert info["name"] == "__main__" and info["argv"] == ["script.py", "a", "b"]
        assert info["cwd"] == str(tmp_path) and info["path0"] == str(tmp_path)
        assert rank_env["LOCAL_RANK"] == local and rank_env["RANK"] == str(2 + int(local))
        assert rank_env["WORLD_SIZE"] == "4" and rank_env["MASTER_PORT"] == "4242"
        assert rank_env[warm.HOW_ENV] == "warm"
        assert rank_env["OUT"] == env["OUT"]
    # The next step gets a fresh zygote: the used one served its step and ended.
    first = run.pid
    _until("the used zygote's end", lambda: not _alive(first))
    for p in Path(env["OUT"]).glob("rank-*"):
        p.unlink()
    second = _warm_run(env)
    assert second.pid != first and _end(second) == 0 and len(_ranks(env)) == 2


def test_the_first_failed_rank_ends_the_nodes_other_ranks(
        env: dict[str, str], server: subprocess.Popen[bytes]) -> None:
    run = _warm_run(env, {"CODE_1": "3", "SLEEP_0": "120"})
    started = time.monotonic()
    assert _end(run, 60) == 1  # torchrun's status for a failed worker
    assert time.monotonic() - started < 60
    assert all(not _alive(int(info["pid"])) for info in _ranks(env).values())  # type: ignore[call-overload]


def test_a_script_that_raises_shows_its_own_traceback_and_exits_1(
        env: dict[str, str], server: subprocess.Popen[bytes], tmp_path: Path,
        capfd: pytest.CaptureFixture[str]) -> None:
    run = _warm_run(env, {"RAISE_0": "1"})
    assert _end(run) == 1
    err = capfd.readouterr().err
    assert "ValueError: a bad step" in err
    tb = err[err.index("Traceback"):]
    assert 'File "' + str(tmp_path / "script.py") in tb.splitlines()[1] or "script.py" in \
        tb.splitlines()[1], tb
    assert "warm.py" not in tb


def test_no_rank_outlives_its_agent_into_the_next_step(
        env: dict[str, str], server: subprocess.Popen[bytes]) -> None:
    """The agent is gone (its step ended; Slurm killed it): its connection closes and the
    zygote kills the step's ranks at once."""
    run = _warm_run(env, {"SLEEP_0": "120", "SLEEP_1": "120"})
    _until("both ranks", lambda: len(_ranks(env)) == 2 and run.poll() is None and run.ranks)
    pids = [int(str(info["pid"])) for info in _ranks(env).values()]
    assert sorted(pids) == sorted(run.ranks) == run.workers()
    run.close()
    _until("the old step's ranks gone", lambda: not any(_alive(p) for p in pids), 15)
    _until("its zygote gone", lambda: not _alive(run.pid), 15)


def test_sigusr1_reaches_the_ranks_that_handle_it(
        env: dict[str, str], server: subprocess.Popen[bytes]) -> None:
    run = _warm_run(env, {"SLEEP_0": "120", "SLEEP_1": "120"})
    _until("handlers", lambda: len(run.workers() if run.poll() is None else []) == 2
           and all(catches(p, signal.SIGUSR1) for p in run.workers()))
    for pid in run.workers():
        os.kill(pid, signal.SIGUSR1)
    assert _end(run) == 0
    assert sorted(p.name for p in Path(env["OUT"]).glob("usr1-*")) == ["usr1-0", "usr1-1"]


def test_integrations_armed_or_not(env: dict[str, str], server: subprocess.Popen[bytes]) -> None:
    """BV_INTEGRATIONS=1: bv's start-up hook runs in each rank (its per-rank Slurm names);
    0 (bv submit --env BV_INTEGRATIONS=0): it does not, and the script runs the same."""
    assert _end(_warm_run(env, {"BV_INTEGRATIONS": "1"})) == 0
    on = _ranks(env)
    assert {str(i["env"]["SLURM_PROCID"]) for i in on.values()} == {"2", "3"}  # type: ignore[index]
    for p in Path(env["OUT"]).glob("rank-*"):
        p.unlink()
    assert _end(_warm_run(env, {"BV_INTEGRATIONS": "0"})) == 0
    assert all("SLURM_PROCID" not in i["env"] for i in _ranks(env).values())  # type: ignore[operator]


def test_a_zygote_that_dies_is_replaced(env: dict[str, str],
                                        server: subprocess.Popen[bytes]) -> None:
    first = _until("a zygote", lambda: children(server.pid))
    assert isinstance(first, list) and len(first) == 1
    os.kill(first[0], signal.SIGKILL)
    _until("its replacement", lambda: set(children(server.pid)) - set(first))
    run = _warm_run(env)
    assert run.pid != first[0] and _end(run) == 0


def test_no_server_answers_the_ranks_start_cold(env: dict[str, str]) -> None:
    run = warm.launch([*ARGV, "script.py"], env, {"node_rank": 0, "nnodes": 2}, NODE, NODE, 4242)
    assert isinstance(run, warm.WarmRun) and run.how == "cold"
    assert _end(run) == 0
    assert {str(i["env"][warm.HOW_ENV]) for i in _ranks(env).values()} == {"cold"}  # type: ignore[index]


def test_a_command_only_torchrun_runs_is_left_to_torchrun(env: dict[str, str]) -> None:
    got = warm.launch(["torchrun", "--nproc-per-node=1", "--max-restarts=3", "script.py"], env,
                      {}, NODE, "n1", 4242)
    assert isinstance(got, str) and "--max-restarts" in got


@pytest.fixture()
def open_server(env: dict[str, str], monkeypatch: pytest.MonkeyPatch
                ) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """A server whose socket another user could reach (a directory under /tmp, opened up
    after the server's start): only the peer check stands between them."""
    import shutil
    import tempfile

    folder = tempfile.mkdtemp(prefix="bv-warm-test-")
    monkeypatch.setenv(warm.DIR_ENV, folder)
    env[warm.DIR_ENV] = folder
    proc = subprocess.Popen([sys.executable, "-m", "bluevela.launch.warm", "serve"],
                            env={**os.environ, **env, "SLURMD_NODENAME": NODE})
    try:
        path = warm.socket_path(env, NODE)
        _until("the server's socket", lambda: os.path.exists(path))
        os.chmod(folder, 0o711)
        os.chmod(path, 0o666)
        yield proc, path
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to connect as another user")
def test_a_connection_from_another_user_is_refused(
        env: dict[str, str], open_server: tuple[subprocess.Popen[bytes], str]) -> None:
    _, path = open_server
    read_r, read_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(read_r)
        try:
            os.setgid(65534)
            os.setuid(65534)
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.settimeout(5)
                sock.connect(path)
                data = sock.recv(4096)
            os.write(read_w, b"got:" + data)
        except OSError as exc:
            os.write(read_w, f"error:{exc}".encode())
        os._exit(0)
    os.close(read_w)
    os.waitpid(pid, 0)
    answer = os.read(read_r, 4096)
    os.close(read_r)
    assert answer == b"got:", answer  # connected, then closed without a word
    with pytest.raises(warm.WarmError, match="refused"):  # the agent refuses such a folder
        warm.socket_path(env, NODE)
    os.chmod(os.path.dirname(path), 0o700)
    run = _warm_run(env)  # the zygote is still there for the job's own agent
    assert _end(run) == 0


def test_the_servers_end_reaps_the_zygote_that_never_got_its_turn(
        env: dict[str, str], server: subprocess.Popen[bytes]) -> None:
    zygotes = _until("a zygote", lambda: children(server.pid))
    assert isinstance(zygotes, list)
    server.terminate()
    assert server.wait(timeout=15) == 0
    _until("the unused zygote's end", lambda: not any(_alive(p) for p in zygotes), 15)
    assert not os.path.exists(warm.socket_path(env, NODE))


def test_a_killed_servers_socket_is_cleared_by_the_next_jobs(env: dict[str, str]) -> None:
    path = warm.socket_path(env, NODE)
    stale = os.path.join(os.path.dirname(path), f"12.{NODE}.sock")
    other_node = os.path.join(os.path.dirname(path), "12.n9.sock")
    for name in (stale, other_node):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.bind(name)  # closed without a listener: as a SIGKILLed server leaves it
    assert warm.clear_stale(path) == [f"12.{NODE}.sock"]
    assert not os.path.exists(stale) and os.path.exists(other_node)


def test_a_zygote_still_importing_is_handed_and_serves_once_imported(
        env: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Sooner than a cold one started beside it (the first step, a spare's relaunch soon
    after the job's start): the agent's request waits in the socket for the import's end."""
    (tmp_path / "slowmod.py").write_text("import time\ntime.sleep(2)\n")
    slow = {**env, warm.PREIMPORT_ENV: "slowmod", "PYTHONPATH": str(tmp_path)}
    proc = subprocess.Popen([sys.executable, "-m", "bluevela.launch.warm", "serve"],
                            env={**os.environ, **slow, "SLURMD_NODENAME": NODE})
    try:
        _until("the server's socket", lambda: os.path.exists(warm.socket_path(env, NODE)))
        run = warm.launch([*ARGV, "script.py"], env, {"node_rank": 1, "nnodes": 2}, NODE, "n1",
                          4242)
        assert isinstance(run, warm.WarmRun) and run.how == "warming"
        assert _end(run) == 0
        assert {str(i["env"][warm.HOW_ENV]) for i in _ranks(env).values()} == {"warm"}  # type: ignore[index]
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_a_script_that_handles_nothing_is_stopped_by_torchruns_sigterm(
        env: dict[str, str], server: subprocess.Popen[bytes]) -> None:
    """What the agent does for a worker with no SIGUSR1 handler (and at an abort): SIGTERM to
    the zygote, as to torchrun, which stops its ranks; the status is torchrun's failure."""
    script = Path("plain.py")
    script.write_text("import os, time\nopen(os.path.join(os.environ['OUT'], 'up-' + "
                      "os.environ['LOCAL_RANK']), 'w').close()\ntime.sleep(120)\n")
    request = warm.request_of([*ARGV, "plain.py"], env, {"node_rank": 0, "nnodes": 2}, NODE,
                              NODE, 4242)
    assert isinstance(request, dict)
    got = _until("a zygote", lambda: warm._from_server(warm.socket_path(env, NODE)))
    assert isinstance(got, tuple)
    run = warm.WarmRun(got[0], got[1], "warm")
    warm.send_request(run, request)
    _until("both ranks up", lambda: len(list(Path(env["OUT"]).glob("up-*"))) == 2)
    ranks = run.workers()
    assert len(ranks) == 2 and not any(catches(p, signal.SIGUSR1) for p in ranks)
    os.kill(run.pid, signal.SIGTERM)
    assert _end(run, 20) == 1
    _until("the ranks' end", lambda: not any(_alive(p) for p in ranks), 10)


def test_the_next_zygote_waits_to_import_unless_it_is_handed_over(
        env: dict[str, str], tmp_path: Path) -> None:
    """After a handover the step's ranks start on this node: their replacement's import waits
    (RESPAWN_DELAY_S) rather than take the cores they start on; handed over, it imports at
    once."""
    marks = tmp_path / "marks"
    marks.mkdir()
    (tmp_path / "marker.py").write_text(
        f"import os\nopen(os.path.join({str(marks)!r}, str(os.getpid())), 'w').close()\n")
    proc = subprocess.Popen([sys.executable, "-m", "bluevela.launch.warm", "serve"],
                            env={**os.environ, **env, warm.PREIMPORT_ENV: "marker",
                                 "PYTHONPATH": str(tmp_path), "SLURMD_NODENAME": NODE})
    try:
        _until("the first zygote's import", lambda: list(marks.iterdir()))
        first = _warm_run(env)
        assert _end(first) == 0
        _until("its replacement", lambda: set(children(proc.pid)) - {first.pid})
        time.sleep(1.0)  # what must NOT happen within the delay: nothing to poll for
        assert [p.name for p in marks.iterdir()] == [str(first.pid)]
        second = _warm_run(env)
        assert second.how == "warming" and _end(second) == 0
        assert sorted(p.name for p in marks.iterdir()) == sorted([str(first.pid),
                                                                  str(second.pid)])
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_a_spares_first_zygote_waits_to_import_unless_it_is_handed_over(
        env: dict[str, str], tmp_path: Path) -> None:
    """Outside the first step (BV_WARM_LATER: the spares) the import waits: on a shared
    machine it would take the cores the first step starts on."""
    marks = tmp_path / "marks"
    marks.mkdir()
    (tmp_path / "marker.py").write_text(
        f"import os\nopen(os.path.join({str(marks)!r}, str(os.getpid())), 'w').close()\n")
    proc = subprocess.Popen([sys.executable, "-m", "bluevela.launch.warm", "serve"],
                            env={**os.environ, **env, warm.PREIMPORT_ENV: "marker",
                                 warm.LATER_ENV: f"n9,{NODE}", "PYTHONPATH": str(tmp_path),
                                 "SLURMD_NODENAME": NODE})
    try:
        _until("a zygote", lambda: children(proc.pid))
        time.sleep(1.0)  # what must NOT happen within the delay: nothing to poll for
        assert not list(marks.iterdir())
        run = _warm_run(env)
        assert run.how == "warming" and _end(run) == 0
        assert [p.name for p in marks.iterdir()] == [str(run.pid)]
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_the_successor_of_a_zygote_handed_over_while_importing_waits_for_that_import(
        env: dict[str, str], tmp_path: Path) -> None:
    """Two imports at once on a node would slow the step just started (its ranks wait for the
    first): the next zygote is started once the handed one has imported."""
    marks = tmp_path / "marks"
    marks.mkdir()
    (tmp_path / "slowmark.py").write_text(
        "import os, time\ntime.sleep(2)\n"
        f"open(os.path.join({str(marks)!r}, str(os.getpid())), 'w').close()\n")
    proc = subprocess.Popen([sys.executable, "-m", "bluevela.launch.warm", "serve"],
                            env={**os.environ, **env, warm.PREIMPORT_ENV: "slowmark",
                                 "PYTHONPATH": str(tmp_path), "SLURMD_NODENAME": NODE})
    try:
        _until("the server's socket", lambda: os.path.exists(warm.socket_path(env, NODE)))
        run = _warm_run(env)
        assert run.how == "warming"
        deadline = time.monotonic() + 30
        while not list(marks.iterdir()):  # importing: no successor yet
            assert [p for p in children(proc.pid) if _alive(p)] == [run.pid]
            assert time.monotonic() < deadline
            time.sleep(0.05)
        _until("the successor", lambda: set(children(proc.pid)) - {run.pid})
        assert _end(run) == 0
    finally:
        proc.terminate()
        proc.wait(timeout=10)
