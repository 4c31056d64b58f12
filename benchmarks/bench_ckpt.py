"""The node-local checkpoint store (docs/checkpoints.md): the loop's stall per save against
`torch.save` to the shared directory and DCP `async_save`, the background phase, the resume
from the node, from the partner's copy and `torch.load` from shared storage, on the dev cluster
(2 nodes x 1 rank, `bv submit`, interleaved rounds: benchmarks/ckpt_job.py); and the staging
memory over 100 saves in this process.

    BV_DEVCLUSTER_ID=7 python benchmarks/run.py ckpt          # 64 MB
    BV_CKPT_BENCH_MB=64,256 BV_DEVCLUSTER_ID=7 python benchmarks/run.py ckpt
    BV_CKPT_BENCH_CRASH=1 BV_CKPT_BENCH_PAIRS=2 BV_CKPT_BENCH_MB=64 ... ckpt   # crash -> step

`BV_CKPT_BENCH_WARM=1`: the crash jobs with the warm start (`--env BV_WARM_START=1`, both
sides), so that the relaunch (issue 37: ~0.5 s) does not hide the resume itself.

The shared directory is a directory of this machine's disk, or with `BV_CKPT_BENCH_FS=gluster`
a GlusterFS volume mounted on every node (slurm/devcluster-gfs); `BV_CKPT_BENCH_RATE=1gbit`
throttles every node's link (tc tbf: the file system's traffic and the partner copies), or with
`BV_CKPT_BENCH_THROTTLE=fs` the file system's traffic only, per node (the partner copies on an
unshaped "compute fabric", as on a site whose storage network is apart).
"""

from __future__ import annotations

import os
import re
import shutil
import statistics
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


def _shared_fs(work: Path) -> tuple[Path, list[list[str]], str, str]:
    """The shared directory (this machine's disk, or with BV_CKPT_BENCH_FS=gluster the dev
    cluster's GlusterFS), throttled to BV_CKPT_BENCH_RATE: with BV_CKPT_BENCH_THROTTLE=link
    (the default) every node's whole link, the partner copies too; with `fs` the file
    system's traffic only, per node (`devcluster-gfs throttle`: a storage network apart from
    the compute fabric). Returns the commands that lift it (the caller runs them), and the
    setting in words."""
    shared = work / "shared"
    fs = os.environ.get("BV_CKPT_BENCH_FS", "local")
    rate = os.environ.get("BV_CKPT_BENCH_RATE", "")
    how = os.environ.get("BV_CKPT_BENCH_THROTTLE", "link")
    if fs == "gluster":
        up = subprocess.run([sys.executable, str(GFS), "up"], check=True, capture_output=True,
                            text=True, timeout=900)
        shared = Path(up.stdout.strip().splitlines()[-1]) / work.name
    lift: list[list[str]] = []
    if rate and how == "fs":
        if fs != "gluster":
            raise RuntimeError("BV_CKPT_BENCH_THROTTLE=fs needs BV_CKPT_BENCH_FS=gluster")
        subprocess.run([sys.executable, str(GFS), "throttle", rate], check=True,
                       capture_output=True, timeout=60)
        lift.append([sys.executable, str(GFS), "throttle", "off"])
        rate = f"{rate} fs only"
    elif rate:
        for node in ("node1", "node2", "node3"):
            subprocess.run([sys.executable, str(DEVCLUSTER), "throttle", node, rate],
                           check=True, capture_output=True, timeout=60)
            lift.append([sys.executable, str(DEVCLUSTER), "throttle", node, "off"])
    return shared, lift, fs, rate


def _unthrottle(lift: list[list[str]]) -> None:
    for argv in lift:
        subprocess.run(argv, check=False, capture_output=True, timeout=60)


def cluster(mb: float, rounds: int) -> Iterator[Figure]:
    subprocess.run([sys.executable, str(DEVCLUSTER), "up", "--nodes", "3"], check=True,
                   capture_output=True, timeout=600)
    env = _env()
    work = Path(tempfile.mkdtemp(prefix="bv-ckpt-bench-"))
    shared, throttled, fs, rate = _shared_fs(work)
    t0 = time.monotonic()
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "bluevela", "submit", "--wait", "-N", "2",
             "--procs-per-node", "1", "-t", "30", str(REPO / "benchmarks" / "ckpt_job.py"),
             "--shared", str(shared), "--local-base", str(work / "local"), "--mb", f"{mb:g}",
             "--rounds", str(rounds)], cwd=work, env=env, capture_output=True, text=True,
            timeout=1800, check=False)
    finally:
        _unthrottle(throttled)
        for d in (work / "local", shared):  # the checkpoints; the output file stays
            shutil.rmtree(d, ignore_errors=True)
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


def _output(cwd: Path) -> str:
    return "".join(p.read_text(errors="replace") for p in sorted(cwd.glob("bv-*.out")))


def _wait(cwd: Path, proc: subprocess.Popen[str], pattern: str, timeout: float,
          after: int = 0) -> re.Match[str]:
    deadline = time.monotonic() + timeout
    while True:
        m = re.compile(pattern, re.M).search(_output(cwd), after)
        if m:
            return m
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"no {pattern!r} ({proc.poll()}):\n{_output(cwd)}")
        time.sleep(0.05)


def crash_one(mb: float, via: str, shared: Path, work: Path, env: dict[str, str]
              ) -> tuple[float, float, str]:
    """One job (benchmarks/ckpt_crash_job.py) on 2 nodes + a spare, its second node crashed
    once checkpoint step 4 is complete (for the store: once the partner holds its copy) and
    its node-local disk deleted: (crash -> the relaunched step's first step, every rank's
    resume, where rank 0 resumed from)."""
    cwd = work / f"crash-{via}-{mb:g}"
    cwd.mkdir()
    local = cwd / "local"
    proc = subprocess.Popen(
        [sys.executable, "-m", "bluevela", "submit", "--wait", "-N", "2", "--spare-nodes", "1",
         "--procs-per-node", "1", "-t", "30",
         *(["--env", "BV_WARM_START=1"] if os.environ.get("BV_CKPT_BENCH_WARM") else []),
         str(REPO / "benchmarks" / "ckpt_crash_job.py"),
         "--shared", str(shared / f"{via}-{mb:g}"), "--local-base", str(local), "--via", via,
         "--mb", f"{mb:g}", "--steps", "24"], cwd=cwd, env=env, text=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    crashed = ""
    try:
        banner = _wait(cwd, proc, r"^==== bv attempt 1 job \d+ nodes (\S+) ", 300)
        import hostlist

        keep, crashed = hostlist.expand_hostlist(banner.group(1))[:2]
        _wait(cwd, proc, r"^checkpoint step=4$", 900)
        if via == "store":  # the partner's copy of the crashed node's shard is complete
            deadline = time.monotonic() + 900
            while not list((local / keep).glob("bv-*/job-*/crash/held/step-00000004/*.bvck")):
                if time.monotonic() > deadline:
                    raise RuntimeError("no partner copy of step 4")
                time.sleep(0.05)
        t_crash = time.time()
        subprocess.run([sys.executable, str(DEVCLUSTER), "crash", crashed], check=True,
                       capture_output=True, timeout=120, env=env)
        shutil.rmtree(local / crashed, ignore_errors=True)
        at = _output(cwd).index("==== bv attempt 1 job")
        a2 = _wait(cwd, proc, r"^==== bv attempt 2 job", 600, at).start()
        first = _wait(cwd, proc, r"^step=\d+ attempt=\d+ t=(\S+)$", 1200, a2)
        resumed = _wait(cwd, proc, r"^resumed step=(\d+) via=\S+ in=(\S+) source=(\S+)$",
                        60, a2)
        proc.wait(timeout=1200)
    finally:
        if proc.poll() is None:
            proc.kill()
        if crashed:
            subprocess.run([sys.executable, str(DEVCLUSTER), "revive", crashed], check=False,
                           capture_output=True, timeout=120, env=env)
        # Each job's checkpoints go with it (6 x 2 GB per rank at 2 GB: a few jobs fill a
        # disk); its output file stays.
        shutil.rmtree(local, ignore_errors=True)
        shutil.rmtree(shared / f"{via}-{mb:g}", ignore_errors=True)
    return float(first.group(1)) - t_crash, float(resumed.group(2)), resumed.group(3)


def crash_resume(sizes: list[float], pairs: int) -> Iterator[Figure]:
    """Crash -> first resumed step on the spare, the store (the lost node's shard from its
    partner) against torch.save/torch.load of the shared directory, interleaved pairs (the
    order alternating); one figure per pair and the median ratio."""
    subprocess.run([sys.executable, str(DEVCLUSTER), "up", "--nodes", "3"], check=True,
                   capture_output=True, timeout=600)
    env = _env()
    work = Path(tempfile.mkdtemp(prefix="bv-ckpt-crash-"))
    shared, throttled, fs, rate = _shared_fs(work)
    tag = f"{fs}{' ' + rate if rate else ''}{' warm' if os.environ.get('BV_CKPT_BENCH_WARM') else ''}"
    try:
        for mb in sizes:
            got: dict[str, list[float]] = {"store": [], "torch": []}
            for i in range(pairs):
                for via in (("store", "torch") if i % 2 == 0 else ("torch", "store")):
                    sub = work / f"p{i}"
                    sub.mkdir(exist_ok=True)
                    total, resume_s, source = crash_one(mb, via, shared / f"p{i}", sub, env)
                    got[via].append(total)
                    yield Figure(f"ckpt crash->first step {mb:g} MB {tag} {via} (pair {i + 1})",
                                 total, "s", "", f"resume itself {resume_s:.2f} s from {source}")
            ratios = sorted(t / s for s, t in zip(got["store"], got["torch"], strict=True))
            goal = ">= 3" if mb >= 2000 else ">= 1" if mb <= 64 else ""  # issue 36's two goals
            yield Figure(f"ckpt crash->first step {mb:g} MB {tag} torch / store",
                         statistics.median(ratios),
                         "ratio", goal,
                         f"median of {pairs} pair(s), range {ratios[0]:.2f}-{ratios[-1]:.2f}")
    finally:  # also when a job fails or the runner stops early
        _unthrottle(throttled)
        shutil.rmtree(shared, ignore_errors=True)


def figures(args: Any) -> Iterator[Figure]:
    sizes = [float(x) for x in os.environ.get("BV_CKPT_BENCH_MB", "64").split(",") if x]
    if os.environ.get("BV_CKPT_BENCH_CRASH"):  # crash -> first resumed step only
        yield from crash_resume(sizes, int(os.environ.get("BV_CKPT_BENCH_PAIRS", "1")))
        return
    rounds = 3 if getattr(args, "quick", False) else 5
    yield from staging_memory(saves=30 if getattr(args, "quick", False) else 100)
    for mb in sizes:
        yield from cluster(mb, rounds)
