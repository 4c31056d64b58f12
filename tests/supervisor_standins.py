"""Stand-ins for srun, torchrun and scontrol, and a harness that runs the REAL in-job
supervisor (`python3 -P -m bluevela.launch.supervisor`) on them, without Slurm.

- srun: starts the command it is given once per node of ``--nodelist`` (SLURMD_NODENAME set),
  locally, and records the supervisor's addresses (what any user reads in /proc/net/{tcp,udp}).
- torchrun: records the rendezvous options it would use (``rdzv-id.<node>``,
  ``rdzv-endpoint.<node>``, ...: a flag, else ``PET_<OPTION>``), starts one worker with LOCAL_RANK (as torchrun does), exits with
  the worker's status. The worker calls `bluevela.runtime.progress()` every 0.2 s (mode
  ``steps``) or once (mode ``stall``: a real hang), writes ``ready.<node>`` once running,
  ``finished.<node>`` when the file ``done`` appears, ``usr1.<node>`` on SIGUSR1.
- scontrol: records its argv in ``scontrol.log``; hangs or refuses as ``BV_TEST_SCONTROL``
  says (``hang``, ``refuse``, ``refuse:N``).
- squeue: records its argv in ``squeue.log``; answers ``-o %L|%l`` (the time left at the
  checkpoint signal) with ``BV_TEST_SQUEUE`` when set, else as for a job it does not know.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from tests.conftest import REPO

SRUN = """
import os, subprocess, sys
args = sys.argv[1:]
nodes, i = [], 0
while i < len(args) and args[i].startswith("--"):
    if args[i].startswith("--nodelist="):
        nodes = args[i].split("=", 1)[1].split(",")
    i += 1
out = os.environ["BV_TEST_DIR"]
with open(os.path.join(out, "addr"), "a") as fh:
    fh.write(os.environ["BV_SUPERVISOR"] + " " + os.environ["BV_HEARTBEAT"] + "\\n")
with open(os.path.join(out, "srun.argv"), "a") as fh:
    fh.write("\\0".join(sys.argv) + "\\n")
with open(os.path.join(out, "secret"), "a") as fh:
    fh.write(os.environ.get("BV_JOB_SECRET", "") + "\\n")
procs = [subprocess.Popen(args[i:], env={**os.environ, "SLURMD_NODENAME": n,
                                          "SLURM_PROCID": str(k)})
         for k, n in enumerate(nodes)]
sys.exit(max([p.wait() for p in procs] or [0]))
"""

TORCHRUN = """
import os, subprocess, sys
out, node = os.environ["BV_TEST_DIR"], os.environ.get("SLURMD_NODENAME", "?")
# What the real torchrun would use: a command-line flag, else PET_<OPTION> (its env action).
def option(name):
    flag = [a.split("=", 1)[1] for a in sys.argv if a.startswith("--" + name + "=")]
    return flag[-1] if flag else os.environ.get("PET_" + name.upper().replace("-", "_"), "")
for name in ("rdzv-endpoint", "rdzv-id", "rdzv-backend", "nnodes"):
    with open(os.path.join(out, name + "." + node), "w") as fh:
        fh.write(option(name))
env = {**os.environ, "LOCAL_RANK": "0", "RANK": os.environ.get("SLURM_PROCID", "0")}
worker = subprocess.Popen([sys.executable, "-P", "-c", os.environ["BV_TEST_WORKER"]], env=env)
sys.exit(worker.wait())
"""

WORKER = """
import os, signal, sys, time
from bluevela.runtime import progress
out, node = os.environ["BV_TEST_DIR"], os.environ.get("SLURMD_NODENAME", "?")
def on_usr1(*_):
    open(os.path.join(out, "usr1." + node), "w").close()
    sys.exit(0)
signal.signal(signal.SIGUSR1, on_usr1)
progress(0)
open(os.path.join(out, "ready." + node), "w").close()
step = 0
while not os.path.exists(os.path.join(out, "done")):
    time.sleep(0.2)
    if os.environ.get("BV_TEST_MODE") != "stall":
        step += 1
        progress(step)
open(os.path.join(out, "finished." + node), "w").close()
"""

SCONTROL = """
import os, sys, time
log = os.path.join(os.environ["BV_TEST_DIR"], "scontrol.log")
with open(log, "a") as fh:
    fh.write(" ".join(sys.argv[1:]) + "\\n")
# BV_TEST_SCONTROL: "hang" (a slurmctld that never answers), "refuse" (one that is down, as
# scontrol says it), "refuse:N" (down for the first N calls, then up).
mode, _, count = os.environ.get("BV_TEST_SCONTROL", "").partition(":")
with open(log) as fh:
    calls = len(fh.read().splitlines())
if mode == "hang":
    time.sleep(3600)
if mode == "refuse" and (not count or calls <= int(count)):
    sys.stderr.write("scontrol: error: Unable to contact slurm controller (connect failure)\\n")
    sys.exit(1)
"""

SQUEUE = """
import os, sys
with open(os.path.join(os.environ["BV_TEST_DIR"], "squeue.log"), "a") as fh:
    fh.write(" ".join(sys.argv[1:]) + "\\n")
if "%L|%l" in sys.argv and os.environ.get("BV_TEST_SQUEUE"):
    print(os.environ["BV_TEST_SQUEUE"])
    sys.exit(0)
sys.stderr.write("slurm_load_jobs error: Invalid job id specified\\n")
sys.exit(1)
"""


class AgentLine:
    """The supervisor's side of one REAL node agent's channel, for a test that plays the
    supervisor: listen (`BV_SUPERVISOR` = `address`, the job secret `secret`), then `accept`
    the agent, challenge it and read its messages in order (`next`, `until`), `send` back."""

    def __init__(self, timeout_s: float = 20.0) -> None:
        from bluevela.protocol.keys import new_secret

        self.secret = new_secret()
        self.listen = socket.socket()
        self.listen.bind(("127.0.0.1", 0))
        self.listen.listen(1)
        self.listen.settimeout(timeout_s)
        self.address = f"127.0.0.1:{self.listen.getsockname()[1]}"
        self._queue: list[dict[str, object]] = []

    def accept(self, timeout_s: float = 30.0) -> None:
        from bluevela.protocol.channel import Channel, challenge_line
        from bluevela.protocol.keys import derive

        self.sock, _ = self.listen.accept()
        self.sock.settimeout(timeout_s)
        nonce = os.urandom(16)
        self.sock.sendall(challenge_line(nonce))
        self.chan = Channel(self.sock, derive(bytes.fromhex(self.secret), b"line"), nonce, b"s")

    def next(self) -> dict[str, object]:
        while not self._queue:
            data = self.sock.recv(65536)
            assert data, "the agent closed its channel"
            self._queue.extend(self.chan.feed(data))
        return self._queue.pop(0)

    def until(self, kind: str) -> dict[str, object]:
        """Read past everything up to the first message of type `kind`; that message."""
        while (msg := self.next())["t"] != kind:
            pass
        return msg

    def send(self, msg: dict[str, object]) -> None:
        self.chan.send(msg)

    def close(self) -> None:
        self.listen.close()


def _script(path: Path, body: str) -> Path:
    path.write_text(f"#!{sys.executable} -P\n{body}")
    path.chmod(0o755)
    return path


class Job:
    """The real supervisor on stand-ins in `tmp` (bin/, work/, out files in tmp itself)."""

    def __init__(self, tmp: Path, nodes: Sequence[str] = ("n1",), mode: str = "steps",
                 options: Sequence[str] = (), argv: Sequence[str] | None = None,
                 cwd: Path | None = None, extra_env: dict[str, str] | None = None) -> None:
        self.dir = tmp
        self.nodes = list(nodes)
        self.bin = tmp / "bin"
        self.bin.mkdir(exist_ok=True)
        for name, body in (("srun", SRUN), ("torchrun", TORCHRUN), ("scontrol", SCONTROL),
                           ("squeue", SQUEUE)):
            _script(self.bin / name, body)
        self.cwd = cwd or tmp / "work"
        self.cwd.mkdir(exist_ok=True)
        self.argv = list(argv) if argv is not None else [
            sys.executable, "-P", "-m", "bluevela.launch.supervisor", f"--nodes={len(nodes)}",
            *options, "--", str(self.bin / "torchrun"), "--nproc-per-node=1", "train.py"]
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("SLURM", "BV_")) and k != "LOCAL_RANK"}
        self.env = {**env, "PATH": f"{self.bin}:{os.environ['PATH']}", "SLURM_JOB_ID": "77",
                    "SLURM_JOB_NODELIST": ",".join(nodes), "BV_TEST_DIR": str(tmp),
                    "BV_TEST_MODE": mode, "BV_TEST_WORKER": WORKER,
                    "PYTHONPATH": str(REPO),
                    # the stand-in torchrun is not torch's: what a site's wrapper needs too
                    "BV_RDZV_GUARD": "optional", **(extra_env or {})}
        self.out = open(tmp / "out.txt", "wb")  # noqa: SIM115 - closed in wait()/kill()
        self.err = open(tmp / "err.txt", "wb")  # noqa: SIM115
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Job:
        self.proc = subprocess.Popen(self.argv, env=self.env, cwd=self.cwd, stdout=self.out,
                                     stderr=self.err, stdin=subprocess.DEVNULL,
                                     start_new_session=True)
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def wait_for(self, name: str, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while not (self.dir / name).exists():
            assert self.proc is not None
            assert self.proc.poll() is None, f"supervisor exited {self.proc.returncode} before " \
                f"{name}: {self.stderr()}"
            assert time.monotonic() < deadline, f"no {name} in {timeout} s: {self.stderr()}"
            time.sleep(0.05)

    def wait_ready(self, timeout: float = 60.0) -> None:
        for node in self.nodes:
            self.wait_for(f"ready.{node}", timeout)

    def addrs(self) -> tuple[tuple[str, int], tuple[str, int]]:
        """(TCP, UDP) of the supervisor, as any user of the node finds them."""
        last = (self.dir / "addr").read_text().splitlines()[-1].split()
        tcp, udp = (a.rpartition(":") for a in last)
        return ((socket.gethostbyname(tcp[0]), int(tcp[2])),
                (socket.gethostbyname(udp[0]), int(udp[2])))

    def finish(self) -> None:
        (self.dir / "done").touch()

    def wait(self, timeout: float = 60.0) -> int:
        assert self.proc is not None
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            self.out.close()
            self.err.close()

    def running(self) -> bool:
        assert self.proc is not None
        return self.proc.poll() is None

    def kill(self) -> None:
        # The torchruns sit in sessions of their own (the agent starts them so): a killed
        # supervisor's session leaves them behind, and their workers end on `done` only.
        self.finish()
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()
        self.out.close()
        self.err.close()

    def stdout(self) -> str:
        return (self.dir / "out.txt").read_bytes().decode("utf-8", "replace")

    def stderr(self) -> str:
        return (self.dir / "err.txt").read_bytes().decode("utf-8", "replace")

    def end_lines(self) -> list[str]:
        """The supervisor's `==== bv attempt N ended: ... ====` lines so far."""
        return [line for line in self.stdout().splitlines() if " ended: " in line]

    def wait_end(self, timeout: float) -> list[str]:
        """The end lines once there is one (the supervisor still running until then)."""
        deadline = time.monotonic() + timeout
        while not (ended := self.end_lines()):
            assert self.running(), self.stdout() + self.stderr()
            assert time.monotonic() < deadline, self.stdout() + self.stderr()
            time.sleep(0.1)
        return ended

    def scontrol(self) -> list[str]:
        path = self.dir / "scontrol.log"
        return path.read_text().splitlines() if path.exists() else []

    def rss_kb(self) -> int:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        return 0

    def cpu_s(self) -> float:
        fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
