"""The node-local checkpoint store (docs/checkpoints.md): the loop's stall per save against
`torch.save` to the shared directory and DCP `async_save`, the background phase, the resume
from the node, from the partner's copy and `torch.load` from shared storage, on the dev cluster
(2 nodes x 1 rank, `bv submit`, interleaved rounds: benchmarks/ckpt_job.py); and the staging
memory over 100 saves in this process.

    BV_DEVCLUSTER_ID=7 python benchmarks/run.py ckpt          # 64 MB
    BV_CKPT_BENCH_MB=64,256 BV_DEVCLUSTER_ID=7 python benchmarks/run.py ckpt

The shared directory is a directory of this machine's disk, or with `BV_CKPT_BENCH_FS=gluster`
a GlusterFS volume mounted on every node (slurm/devcluster-gfs); `BV_CKPT_BENCH_RATE=1gbit`
throttles every node's link (tc tbf: the file system's traffic and the partner copies).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from _common import REPO, Figure

DEVCLUSTER = REPO / "slurm" / "devcluster"
GFS = REPO / "slurm" / "devcluster-gfs"


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def staging_memory(mb: float = 64, saves: int = 100) -> Iterator[Figure]:
    import torch

    from bluevela.ckpt.collective import Single
    from bluevela.ckpt.store import CheckpointStore, StoreConfig

    base = Path(tempfile.mkdtemp(prefix="bv-ckpt-bench-", dir="/dev/shm"))
    try:
        state = {"w": torch.randn(int(mb * 1e6 / 4))}
        store = CheckpointStore(StoreConfig(shared_dir=None, local_dir=base, name="mem",
                                            job="bench", keep=1), Single(), key=b"k" * 32)
        size = state["w"].numel() * 4
        before = _rss()
        peak = before
        stalls = []
        for i in range(saves):
            state["w"].add_(1.0)
            stalls.append(store.save(i, state).stall_s)
            peak = max(peak, _rss())
        store.close()
        peak = max(peak, _rss())
        extra = (peak - before) / size
        yield Figure(f"ckpt staging memory over {saves} saves", extra, "x state",
                     "<= 1.05", f"{mb:g} MB state, peak RSS growth / state size")
        stalls.sort()
        yield Figure(f"ckpt stall {mb:g} MB in-process (median)", stalls[len(stalls) // 2],
                     "s", "", "node-local tier on /dev/shm, no partner")
    finally:
        import shutil

        shutil.rmtree(base, ignore_errors=True)


def _env() -> dict[str, str]:
    out = subprocess.run([sys.executable, str(DEVCLUSTER), "env"], capture_output=True,
                         text=True, check=True).stdout
    env = dict(os.environ)
    for line in out.splitlines():
        m = re.match(r"^export (\w+)=(.*)$", line)
        if m:
            env[m.group(1)] = m.group(2).strip("'\"")
    return env


def cluster(mb: float, rounds: int) -> Iterator[Figure]:
    subprocess.run([sys.executable, str(DEVCLUSTER), "up", "--nodes", "3"], check=True,
                   capture_output=True, timeout=600)
    env = _env()
    work = Path(tempfile.mkdtemp(prefix="bv-ckpt-bench-"))
    shared = work / "shared"
    fs = os.environ.get("BV_CKPT_BENCH_FS", "local")
    rate = os.environ.get("BV_CKPT_BENCH_RATE", "")
    if fs == "gluster":
        up = subprocess.run([sys.executable, str(GFS), "up"], check=True, capture_output=True,
                            text=True, timeout=900)
        shared = Path(up.stdout.strip().splitlines()[-1]) / work.name
    throttled = []
    if rate:
        for node in ("node1", "node2", "node3"):
            subprocess.run([sys.executable, str(DEVCLUSTER), "throttle", node, rate],
                           check=True, capture_output=True, timeout=60)
            throttled.append(node)
    t0 = time.monotonic()
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "bluevela", "submit", "--wait", "-N", "2",
             "--procs-per-node", "1", "-t", "30", str(REPO / "benchmarks" / "ckpt_job.py"),
             "--shared", str(shared), "--local-base", str(work / "local"), "--mb", f"{mb:g}",
             "--rounds", str(rounds)], cwd=work, env=env, capture_output=True, text=True,
            timeout=1800, check=False)
    finally:
        for node in throttled:
            subprocess.run([sys.executable, str(DEVCLUSTER), "throttle", node, "off"],
                           check=False, capture_output=True, timeout=60)
    text = "".join(p.read_text(errors="replace") for p in sorted(work.glob("bv-*.out")))
    if proc.returncode != 0:
        raise RuntimeError(f"benchmark job failed ({proc.returncode}):\n{proc.stdout}\n{text}")
    figs: dict[str, float] = {}
    for m in re.finditer(r"^FIG (\S+) (\S+) (\S+) (\S+)$", text, re.M):
        figs[m.group(2)] = float(m.group(3))
    note = re.search(r"^FIGNOTE \S+ (.*)$", text, re.M)
    tag = f"{mb:g} MB {fs}{' ' + rate if rate else ''}"
    a, b, c = figs["stall_torch"], figs["stall_dcp"], figs["stall_store"]
    yield Figure(f"ckpt {tag} stall torch.save (a)", a, "s", "", f"{rounds} rounds, median")
    yield Figure(f"ckpt {tag} stall DCP async_save (b)", b, "s", "", "")
    yield Figure(f"ckpt {tag} stall store", c, "s", f"<= {min(0.05 * a, b):.4g}",
                 "goal: <= 5 % of (a) and <= (b)")
    yield Figure(f"ckpt {tag} stall store / (a)", c / a, "ratio", "<= 0.05", "")
    yield Figure(f"ckpt {tag} background DCP", figs["background_dcp"], "s", "", "")
    yield Figure(f"ckpt {tag} background store", figs["background_store"], "s", "",
                 "node-local write + partner copy")
    yield Figure(f"ckpt {tag} resume node-local", figs["resume_local"], "s", "", "")
    yield Figure(f"ckpt {tag} resume partner fetch", figs["resume_partner"], "s",
                 f"<= {figs['resume_torch_load']:.4g}", note.group(1) if note else "")
    yield Figure(f"ckpt {tag} resume torch.load shared", figs["resume_torch_load"], "s", "",
                 "")
    yield Figure(f"ckpt {tag} job wall", time.monotonic() - t0, "s", "", "")


def figures(args: Any) -> Iterator[Figure]:
    sizes = [float(x) for x in os.environ.get("BV_CKPT_BENCH_MB", "64").split(",") if x]
    rounds = 3 if getattr(args, "quick", False) else 5
    yield from staging_memory(saves=30 if getattr(args, "quick", False) else 100)
    for mb in sizes:
        yield from cluster(mb, rounds)
