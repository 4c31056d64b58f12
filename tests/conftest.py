"""Shared fixtures. The `devcluster` fixture brings up the REAL local Slurm cluster
(`slurm/devcluster up`) once per session and points Slurm clients and bv at it.

`BV_DEVCLUSTER_ID` picks the instance (default 0), so parallel developers can run their own.
When the cluster was already up before the session, it is left up at the end; otherwise the
session brings it down (CI's `.ci/run` also brings it down).
"""

from __future__ import annotations

import os
import shlex
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from bluevela.site import NodeClass, Site, load_site

REPO = Path(__file__).resolve().parent.parent
DEVCLUSTER = REPO / "slurm" / "devcluster"
DATA = Path(__file__).resolve().parent / "data"

def _worker_cluster() -> None:
    """Under pytest-xdist (tests/run runs two workers), worker gwN gets its own dev cluster:
    instance BV_DEVCLUSTER_ID + N. The suite waits on Slurm and jobs far more than it computes,
    so two clusters side by side halve its time on two cores. Set before any test reads it; the
    workers' subprocesses (devcluster, bv, sbatch) inherit it."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if worker.startswith("gw") and worker[2:].isdigit():
        base = os.environ.get("BV_DEVCLUSTER_BASE") or os.environ.get("BV_DEVCLUSTER_ID") or "0"
        os.environ["BV_DEVCLUSTER_BASE"] = base
        os.environ["BV_DEVCLUSTER_ID"] = str((int(base) + int(worker[2:])) % 10)


_worker_cluster()


def _slurm_release() -> None:
    """`BV_SLURM=24.11` (tests/run passes it on): the dev cluster runs that built release
    (slurm/devcluster reads the same variable) and the Slurm commands the tests and bv run in
    this process come from its prefix, first on PATH: a distribution's client may not speak a
    newer controller's protocol. Unset or "distro": the distribution's Slurm."""
    release = os.environ.get("BV_SLURM", "").strip()
    if release in ("", "distro"):
        return
    prefix = Path(os.environ.get("BV_SLURM_ROOT") or "/opt/bluevela-ci") / f"slurm-{release}"
    dirs = [str(prefix / "bin"), str(prefix / "sbin")]
    rest = [d for d in os.environ.get("PATH", "").split(":") if d and d not in dirs]
    os.environ["PATH"] = ":".join([*dirs, *rest])


_slurm_release()

# Hostile values: quotes, ;, $(), backticks, newlines, spaces (submitit's weird_tmp_path idea).
HOSTILE = [
    "it's",
    'say "hi"',
    "a;touch /tmp/bv-pwned-semicolon",
    "$(touch /tmp/bv-pwned-subst)",
    "`touch /tmp/bv-pwned-backtick`",
    "sp ace and\ttab",
    "glob*?[x]",
    "#not-a-comment",
    "back\\slash",
]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """GPU-marked tests are skipped, with the reason, where no NVIDIA GPU is present."""
    if _has_gpu():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (none present: no /dev/nvidiactl)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _has_gpu() -> bool:
    return os.path.exists("/dev/nvidiactl")



def build_standin_nvml(directory: Path, source: str, *flags: str) -> Path:
    """A stand-in `libnvidia-ml.so.1` compiled from C `source` into `directory` (a test puts it
    first on LD_LIBRARY_PATH, where the real one is found through ld.so.cache). Skips the test
    when this machine has no C compiler."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build a stand-in libnvidia-ml.so.1")
    (directory / "standin.c").write_text(source)
    subprocess.run([cc, "-shared", "-fPIC", *flags, "-o", str(directory / "libnvidia-ml.so.1"),
                    str(directory / "standin.c")], check=True, capture_output=True, timeout=60)
    return directory


def unix_dgram_listener(path: Path, timeout_s: float) -> socket.socket:
    """A datagram socket bound at `path` (what systemd's NOTIFY_SOCKET is), reads bounded by
    `timeout_s`."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(timeout_s)
    return sock


@pytest.fixture()
def beat_rank() -> int:
    """The RANK `supervisor_socket` gives this process (a module may define its own)."""
    return 0


@pytest.fixture()
def supervisor_socket(monkeypatch: pytest.MonkeyPatch,
                      beat_rank: int) -> Iterator[tuple[socket.socket, bytes]]:
    """A real UDP socket standing in for the supervisor's beat socket, and the beat key: the
    job's environment (BV_HEARTBEAT, BV_JOB_SECRET, RANK = `beat_rank`) points this
    process's heartbeat sender at it, and the sender is a fresh one."""
    from bluevela.protocol.keys import beat_key, new_secret
    from bluevela.runtime import heartbeat

    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    sock.settimeout(5)
    secret = new_secret()
    monkeypatch.setenv("BV_HEARTBEAT", f"127.0.0.1:{sock.getsockname()[1]}")
    monkeypatch.setenv("BV_JOB_SECRET", secret)
    monkeypatch.setenv("RANK", str(beat_rank))
    monkeypatch.setattr(heartbeat, "_SENDER", heartbeat._Sender())
    yield sock, beat_key(bytes.fromhex(secret))
    sock.close()


@pytest.fixture(scope="module")
def site() -> Site:
    """The repository's site.yaml (a module may define its own `site` instead)."""
    return load_site(REPO / "site.yaml")


@pytest.fixture(scope="module")
def h100(site: Site) -> NodeClass:
    """Its h100 node class."""
    return site.node_class(name="h100")


@pytest.fixture()
def dirs(tmp_path: Path) -> tuple[Path, Path]:
    """An empty spool and archive directory."""
    spool, archive = tmp_path / "spool", tmp_path / "archive"
    spool.mkdir()
    archive.mkdir()
    return spool, archive


@dataclass
class DevCluster:
    state_dir: Path
    env: dict[str, str]
    nodes: list[str] = field(default_factory=list)

    def environ(self, **extra: str) -> dict[str, str]:
        return {**os.environ, **self.env, **extra}

    def run(self, argv: list[str], *, check: bool = True, timeout: float = 300,
            cwd: Path | None = None, **kw: object) -> subprocess.CompletedProcess[str]:
        """Run a command with the cluster's environment."""
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                              env=self.environ(), cwd=cwd, check=False, **kw)  # type: ignore[call-overload]
        if check and proc.returncode != 0:
            raise AssertionError(f"{argv} exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
        return proc

    def bv(self, *args: str, check: bool = True, timeout: float = 300,
           cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
        return self.run([sys.executable, "-m", "bluevela", *args], check=check, timeout=timeout, cwd=cwd)

    def node_dir(self, node: str) -> Path:
        return self.state_dir / "nodes" / node

    def hook_env(self, node: str) -> Path:
        return self.node_dir(node) / "etc-bluevela" / "hook.env"

    def set_hook_env(self, node: str, **values: str) -> None:
        """Merge KEY=VALUE settings into a node's hook.env (what its prolog/epilog read)."""
        path = self.hook_env(node)
        current: dict[str, str] = {}
        for line in path.read_text().splitlines():
            if "=" in line and not line.lstrip().startswith("#"):
                k, _, v = line.partition("=")
                current[k.strip()] = v
        for k, v in values.items():
            if v == "":
                current.pop(k, None)
            else:
                current[k] = v
        path.write_text("".join(f"{k}={v}\n" for k, v in current.items()))

    def wait_idle(self, nodes: list[str] | None = None, timeout: float = 60) -> None:
        """Wait until the nodes have no jobs (idle or idle+drain)."""
        deadline = time.monotonic() + timeout
        want = nodes or self.nodes
        while time.monotonic() < deadline:
            out = self.run(["sinfo", "-h", "-N", "-o", "%N %T"]).stdout
            states = dict(line.split() for line in out.splitlines() if line.strip())
            if all(states.get(n, "").rstrip("*") in ("idle", "drained") for n in want):
                return
            time.sleep(0.5)
        raise AssertionError(f"nodes not idle after {timeout}s: {out}")

    def wait_in_service(self, nodes: list[str] | None = None, timeout: float = 90) -> None:
        """Wait until the nodes are plainly idle: responding (no `*`), not drained, not down,
        not reserved. `wait_idle` takes idle* (a revived node whose slurmd Slurm has not heard
        from yet) and drained; a job submitted then lands elsewhere than the test expects."""
        deadline = time.monotonic() + timeout
        want = nodes or self.nodes
        while True:
            out = self.run(["sinfo", "-h", "-N", "-o", "%N %T"]).stdout
            states = dict(line.split() for line in out.splitlines() if line.strip())
            if all(states.get(n) == "idle" for n in want):
                return
            if time.monotonic() >= deadline:
                raise AssertionError(f"nodes not in service after {timeout}s: {out}")
            time.sleep(0.5)

    def resume_all(self) -> None:
        """Resume every node and free the fleet breaker's slots (bluevela.fleet.nodestate): a slot
        left by a test would hold the next test's drains."""
        for n in self.nodes:
            self.run(["scontrol", "update", f"NodeName={n}", "State=RESUME"], check=False)
        out = self.run(["scontrol", "show", "reservation", "-o"], check=False).stdout
        for line in out.splitlines():
            name = line.split()[0].partition("=")[2] if line.startswith("ReservationName=") else ""
            if name.startswith("bv-drain-"):
                self.run(["scontrol", "delete", f"ReservationName={name}"], check=False)

    @contextmanager
    def clean(self, *, settle: bool = False, bv_resume: Sequence[str] = ()) -> Iterator[None]:
        """The cluster idle with every node resumed before; every node's hook.env as it was,
        and every node resumed, after. With `settle`, after: first wait until the nodes are
        idle again, then `bv health resume` each of `bv_resume` (bv's own resume: it also
        frees its fleet-breaker slot)."""
        saved = {n: self.hook_env(n).read_text() for n in self.nodes}
        self.wait_idle(timeout=120)
        self.resume_all()
        self.wait_in_service()
        try:
            yield
        finally:
            for n, text in saved.items():
                self.hook_env(n).write_text(text)
            try:
                if settle:
                    self.wait_idle(timeout=120)
            finally:
                for node in bv_resume:
                    self.bv("health", "resume", node, check=False)
                self.resume_all()


@contextmanager
def small_tmpfs(mnt: Path, options: str = "size=64k") -> Iterator[Path]:
    """A small tmpfs (64 KiB) mounted at `mnt` (made here) for a full-disk test, unmounted
    after; the test is skipped where this is not root (or there is no mount)."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a small tmpfs needs root")
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def _parse_env(text: str) -> dict[str, str]:
    env: dict[str, str] = {}
    for line in text.splitlines():
        words = shlex.split(line)
        if len(words) == 2 and words[0] == "export" and "=" in words[1]:
            k, _, v = words[1].partition("=")
            env[k] = v
    return env


@pytest.fixture(scope="session")
def devcluster() -> Iterator[DevCluster]:
    """The real local Slurm cluster (3 nodes), up for the whole session."""
    if os.geteuid() != 0:
        pytest.skip("the dev cluster needs root (namespaces, slurmd as root)")
    status = subprocess.run([sys.executable, str(DEVCLUSTER), "status"], capture_output=True,
                            text=True, check=False)
    was_up = status.returncode == 0
    up = subprocess.run([sys.executable, str(DEVCLUSTER), "up", "--nodes", "3"],
                        capture_output=True, text=True, timeout=600, check=False,
                        env={**os.environ, "BV_PYTHON": sys.executable})
    if up.returncode != 0:
        raise RuntimeError(f"devcluster up failed:\n{up.stdout}\n{up.stderr}")
    env_out = subprocess.run([sys.executable, str(DEVCLUSTER), "env"], capture_output=True,
                             text=True, check=True).stdout
    env = _parse_env(env_out)
    cluster = DevCluster(state_dir=Path(env["BV_DEVCLUSTER_DIR"]), env=env,
                         nodes=["node1", "node2", "node3"])
    # The suite starts on an empty queue: slurmctld recovers an earlier session's jobs from its
    # state dir, and one still pending started on node[1-2] as they came back (a test's job
    # then landed elsewhere than it expects).
    left = cluster.run(["squeue", "-h", "-o", "%i"], check=False).stdout.split()
    if left:
        cluster.run(["scancel", *left], check=False)
        cluster.wait_idle(timeout=120)
    yield cluster
    if not was_up:
        subprocess.run([sys.executable, str(DEVCLUSTER), "down"], capture_output=True,
                       text=True, timeout=120, check=False)


@pytest.fixture
def jobs() -> Iterator[list[Any]]:
    """Real supervisors a test starts on stand-ins (tests/supervisor_standins.py `Job`s):
    append each one; every one still running is killed at the end."""
    started: list[Any] = []
    yield started
    for job in started:
        job.kill()


def standin_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str,
                    script: str) -> Path:
    """Put a stand-in `name` (a shell `script`) first on PATH; return the log it appends its
    calls to (`$BV_TEST_LOG`)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    exe = bin_dir / name
    exe.write_text(script)
    exe.chmod(0o755)
    log = tmp_path / "calls.log"
    log.touch()
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("BV_TEST_LOG", str(log))
    return log


@pytest.fixture
def io() -> Iterator[tuple[Any, Any]]:
    """A step's signal pipe and one node's listening endpoints (bluevela.launch.step's
    Signals and Endpoints), closed after the test: the Step tests driven by
    tests/step_script.py take them."""
    from bluevela.launch.step import Endpoints, Signals

    signals = Signals()
    ends = Endpoints(["n1"], "localhost", signals)
    try:
        yield signals, ends
    finally:
        ends.close()
        signals.close()
