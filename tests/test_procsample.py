"""benchmarks/_procsample.py: CPU time by kind of process, for the launch A/B (issue 23)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

from _procsample import TICK_S, ProcSampler, role  # noqa: E402

TORCHRUN = "torchrun --nnodes=2 --nproc-per-node=1 /w/examples/train_ddp.py --steps 3"


def test_roles_of_the_launch_processes() -> None:
    """The agent's and the supervisor's command lines carry the torchrun command and the
    script: they must still count as themselves, not as torchrun or a rank."""
    py = "/usr/bin/python3 -P -m"
    assert role(f"{py} bluevela.launch.agent -- {TORCHRUN}", "python3") == "agent"
    assert role(f"{py} bluevela.launch.supervisor agent -- {TORCHRUN}", "python3") == "agent"
    assert role(f"{py} bluevela.launch.supervisor --nodes=2 -- {TORCHRUN}",
                "python3") == "supervisor"
    assert role(f"{py} bluevela.launch.rdzv_guard /venv/bin/{TORCHRUN}", "python3") == "torchrun"
    assert role(f"/venv/bin/python3 /venv/bin/{TORCHRUN}", "torchrun") == "torchrun"
    assert role("/usr/bin/python3 -u /w/examples/train_ddp.py --steps 3", "python3") == "rank"
    assert role("/usr/sbin/slurmstepd", "slurmstepd") == "slurmstepd"
    assert role("/usr/lib/something", "something") == "other"


def test_cpu_is_given_to_the_process_that_used_it() -> None:
    burn = ("import sys, time\nend = time.process_time() + 0.4\n"
            "while time.process_time() < end: pass\ntime.sleep(0.5)\n")
    # the argument makes it a "rank" (its command line names the training script)
    busy = subprocess.Popen([sys.executable, "-c", burn, "train_ddp"])
    idle = subprocess.Popen(["sleep", "1.5"])
    try:
        with ProcSampler(every_s=0.05) as sampler:
            t0 = time.monotonic()
            busy.wait(timeout=30)
            time.sleep(0.1)
            t1 = time.monotonic()
    finally:
        busy.kill()
        idle.kill()
    procs = {p.pid: p for p in sampler.procs.values() if p.pid in (busy.pid, idle.pid)}
    assert procs[busy.pid].role == "rank" and procs[idle.pid].role == "other"

    def used(pid: int, a: float, b: float) -> float:
        return (procs[pid].ticks_at(b) - procs[pid].ticks_at(a)) * TICK_S

    assert 0.3 <= used(busy.pid, t0, t1) <= 0.6
    assert used(idle.pid, t0, t1) < 0.05
    # by role: at least the busy child's share (other tests' ranks may run beside it)
    assert sampler.cpu_by_role(t0, t1).get("rank", 0.0) >= 0.3
    assert sampler.busy(t0, t1) >= 0.3
    # nothing is counted outside the window
    assert sampler.cpu_by_role(t1 + 1.0, t1 + 2.0) == {}
