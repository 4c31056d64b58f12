"""The relaunch's own phases, old checkout vs new, without Slurm (issue 23: the happy path).

    python benchmarks/ab_relaunch.py --old <checkout of 9058adc> [--new <checkout>] [--pairs 6]

One run is what an attempt's step does on its nodes once the supervisor said ``go``: two
torchrun agents on this machine (``--nnodes=2 --nproc-per-node=1``, c10d rendezvous on
127.0.0.1, the first one the store's host), each starting one rank, started as each side's node
agent starts them:

- old (9058adc): ``torchrun`` as found on PATH, the rendezvous id and endpoint as flags, the
  environment as it is (``PYTHONPATH`` the old checkout);
- ``--as-agent`` (issue 37): both sides exactly as their checkout's agent starts torchrun
  (``supervisor.torchrun_step_argv``: static or c10d; ``rdzv_guard.torchrun_start``; the
  go's node rank where static), so that two bv commits compare;
- new: the argv of the new checkout's ``rdzv_guard.guarded_argv`` (torchrun through the guard),
  the environment of its ``runtime.world.training_env`` (the start-up hook first on
  ``PYTHONPATH``, ``BV_INTEGRATIONS=1``) and the rendezvous in ``PET_RDZV_ID`` /
  ``PET_RDZV_ENDPOINT``, as the agent passes them.

The rank is a copy of examples/train_ddp.py's start (bluevela.runtime and its signal handler,
torch, the gloo group, the model in DDP, the first all_reduce, the resume line) that writes a
wall-clock time after each part; its process start comes from /proc (10 ms ticks). torchrun's
own INFO lines (``LOGLEVEL=INFO`` on both sides) are timestamped as they appear. Phases, from
the Popen of the first torchrun:

  rank exec (torchrun started, rendezvous done, the worker spawned) -> script start (the
  interpreter and site, the start-up hook on the new side) -> torch imported -> process group
  -> DDP + first all_reduce -> resume line; and CPU seconds: torchrun's own at its rank's exec
  (its start and the rendezvous), the rank's at each mark (steadier than wall time on a shared
  machine).

Pairs alternate the order (old first in even pairs). A measurement that prints, not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bluevela.bench.dist import free_port

REPO = Path(__file__).resolve().parent.parent

RANK = r'''
import os, sys, time
def mark(name):
    sys.stdout.write(f"bvphase {name} {time.time():.4f} {time.process_time():.4f}\n")
    sys.stdout.flush()
mark("script")
from bluevela import runtime
runtime.install_signal_handler()
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
mark("torch")
dist.init_process_group(backend="gloo")
mark("group")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))
ddp = DistributedDataParallel(model)
x = torch.randn(256, 16)
with torch.no_grad():
    loss = nn.functional.mse_loss(ddp(x), x[:, :1])
    dist.all_reduce(loss)
mark("ddp")
sys.stdout.write(f"rank={rank} attempt=2 resumed_from_step=0\n"); sys.stdout.flush()
mark("resumed")
dist.barrier()
dist.destroy_process_group()
'''

# What a checkout's own agent runs (the supervisor's step argv, the guard, the node's part in
# the rendezvous: is_host, and the go's node rank where the step is static): printed as JSON
# by a child importing that checkout (--as-agent: both sides; issue 37).
AGENT_SIDE = r'''
import json, os, sys
from bluevela.launch import agent
from bluevela.launch.rdzv_guard import torchrun_start
from bluevela.launch.supervisor import torchrun_step_argv
from bluevela.runtime.world import training_env
base, node, port = json.loads(sys.argv[1])
argv = torchrun_step_argv(base, ["n0", "n1"])
start = torchrun_start(argv, host=node == 0, env=os.environ)
static = getattr(agent, "STATIC_FLAG", None) in argv
where = (agent.endpoint_env("127.0.0.1", port, node) if static
         else agent.endpoint_env("127.0.0.1", port))
print(json.dumps({"argv": start.argv,
                  "env": {**training_env(os.environ, argv), **start.env, **where}}))
'''

# What the new checkout's agent would run: printed as JSON by a child importing that checkout.
NEW_SIDE = r'''
import json, os, sys
from bluevela.launch.rdzv_guard import guarded_argv
from bluevela.runtime.world import training_env
argv = json.loads(sys.argv[1])
print(json.dumps({"argv": guarded_argv(argv) or argv, "env": training_env(os.environ, argv)}))
'''

TORCH_LINES = {  # torchrun's INFO lines (torch 2.13) -> phase
    "Starting elastic_operator": "torchrun",
    "Rendezvous'ing worker group": "rdzv_start",
    "Rendezvous complete for workers": "rdzv_done",
    "Starting worker group": "workers_start",
}


def _boot_s() -> float:
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith("btime "):
            return float(line.split()[1])
    raise RuntimeError("no btime")


BTIME = _boot_s()
TICK = os.sysconf("SC_CLK_TCK")


def _start_time(pid: int) -> float | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return BTIME + int(stat.rsplit(")", 1)[1].split()[19]) / TICK


def _cpu(pid: int) -> float:
    """User + system CPU seconds of process `pid` itself (0 when it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICK


def _children(pid: int) -> list[int]:
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
        return [int(c) for t in tasks for c in (t / "children").read_text().split()]
    except OSError:
        return []


def _worker(pid: int, script: Path) -> int | None:
    """The descendant of `pid` running `script` (the rank), if started yet."""
    todo = _children(pid)
    while todo:
        c = todo.pop()
        try:
            if str(script).encode() in Path(f"/proc/{c}/cmdline").read_bytes():
                return c
        except OSError:
            continue
        todo.extend(_children(c))
    return None


def _clean_env(checkout: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("BV_", "PET_", "SLURM_"))}
    env["PYTHONPATH"] = str(checkout)
    env["LOGLEVEL"] = "INFO"
    env["OMP_NUM_THREADS"] = "1"
    return env


def commands(side: str, checkout: Path, script: Path, port: int, node: int,
             rdzv_id: str, as_agent: bool = False) -> tuple[list[str], dict[str, str]]:
    if as_agent:
        base = ["torchrun", "--nproc-per-node=1", "--max-restarts=0", str(script)]
        out = subprocess.run([sys.executable, "-P", "-c", AGENT_SIDE,
                              json.dumps([base, node, port])], env=_clean_env(checkout),
                             check=True, capture_output=True, text=True).stdout
        made = json.loads(out)
        return made["argv"], {**made["env"], "PET_RDZV_ID": rdzv_id}
    conf = f"--rdzv-conf=is_host={1 if node == 0 else 0}"
    base = ["torchrun", "--nnodes=2", "--rdzv-backend=c10d", conf, "--nproc-per-node=1",
            "--max-restarts=0", str(script)]
    env = _clean_env(checkout)
    if side == "old":
        return ([base[0], f"--rdzv-endpoint=127.0.0.1:{port}", base[1], base[2],
                 f"--rdzv-id={rdzv_id}", *base[3:]], env)
    out = subprocess.run([sys.executable, "-P", "-c", NEW_SIDE, json.dumps(base)], env=env,
                         check=True, capture_output=True, text=True).stdout
    made = json.loads(out)
    return made["argv"], {**made["env"], "PET_RDZV_ID": rdzv_id,
                          "PET_RDZV_ENDPOINT": f"127.0.0.1:{port}"}


def run_once(side: str, checkout: Path, script: Path, n: int,
             as_agent: bool = False) -> dict[str, float]:
    port = free_port()
    cmds = [commands(side, checkout, script, port, node, f"bench{n}", as_agent)
            for node in (0, 1)]
    marks: dict[str, float] = {}
    cpu: dict[str, float] = {}  # CPU seconds: torchrun's own at its rank's exec, the rank's
    lines: list[str] = []
    lock = threading.Lock()

    def note(name: str, t: float) -> None:
        with lock:
            marks.setdefault(name, t)

    def read(stream, node: int) -> None:  # type: ignore[no-untyped-def]
        for raw in iter(stream.readline, b""):
            t = time.time()
            line = raw.decode("utf-8", "replace")
            lines.append(f"[{node}] {line.rstrip()}")
            m = re.search(r"bvphase (\w+) ([\d.]+) ([\d.]+)", line)
            if m:
                note(f"{m.group(1)}.{node}", float(m.group(2)))
                cpu[f"cpu_{m.group(1)}.{node}"] = float(m.group(3))
                continue
            for key, phase in TORCH_LINES.items():
                if key in line:
                    note(f"{phase}.{node}", t)

    t0 = time.time()
    procs = []
    for node, (argv, env) in enumerate(cmds):
        p = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             start_new_session=True)
        procs.append(p)
        threading.Thread(target=read, args=(p.stdout, node), daemon=True).start()
    # The worker's exec: torchrun's child running the rank script.
    deadline = time.time() + 120
    while time.time() < deadline and any(f"exec.{i}" not in marks for i in (0, 1)):
        for i, p in enumerate(procs):
            if f"exec.{i}" in marks:
                continue
            c = _worker(p.pid, script)
            st = _start_time(c) if c is not None else None
            if st is not None:
                note(f"exec.{i}", st)
                cpu[f"cpu_exec.{i}"] = _cpu(p.pid)
        time.sleep(0.005)
    while time.time() < deadline and any(p.poll() is None for p in procs):
        if any(p.poll() for p in procs):  # one failed: the other would wait for it
            break
        time.sleep(0.05)
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    # A rank's teardown after its resume line is no part of the figure (gloo sometimes ends a
    # rank in SIGABRT at exit): only a run without both resume lines failed.
    if any(f"resumed.{i}" not in marks for i in (0, 1)):
        tail = "\n".join(lines[-30:])
        raise RuntimeError(f"{side}: torchrun exit {[p.returncode for p in procs]}\n{tail}")
    time.sleep(0.05)
    return {**{k: v - t0 for k, v in marks.items()}, **cpu}


PHASES = ["torchrun", "rdzv_start", "rdzv_done", "exec", "script", "torch", "group", "ddp",
          "resumed"]
CPU = ["cpu_exec", "cpu_script", "cpu_torch", "cpu_group", "cpu_resumed"]


def summary(runs: list[dict[str, float]]) -> dict[str, float]:
    """Per run: each phase's time as the later of the two nodes (the step waits for both),
    each CPU figure as the mean of the two."""
    out: dict[str, list[float]] = {}
    for r in runs:
        for ph in PHASES + CPU:
            vals = [r[f"{ph}.{i}"] for i in (0, 1) if f"{ph}.{i}" in r]
            if vals:
                out.setdefault(ph, []).append(max(vals) if ph in PHASES
                                              else statistics.mean(vals))
    return {ph: statistics.median(v) for ph, v in out.items()}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", type=Path, required=True)
    ap.add_argument("--new", type=Path, default=REPO)
    ap.add_argument("--pairs", type=int, default=6)
    ap.add_argument("--as-agent", action="store_true",
                    help="both sides as their checkout's node agent starts torchrun (the old "
                         "side too: its guard, its rendezvous backend)")
    args = ap.parse_args()
    if shutil.which("torchrun") is None:
        print("no torchrun on PATH", file=sys.stderr)
        return 1
    runs: dict[str, list[dict[str, float]]] = {"old": [], "new": []}
    ratios = []
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "rank.py"
        script.write_text(RANK)
        for pair in range(args.pairs):
            order = ["old", "new"] if pair % 2 == 0 else ["new", "old"]
            got = {}
            for side in order:
                checkout = args.old if side == "old" else args.new
                got[side] = run_once(side, checkout, script, pair * 2 + (side == "new"),
                                     args.as_agent)
                runs[side].append(got[side])
            r_old = max(got["old"][f"resumed.{i}"] for i in (0, 1))
            r_new = max(got["new"][f"resumed.{i}"] for i in (0, 1))
            ratios.append(r_new / r_old)
            print(f"pair {pair}: resumed old {r_old:.2f} s new {r_new:.2f} s "
                  f"new/old {r_new / r_old:.2f}", flush=True)
    so, sn = summary(runs["old"]), summary(runs["new"])
    print(f"\n{'phase (later node, from Popen)':<32} {'old':>7} {'new':>7} {'diff':>7}")
    prev_o = prev_n = 0.0
    for ph in PHASES:
        if ph in so and ph in sn:
            print(f"{ph:<32} {so[ph]:>7.3f} {sn[ph]:>7.3f} {sn[ph] - so[ph]:>+7.3f}   "
                  f"step {so[ph] - prev_o:>6.3f} {sn[ph] - prev_n:>6.3f}")
            prev_o, prev_n = so[ph], sn[ph]
    for ph in CPU:
        if ph in so and ph in sn:
            print(f"{ph:<32} {so[ph]:>7.3f} {sn[ph]:>7.3f} {sn[ph] - so[ph]:>+7.3f}   (CPU s)")
    print(f"\nresume line new/old: median {statistics.median(ratios):.2f} "
          f"range {min(ratios):.2f}-{max(ratios):.2f} ({len(ratios)} pairs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
