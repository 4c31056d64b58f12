"""The hooks' side at scale (issue 27 §3): one job's prologs and epilogs on many nodes writing
their reports and series side files into one spool, one `bv archive ingest` of them, and the
fleet view of a 4,096-node cluster (`sinfo` and `scontrol show reservation` as Slurm 22.05
prints them) through `python -m bluevela.fleet_metrics` and `bv health nodes`.

The machinery is shared with benchmarks/bench_scale_hooks.py, which runs it at 64 .. 4,096
nodes and fits the growth of each figure. What is real and what stands in:

- the node reports are built and written by the hooks' own `_spool` (bluevela/hooks/phases.py,
  the same call the prolog and epilog make, through `write_report`'s bounded child), from a
  `HookContext` read from Slurm's variables as the hooks read them; the checks' report is the
  real quick tier run once on the recorded H100 fixture (healthy, and one with an IB port
  down for the nodes the job's checks drained) and reused: a node's own check run does not
  depend on the job's size;
- the epilog's series side file is cut by the real `spool_series` from a sampler segment with
  the sampler's own columns (8 GPUs, 8 IB ports), shared by the simulated nodes;
- the prologs ran `window_s` before the epilogs: their reports carry that time (a fixed clock
  while they are written), so the side files fall inside the job's window as on a cluster;
- ingest, fleet_metrics and `bv health nodes` run as their real entry points in fresh
  interpreters; `sinfo` and `scontrol` are stand-in executables on PATH that print text in
  the exact formats bluevela asks for (`sinfo -h -N -o %N|%T|%P|%E`, `scontrol show
  reservation -o`), generated for N nodes with a realistic mix of states and reasons.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import stat
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.fixture_trees import materialized

REPO = Path(__file__).resolve().parents[2]
JOB_ID = 880001
GPUS, PORTS = 8, 8
INTERVAL_S = 10.0
BV_PREFIX = "bv:"
CRITICAL_EVERY = 97  # one node in 97 ends its job with an IB port down (drained by the epilog)


def node_name(i: int) -> str:
    return f"gpu{i:04d}"


def nodes_expr(n: int) -> str:
    return f"gpu[0001-{n:04d}]"


def write_site(path: Path, n_fleet: int) -> Path:
    """The repository's site.yaml with its H100 class spanning `n_fleet` nodes."""
    text = (REPO / "site.yaml").read_text()
    text = text.replace("nodes: gpu[001-128]", f"nodes: {nodes_expr(n_fleet)}")
    assert nodes_expr(n_fleet) in text
    path.write_text(text)
    return path


# -- the hooks' side: prologs and epilogs of one job, one ingest --------------------------------


@dataclass
class NodeDirs:
    """The dirs the hooks write (a shared spool; the sampler's state shared by every node)."""

    base: Path
    site: Path
    spool: Path = field(init=False)
    state: Path = field(init=False)
    metrics: Path = field(init=False)
    archive: Path = field(init=False)

    def __post_init__(self) -> None:
        for name in ("spool", "state", "metrics", "archive"):
            d = self.base / name
            d.mkdir(parents=True, exist_ok=True)
            setattr(self, name, d)

    def env(self, fixture: str = "h100-healthy") -> dict[str, str]:
        fx = materialized() / fixture
        return {"BV_SITE": str(self.site), "BV_NODE_CLASS": "h100",
                "BV_SYSFS_ROOT": str(fx / "root"), "BV_NVML_SNAPSHOT": str(fx / "nvml.json"),
                "BV_STATE_DIR": str(self.state), "BV_SPOOL_DIR": str(self.spool),
                "BV_METRICS_DIR": str(self.metrics), "BV_ARCHIVE_DIR": str(self.archive)}


@contextmanager
def environ(values: dict[str, str]) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextmanager
def fixed_clock(t: float) -> Iterator[None]:
    """time.time() answers `t` (the prologs ran `window_s` ago)."""
    real = time.time
    time.time = lambda: t  # type: ignore[assignment]
    try:
        yield
    finally:
        time.time = real  # type: ignore[assignment]


def write_samples(samples: Path, start: float, end: float) -> None:
    """One sampler segment over [start, end] with the sampler's own columns."""
    from bluevela.telemetry.format import Column, Header, SegmentWriter
    from bluevela.telemetry.gpu import GPU_UNITS
    from bluevela.telemetry.host import IB_UNITS, NODE_UNITS
    from bluevela.telemetry.sampler import NVML_UNITS

    cols = [Column(f"gpu{g}.{m}", f"gpu{g}", u) for g in range(GPUS) for m, u in GPU_UNITS]
    cols += [Column(f"ib.mlx5_{p}/1.{m}", f"ib.mlx5_{p}/1", u) for p in range(PORTS)
             for m, u in IB_UNITS]
    cols += [Column(f"node.{m}", "node", u) for m, u in (*NODE_UNITS, *NVML_UNITS)]
    samples.mkdir(parents=True, exist_ok=True)
    w = SegmentWriter(samples / f"seg-{int(start)}.bvts",
                      Header("gpu0001", INTERVAL_S, tuple(cols), start))
    t = start
    k = 0
    while t <= end:
        w.append(t, [float((k + j) % 100) for j in range(len(cols))])
        t += INTERVAL_S
        k += 1
    w.close()


@dataclass
class HookRun:
    """What one job's hooks wrote, and how long the simulated nodes took."""

    nodes: int
    prolog_s: float
    epilog_s: float
    drained: list[str]
    spool_bytes: int
    files: int
    prolog_cpu_s: float = 0.0  # ours and the bounded writers' (children's) CPU
    epilog_cpu_s: float = 0.0

    @property
    def epilog_ms_per_node(self) -> float:
        return 1000.0 * self.epilog_s / self.nodes


@contextmanager
def unbounded_writes() -> Iterator[None]:
    """The hooks' spool writes made here instead of in a bounded child (`run_bounded`: a fork
    and a wait per file, tested on a hung mount by tests/archive/test_spool_bounded.py): the same
    writer, minus ~10-25 ms of fork and scheduling per file on this shared machine."""
    import bluevela.archive.spool as spool

    real = spool.SPOOL_WRITE_TIMEOUT_S
    spool.SPOOL_WRITE_TIMEOUT_S = None  # type: ignore[assignment]
    try:
        yield
    finally:
        spool.SPOOL_WRITE_TIMEOUT_S = real


def run_job_hooks(dirs: NodeDirs, n: int, *, window_s: float = 600.0,
                  job_id: int = JOB_ID, bounded: bool = True) -> HookRun:
    """`n` prologs, then `window_s` later `n` epilogs of one job, as the hooks build and
    write their reports (bluevela/hooks/phases.py `_spool`, `spool_series`); `bounded`
    False: see `unbounded_writes`."""
    if not bounded:
        with unbounded_writes():
            return run_job_hooks(dirs, n, window_s=window_s, job_id=job_id)
    from bluevela.fleet.nodestate import make_reason
    from bluevela.hooks.env import HookContext
    from bluevela.hooks.phases import DrainResult, _attempt, _run, _spool
    from bluevela.hooks.telemetry import job_telemetry, reading_of
    from bluevela.site import load_site
    from bluevela.telemetry.window import spool_series

    end = time.time()
    start = end - window_s
    write_samples(dirs.state / "samples", start - 2 * INTERVAL_S, end)
    slurm = {"SLURM_JOB_ID": str(job_id), "SLURM_JOB_USER": "alice",
             "SLURM_JOB_PARTITION": "gpu", "SLURM_NODELIST": nodes_expr(n),
             "SLURM_JOB_NUM_NODES": str(n)}
    reports = {}
    with environ(dirs.env()):
        site = load_site(dirs.site, cwd=False)
        first = HookContext.from_env("epilog", {**slurm, "SLURMD_NODENAME": node_name(1)})
        reports["ok"] = _run(site, first, None, "quick")
    with environ(dirs.env("h100-ib-port-down")):
        reports["bad"] = _run(site, first, None, "quick")
    detail = reports["bad"].drain_detail()
    assert detail is not None and reports["ok"].drain_detail() is None
    drain_bad = DrainResult(True, True, make_reason(site, detail))
    drained = []
    with environ(dirs.env()):
        t0, c0 = time.perf_counter(), cpu_s()
        with fixed_clock(start):
            for i in range(1, n + 1):
                hctx = HookContext.from_env("prolog", {**slurm, "SLURMD_NODENAME": node_name(i)})
                assert _spool(site, hctx, reports["ok"], DrainResult(), {}) is not None
        prolog_s, prolog_cpu = time.perf_counter() - t0, cpu_s() - c0
        t0, c0 = time.perf_counter(), cpu_s()
        for i in range(1, n + 1):
            env = {**slurm, "SLURMD_NODENAME": node_name(i), "SLURM_JOB_EXIT_CODE2": "0:0",
                   "SLURM_JOB_EXIT_CODE": "0", "SLURM_JOB_DERIVED_EC": "0"}
            hctx = HookContext.from_env("epilog", env)
            bad = i % CRITICAL_EVERY == 0
            report = reports["bad" if bad else "ok"]
            reading = reading_of(reports["ok"], start)
            reading["restart"] = 0
            telemetry = job_telemetry(reading, report, time.time())
            assert spool_series(site, job_id, hctx.node, reading,
                                restart=_attempt(hctx, reading)) is not None
            drain = drain_bad if bad else DrainResult()
            if bad:
                drained.append(hctx.node)
            assert _spool(site, hctx, report, drain, telemetry, _attempt(hctx, reading)) \
                is not None
        epilog_s, epilog_cpu = time.perf_counter() - t0, cpu_s() - c0
    files = [p for p in dirs.spool.iterdir() if p.is_file()]
    return HookRun(n, prolog_s, epilog_s, drained, sum(p.stat().st_size for p in files),
                   len(files), prolog_cpu, epilog_cpu)


def cpu_s() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


@dataclass
class Measured:
    """One fresh interpreter's run: wall seconds, peak RSS (its own getrusage), output."""

    rc: int
    wall_s: float
    rss_mb: float
    stdout: str
    stderr: str
    cpu_s: float = 0.0  # its user + system time: less bent by the machine's load than wall


# The command runs under a small interpreter of its own: a child's ru_maxrss starts from its
# parent's RSS at fork/exec (Linux keeps the old mm's high-water mark across exec), so measured
# straight from a pytest worker that grew to 700 MB, a 200 MB child read as 716 MB (CI).
_WRAP = """
import json, os, resource, subprocess, sys
rc = subprocess.call(sys.argv[2:])
u = resource.getrusage(resource.RUSAGE_CHILDREN)
with open(sys.argv[1], "w") as f:
    json.dump([rc, u.ru_maxrss, u.ru_utime + u.ru_stime], f)
"""


def run_measured(argv: list[str], env: dict[str, str], cwd: Path, timeout_s: float = 600.0
                 ) -> Measured:
    """Run `argv` with stdout/stderr to files; its peak RSS and CPU from the rusage of a small
    wrapper interpreter's one child."""
    out, err, usage = cwd / ".stdout", cwd / ".stderr", cwd / ".rusage"
    with open(out, "wb") as fo, open(err, "wb") as fe:
        t0 = time.perf_counter()
        p = subprocess.run([sys.executable, "-c", _WRAP, str(usage), *argv], env=env, stdout=fo,
                           stderr=fe, cwd=cwd, timeout=timeout_s, check=False)
        wall = time.perf_counter() - t0
    rc, maxrss_kib, cpu = json.loads(usage.read_text()) if p.returncode == 0 else (
        p.returncode, 0, 0.0)
    return Measured(rc, wall, maxrss_kib / 1024.0, out.read_text(), err.read_text(), cpu)


def child_env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("BV_", "SLURM"))}
    env["PYTHONPATH"] = str(REPO)
    return {**env, **extra}


def ingest(dirs: NodeDirs) -> tuple[Measured, dict[str, Any]]:
    """One `bv archive ingest --json` in a fresh interpreter."""
    m = run_measured([sys.executable, "-m", "bluevela", "archive", "ingest", "--json"],
                     child_env(dirs.env()), dirs.base)
    assert m.rc == 0, m.stderr[-2000:]
    return m, json.loads(m.stdout)


def tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


# -- the fleet view: sinfo and scontrol of an N-node cluster ------------------------------------

OPERATOR_REASONS = ("RMA ticket 4711: replace PSU", "kernel upgrade 6.1.0-18 | reboot pending",
                    "hw: fan tray 2 noisy (jdoe)", "NVSwitch tray swap, do not resume")
BV_REASONS = ("bv: ib: mlx5_3/1 state DOWN (expected ACTIVE)",
              "bv: gpu: GPU 5 retired pages 61 > 60",
              "bv: node: /home not mounted",
              "bv: nccl: all_reduce busbw 301.2 GB/s < 340")
NIGHTLY_REASON = "bv: nightly 2026-11-26: gemm 612.0 TFLOPS < 700 (GPU 2)"


@dataclass
class Fleet:
    """A generated fleet and what its views must say about it."""

    n: int
    sinfo: str
    reservations: str
    state: dict[str, str]  # node -> sinfo %T
    reason: dict[str, str]  # drained nodes -> reason
    source: dict[str, str]  # drained nodes -> bv | nightly | operator
    partitions: dict[str, list[str]]  # node -> partitions
    slots: int  # breaker slots (reservations bv-drain-gpu-<k>)


def make_fleet(n: int, seed: int = 27) -> Fleet:
    """`sinfo -h -N -o %N|%T|%P|%E` and `scontrol show reservation -o` of an `n`-node cluster
    as Slurm 22.05 prints them: one line per node and partition (every node in `gpu*`, the
    default, the first eighth also in `debug`); states by share: allocated, mixed, idle,
    completing, drained/draining by bv's checks, by the nightly and by operators, down (not
    responding), and reserved for a maintenance window over the last 64 nodes."""
    rng = random.Random(seed)
    state: dict[str, str] = {}
    reason: dict[str, str] = {}
    source: dict[str, str] = {}
    parts: dict[str, list[str]] = {}
    maint = {node_name(i) for i in range(max(1, n - 63), n + 1)}
    for i in range(1, n + 1):
        node = node_name(i)
        parts[node] = ["gpu*"] + (["debug"] if i <= n // 8 else [])
        if node in maint:
            state[node] = "reserved"
            continue
        r = rng.random()
        if r < 0.03:  # bv's checks: drained when idle, draining under a job
            state[node] = rng.choice(("drained", "draining"))
            reason[node], source[node] = rng.choice(BV_REASONS), "bv"
        elif r < 0.035:
            state[node], reason[node], source[node] = "drained", NIGHTLY_REASON, "nightly"
        elif r < 0.055:
            state[node] = rng.choice(("drained", "drained*", "draining"))
            reason[node], source[node] = rng.choice(OPERATOR_REASONS), "operator"
        elif r < 0.065:
            state[node], reason[node] = "down*", "Not responding"
        elif r < 0.07:
            state[node] = "completing"
        elif r < 0.60:
            state[node] = "allocated"
        elif r < 0.75:
            state[node] = "mixed"
        else:
            state[node] = "idle"
    lines = [f"{node}|{state[node]}|{p}|{reason.get(node, 'none')}"
             for node in state for p in parts[node]]
    ours = [node for node, s in source.items() if s in ("bv", "nightly")]
    res, slots = _reservations(ours, parts, sorted(maint))
    return Fleet(n, "\n".join(lines) + "\n", "\n".join(res) + "\n", state, reason, source,
                 {k: [p.rstrip("*") for p in v] for k, v in parts.items()}, slots)


def _reservations(ours: list[str], parts: dict[str, list[str]], maint: list[str]
                  ) -> tuple[list[str], int]:
    """`scontrol show reservation -o` lines: the breaker's slots, a single-node reservation
    per partition of each node bluevela drained (the checks' and the nightly's), as
    drain_node creates them ten years ahead; and an operator's maintenance window."""
    res = []
    taken: Counter[str] = Counter()
    for node in ours:
        for part in (p.rstrip("*") for p in parts[node]):
            res.append(
                f"ReservationName=bv-drain-{part}-{taken[part]} "
                "StartTime=2036-11-23T04:52:04 EndTime=2036-11-23T04:53:04 Duration=00:01:00 "
                f"Nodes={node} NodeCnt=1 CoreCnt=96 Features=(null) PartitionName=(null) "
                "Flags=OVERLAP,IGNORE_JOBS,SPEC_NODES TRES=cpu=96 Users=root Groups=(null) "
                "Accounts=(null) Licenses=(null) State=INACTIVE BurstBuffer=(null) Watts=n/a "
                "MaxStartDelay=(null)")
            taken[part] += 1
    res.append(
        "ReservationName=maint_rack32 StartTime=2026-11-26T04:52:16 "
        "EndTime=2026-11-28T04:52:16 Duration=2-00:00:00 "
        f"Nodes=gpu[{maint[0][3:]}-{maint[-1][3:]}] NodeCnt={len(maint)} "
        f"CoreCnt={96 * len(maint)} Features=(null) PartitionName=(null) "
        f"Flags=MAINT,SPEC_NODES TRES=cpu={96 * len(maint)} Users=root Groups=(null) "
        "Accounts=(null) Licenses=(null) State=ACTIVE BurstBuffer=(null) Watts=n/a "
        "MaxStartDelay=(null)")
    return res, sum(taken.values())


def install_standins(bindir: Path, fleet: Fleet) -> None:
    """`sinfo` and `scontrol` on PATH that print the fleet's text for exactly the argv bluevela
    passes (anything else fails as Slurm would on an unknown request)."""
    bindir.mkdir(parents=True, exist_ok=True)
    (bindir / "sinfo.txt").write_text(fleet.sinfo)
    (bindir / "reservations.txt").write_text(fleet.reservations)
    scripts = {
        "sinfo": f'[ "$*" = "-h -N -o %N|%T|%P|%E" ] && exec cat "{bindir}/sinfo.txt"\n'
                 'echo "sinfo: unexpected $*" >&2; exit 1\n',
        "scontrol": f'[ "$*" = "show reservation -o" ] && exec cat "{bindir}/reservations.txt"\n'
                    'echo "scontrol: unexpected $*" >&2; exit 1\n',
    }
    for name, body in scripts.items():
        path = bindir / name
        path.write_text("#!/bin/sh\n" + body)
        path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


def fleet_env(bindir: Path, site: Path, spool: Path, state: Path) -> dict[str, str]:
    env = child_env({"BV_SITE": str(site), "BV_SPOOL_DIR": str(spool),
                     "BV_STATE_DIR": str(state)})
    env["PATH"] = f"{bindir}:{env.get('PATH', '/usr/bin:/bin')}"
    return env


def run_fleet_metrics(work: Path, env: dict[str, str]) -> tuple[Measured, str]:
    out = work / "textfile"
    m = run_measured([sys.executable, "-m", "bluevela.fleet_metrics", "--out", str(out)],
                     env, work)
    assert m.rc == 0, m.stderr[-2000:]
    return m, (out / "bluevela_fleet.prom").read_text()


def run_health_nodes(work: Path, env: dict[str, str], *, as_json: bool = True) -> Measured:
    argv = [sys.executable, "-m", "bluevela", "health", "nodes"] + (["--json"] if as_json else [])
    m = run_measured(argv, env, work)
    assert m.rc == 0, m.stderr[-2000:]
    return m


_SERIES = re.compile(r'^(\w+)\{(.*)\} (\S+)$')


def prom_series(text: str) -> list[tuple[str, dict[str, str], float]]:
    out = []
    for line in text.splitlines():
        m = _SERIES.match(line)
        if m:
            labels = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(2)))
            out.append((m.group(1), labels, float(m.group(3))))
    return out


def check_fleet_metrics(fleet: Fleet, prom: str) -> None:
    """Every node once, busy right, every drained node with its source and reason, the
    breaker's count of bv drains per partition."""
    series = prom_series(prom)
    info = [lab["node"] for name, lab, _ in series if name == "bluevela_slurm_node_info"]
    assert sorted(info) == sorted(fleet.state) and len(info) == fleet.n
    busy = {lab["node"] for name, lab, v in series if name == "bluevela_slurm_node_busy" and v}
    assert busy == {n for n, s in fleet.state.items()
                    if s in ("allocated", "mixed", "completing", "draining")}
    drained = {lab["node"]: lab for name, lab, _ in series if name == "bluevela_slurm_node_drained"}
    assert set(drained) == set(fleet.reason) - {n for n, s in fleet.state.items() if s == "down*"}
    for node, lab in drained.items():
        assert lab["source"] == fleet.source[node] and lab["reason"] == fleet.reason[node], node
    used = {lab["partition"]: v for name, lab, v in series
            if name == "bluevela_breaker_drained_nodes"}
    ours = [n for n, s in fleet.source.items() if s in ("bv", "nightly")]
    assert used["gpu"] == len(ours)
    assert used["debug"] == sum(1 for n in ours if "debug" in fleet.partitions[n])
    limits = {lab["partition"]: v for name, lab, v in series
              if name == "bluevela_breaker_limit_nodes"}
    total = {lab["partition"]: v for name, lab, v in series if name == "bluevela_breaker_nodes"}
    assert total == {"gpu": fleet.n, "debug": fleet.n // 8}
    assert limits["gpu"] == math.ceil(fleet.n * 0.15)
    assert ("bluevela_fleet_scrape_success", {}, 1.0) not in series  # no labels: plain line
    assert "bluevela_fleet_scrape_success 1" in prom


def check_health_nodes(fleet: Fleet, rows: list[dict[str, Any]],
                       reported: set[str] | None = None) -> None:
    """One row per node, in order, each drained node with its reason and whether it is ours;
    the nodes with a spooled report show it."""
    assert [r["node"] for r in rows] == sorted(fleet.state)
    states = Counter(r["state"] for r in rows)
    want = Counter({"drained": "IDLE+DRAIN", "draining": "ALLOCATED+DRAIN",
                    "drained*": "IDLE+DRAIN"}.get(s, s.rstrip("*").upper())
                   for s in fleet.state.values())
    assert states == want
    for r in rows:
        node = r["node"]
        assert (r["reason"] or "") == fleet.reason.get(node, ""), node
        ours = "DRAIN" in r["state"] and fleet.source.get(node) in ("bv", "nightly")
        assert r["drained_by_bluevela"] is ours, node
        if reported is not None:
            assert (r["last_report"] is not None) is (node in reported), node


# -- the tests ----------------------------------------------------------------------------------


def _job(tmp: Path, n: int, site: Path) -> tuple[HookRun, Measured, dict[str, Any], NodeDirs]:
    dirs = NodeDirs(tmp, site)
    run = run_job_hooks(dirs, n, window_s=300.0, bounded=False)
    m, res = ingest(dirs)
    return run, m, res, dirs


def test_one_jobs_epilogs_on_512_nodes_archive_once_each(tmp_path: Path) -> None:
    """128 and 512 nodes: every prolog and epilog report and every series side file archived
    exactly once, the job complete, the drained nodes' reasons in the archive; a second
    ingest finds nothing left; the 4x job costs each epilog no more CPU and the ingest less
    than 8x the CPU (a quadratic step would be 16x)."""
    from bluevela.archive.query import show_job

    site = write_site(tmp_path / "site.yaml", 4096)
    small, m_small, _, _ = _job(tmp_path / "n128", 128, site)
    run, m, res, dirs = _job(tmp_path / "n512", 512, site)
    n = 512
    assert res["reports_ingested"] == 2 * n and res["jobs_archived"] == [JOB_ID]
    assert not res["quarantined"] and not res["duplicates"] and not res["waiting_reports"]
    left = [p.name for p in dirs.spool.iterdir() if p.is_file()]
    assert left == []
    done = sorted(p.name for p in (dirs.spool / "done").iterdir())
    assert len(done) == 3 * n and len(set(done)) == 3 * n
    assert sum(name.endswith(".series.bvts") for name in done) == n
    one = json.loads((dirs.spool / "done" / f"{JOB_ID}.{node_name(7)}.epilog.json").read_text())
    assert one["nodelist"] == nodes_expr(n) and one["num_nodes"] == n
    assert len(list((dirs.archive / "series").glob("*.h5"))) == 1

    job = show_job(dirs.archive, JOB_ID)
    assert len(job["nodes"]) == n and all(e["prolog"] and e["epilog"] for e in job["nodes"])
    reasons = {e["node"]: e["epilog"]["drain_reason"] for e in job["nodes"]
               if e["epilog"]["drained"]}
    assert sorted(reasons) == run.drained and len(run.drained) == n // CRITICAL_EVERY
    assert all(r.startswith("bv: ib: ") for r in reasons.values()), reasons

    again, res2 = ingest(dirs)
    assert res2["reports_ingested"] == 0 and res2["jobs_archived"] == []

    # CPU, not wall: the fsyncs' wait is this shared disk's, not the hooks'.
    per_node = (run.epilog_cpu_s / n) / (small.epilog_cpu_s / 128)
    assert per_node < 2.0, (run.epilog_cpu_s, small.epilog_cpu_s)
    assert m.cpu_s / m_small.cpu_s < 8.0, (m.cpu_s, m_small.cpu_s)  # quadratic: 16x


@pytest.mark.parametrize("n", [4096])
def test_fleet_view_of_a_4096_node_cluster(tmp_path: Path, n: int) -> None:
    """fleet_metrics and `bv health nodes --json` on generated sinfo/scontrol output of 4,096
    nodes: counts by state, every drained node with its reason and source, the breaker's
    slots; the 4,096-node run costs less than 8x the CPU of the 1,024-node one."""
    times: dict[int, tuple[float, float]] = {}
    for size in (n // 4, n):
        work = tmp_path / f"n{size}"
        work.mkdir()
        fleet = make_fleet(size)
        install_standins(work / "bin", fleet)
        site = write_site(work / "site.yaml", size)
        (work / "spool").mkdir()
        (work / "state").mkdir()
        env = fleet_env(work / "bin", site, work / "spool", work / "state")
        fm, prom = run_fleet_metrics(work, env)
        check_fleet_metrics(fleet, prom)
        hn = run_health_nodes(work, env)
        check_health_nodes(fleet, json.loads(hn.stdout))
        times[size] = (fm.cpu_s, hn.cpu_s)
        assert fleet.slots > 0
    small, big = times[n // 4], times[n]
    assert big[0] / small[0] < 8.0 and big[1] / small[1] < 8.0, times


def test_health_nodes_shows_each_nodes_last_report(tmp_path: Path) -> None:
    """The fleet view reads the spool beside Slurm: the nodes whose reports a job left (in
    done/ after ingest) show them, the others none."""
    from bluevela.archive.spool import mark_done

    site = write_site(tmp_path / "site.yaml", 256)
    dirs = NodeDirs(tmp_path / "job", site)
    run_job_hooks(dirs, 32, window_s=120.0, bounded=False)
    mark_done(dirs.spool, sorted(p.name for p in dirs.spool.iterdir() if p.is_file()))
    fleet = make_fleet(256)
    install_standins(tmp_path / "bin", fleet)
    env = fleet_env(tmp_path / "bin", site, dirs.spool, tmp_path / "state")
    rows = json.loads(run_health_nodes(tmp_path, env).stdout)
    check_health_nodes(fleet, rows, reported={node_name(i) for i in range(1, 33)})
    assert {r["last_report"]["phase"] for r in rows[:32]} == {"epilog"}


def test_the_fleet_views_read_of_done_keeps_no_list_of_it(tmp_path: Path) -> None:
    """done/ keeps a week of every job's reports (~460,000 files on 4,096 nodes running 8
    jobs a day): `bv health nodes` held all their directory entries at once (42 MB for
    50,000 files, 435 MB of RSS for 460,000); now its memory is that of the newest report per
    node. A requeued attempt's report (`.r<k>`) counts as the node's newest too (it was
    skipped)."""
    import tracemalloc

    from bluevela.fleet.api import latest_reports

    done = tmp_path / "done"
    done.mkdir()
    fd = os.open(done, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for job in range(12):
            for i in range(2000):
                f = os.open(f"{1000 + job}.{node_name(i + 1)}.epilog.json",
                            os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd)
                os.write(f, b"{}")
                os.close(f)
    finally:
        os.close(fd)
    requeued = tmp_path / f"2000.{node_name(5)}.epilog.r1.json"
    requeued.write_text(json.dumps({"phase": "epilog", "job_id": 2000, "restart": 1}))
    latest_reports(tmp_path / "empty")  # its lazy imports once, outside the measurement
    tracemalloc.start()
    try:
        last = latest_reports(tmp_path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(last) == 2000 and peak < 10 * 2**20, peak  # the list: 20 MB (24 on cd8e436)
    assert last[node_name(5)]["file"] == str(requeued) and last[node_name(5)]["job_id"] == 2000


def _expanded_expr(expr: str) -> str:
    """The old rule: expand SLURM_NODELIST, check every name, keep it when all pass."""
    from bluevela.hooks.env import _MAX_NODES, _nodelist

    names = _nodelist(expr)
    return expr if names and len(names) < _MAX_NODES else ""


def test_nodelist_is_checked_without_expanding_it() -> None:
    """Every prolog and epilog read SLURM_NODELIST by expanding it, checking each name and
    compressing it again for its report: O(N log N) a hook, 6 ms at 4,096 nodes and the
    largest per-node cost that grew with the job. The expression is now checked piece by
    piece (same verdict as expanding it, on 3,000 random expressions) and carried as it is."""
    import logging

    from bluevela.hooks.env import HookContext, _checked_expr

    rng = random.Random(27)
    atoms = ["n", "gpu", "a.b", "-x", "_y", "..", "x.", "[", "]", "1", "01", "001", "-", "5",
             ",", "[1-3]", "[01-10]", "[5-2]", "[001-5]", "[1,3-4]", "/", "[0-99999999]",
             ".r2", "[1-2][3-4]", "$(id)", " ", "[9-10]"]
    logging.getLogger("bluevela.hooks.env").disabled = True
    try:
        for _ in range(3000):
            expr = "".join(rng.choice(atoms) for _ in range(rng.randint(1, 6)))
            assert _checked_expr(expr) == _expanded_expr(expr), expr
    finally:
        logging.getLogger("bluevela.hooks.env").disabled = False
    ctx = HookContext.from_env("epilog", {"SLURMD_NODENAME": "gpu001", "SLURM_JOB_ID": "9",
                                          "SLURM_NODELIST": "gpu[001-003,007],login1"})
    assert ctx.nodelist_expr == "gpu[001-003,007],login1"
    assert ctx.nodelist == ("gpu001", "gpu002", "gpu003", "gpu007", "login1")


def test_a_hooks_read_of_slurm_nodelist_does_not_grow_with_the_job() -> None:
    """The hook's context of a 65,000-node job costs what a 64-node job's does (expanding
    and checking every name made it ~1,000x)."""
    from bluevela.hooks.env import HookContext

    def read(expr: str) -> float:
        best = math.inf
        for _ in range(5):
            t0 = time.perf_counter()
            HookContext.from_env("epilog", {"SLURMD_NODENAME": "gpu00001", "SLURM_JOB_ID": "9",
                                            "SLURM_NODELIST": expr})
            best = min(best, time.perf_counter() - t0)
        return best

    small, big = read("gpu[00001-00064]"), read("gpu[00001-65000]")
    assert big / small < 5.0, (small, big)


def test_rss_is_the_childs_own_peak() -> None:
    """run_measured's RSS is the child's peak (200 MB touched), not the parent's: measured from
    a parent that holds 600 MB itself (CI's pytest worker had grown to 700 MB, and a child
    forked straight from it read as 716 MB)."""
    ballast = bytearray(600 << 20)
    ballast[::4096] = b"x" * len(ballast[::4096])  # touched: resident
    m = run_measured([sys.executable, "-c", "b = b'x' * (200 << 20)"], child_env({}),
                     Path("/tmp"))
    del ballast
    assert m.rc == 0 and 200 <= m.rss_mb < 260, m.rss_mb
