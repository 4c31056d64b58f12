"""CPU time of every process on this machine, sampled: who used the cores during a window.

The dev cluster's nodes share this machine's cores, so a launch that gets slower with no
slower part of its own may be waiting on CPU that something beside it takes. `ProcSampler`
reads ``/proc/PID/stat`` (user + system ticks) of every process every `every_s` seconds in a
thread, and `cpu_by_role` gives the CPU seconds each kind of process (`role`: the supervisor,
a node agent, torchrun, a rank, srun, slurmstepd, ...) used between two monotonic times. The
sampling costs about 2-5 ms of CPU per sweep at a few hundred processes (the same on both
sides of a comparison). Linux only; a process that lives less than `every_s` may be missed.
"""

from __future__ import annotations

import bisect
import os
import threading
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")
RECHECK = 10  # sweeps in which a new process's command line is read again


def role(cmdline: str, comm: str) -> str:
    """The kind of process, from its command line (arguments joined by spaces)."""
    # the agent's and the supervisor's command lines carry the torchrun command: first
    if "launch.agent" in cmdline or ("launch.supervisor" in cmdline and " agent " in cmdline):
        return "agent"
    if "launch.supervisor" in cmdline:
        return "supervisor"
    if "rdzv_guard" in cmdline or "torchrun" in cmdline or "torch.distributed.run" in cmdline:
        return "torchrun"
    if "train_ddp" in cmdline or "multiprocessing" in cmdline:
        return "rank"
    if "bluevela.hooks" in cmdline or "prolog" in cmdline or "epilog" in cmdline:
        return "hooks"
    if comm in ("srun", "slurmstepd", "slurmd", "slurmctld", "munged", "sbatch", "scontrol",
                "squeue"):
        return comm
    if "benchmarks/" in cmdline:  # this measurement itself (run.py, ab_launch.py)
        return "benchmark"
    return "other"


def _at(samples: Sequence[tuple[float, float]], t: float, before: float) -> float:
    """The value of the last (time, value) sample at or before `t`; `before` when none is."""
    i = bisect.bisect_right(samples, t, key=lambda sample: sample[0])
    return samples[i - 1][1] if i else before


@dataclass
class Proc:
    pid: int
    start: int  # clock ticks after boot: with the pid, one process
    role: str
    cmd: str
    samples: list[tuple[float, int]] = field(default_factory=list)  # (monotonic, ticks)

    def ticks_at(self, t: float) -> int:
        """Ticks used by monotonic time `t` (the last sample at or before it; 0 before)."""
        return int(_at(self.samples, t, 0))


class ProcSampler:
    def __init__(self, every_s: float = 0.1) -> None:
        self.every_s = every_s
        self.procs: dict[tuple[int, int], Proc] = {}
        self.idle: list[tuple[float, float]] = []  # (monotonic, idle seconds of all cores)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Ends the sampling (again: nothing); read the figures only after this."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def __enter__(self) -> ProcSampler:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.sweep()
            self._stop.wait(self.every_s)

    def sweep(self) -> None:
        now = time.monotonic()
        try:
            with open("/proc/stat") as fh:
                cpu = fh.readline().split()
            self.idle.append((now, (int(cpu[4]) + int(cpu[5])) * TICK_S))
        except (OSError, IndexError, ValueError):
            pass
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                with open(f"/proc/{name}/stat", "rb") as fh:
                    stat = fh.read().decode(errors="replace")
            except OSError:
                continue
            comm = stat[stat.find("(") + 1:stat.rfind(")")]
            rest = stat[stat.rfind(")") + 2:].split()
            ticks, start = int(rest[11]) + int(rest[12]), int(rest[19])
            key = (int(name), start)
            proc = self.procs.get(key)
            if proc is None or len(proc.samples) < RECHECK:
                # a forked child execs within moments: its command line is read again
                try:
                    with open(f"/proc/{name}/cmdline", "rb") as fh:
                        cmd = fh.read().replace(b"\0", b" ").decode(errors="replace").strip()
                except OSError:
                    cmd = ""
                if proc is None:
                    proc = self.procs[key] = Proc(int(name), start, role(cmd, comm), cmd or comm)
                elif cmd and cmd != proc.cmd:
                    proc.cmd, proc.role = cmd, role(cmd, comm)
            proc.samples.append((now, ticks))

    def cpu_by_role(self, t0: float, t1: float) -> dict[str, float]:
        """CPU seconds each role used between monotonic times t0 and t1."""
        out: dict[str, float] = defaultdict(float)
        for proc in self.procs.values():
            used = proc.ticks_at(t1) - proc.ticks_at(t0)
            if used > 0:
                out[proc.role] += used * TICK_S
        return dict(out)

    def busy(self, t0: float, t1: float) -> float:
        """Seconds of all cores not idle between t0 and t1 (from /proc/stat)."""
        first = self.idle[0][1] if self.idle else 0.0
        idle = _at(self.idle, t1, first) - _at(self.idle, t0, first)
        return (os.cpu_count() or 1) * (t1 - t0) - idle
