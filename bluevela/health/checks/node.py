"""`node`: memory available, free space, required mounts, paths and devices, and the host
facts of `bluevela.health.checks.host` (mount liveness, required services, processes in D
state, EDAC memory errors, clock sync). Short and fast.

Everything is read through the root (`BV_SYSFS_ROOT`, standing for `/`): `<root>/proc/meminfo`,
`<root>/proc/mounts`, `<root>/<path>` for paths and devices, and `statvfs(<root>/<path>)` for
free space. A missing mount, path or device, too little memory or free space is CRITICAL; so
is a required mount that does not answer its probe (hung or failing), a required service not
running, or an uncorrectable memory error. Long D-state processes, a high corrected-error rate
and an unsynchronized clock are WARNING.

On a busy node (a running job other than the hook's own: health/jobprocs.py, from
`<root>/proc`) memory available and free space are what the job uses, not the node's health:
there the floors are judged against the totals instead (MemTotal, the file system's size), so
a node that lost memory or whose file system shrank is still CRITICAL, and a job that fills
its node is never a drain. The healthcheck that slurmd runs at a restart under jobs, the prolog
of a shared node and `bv health run` on a busy node all judge it so.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from bluevela.checks_registry import check
from bluevela.health.checks.host import HostFacts, evaluate_host, gather_host
from bluevela.health.result import CheckResult, Status, summarize

if TYPE_CHECKING:
    from bluevela.health.context import ProbeContext
    from bluevela.site import NodeClass, NodeThresholds

logger = logging.getLogger(__name__)
GIB = float(1 << 30)


@dataclass(frozen=True)
class NodeFacts:
    mem_available_bytes: int | None
    free_bytes: dict[str, int | None] = field(default_factory=dict)  # None: cannot statvfs
    mounts: frozenset[str] | None = None  # None: /proc/mounts unreadable
    present: dict[str, bool] = field(default_factory=dict)  # required paths and devices
    errors: tuple[str, ...] = ()
    host: HostFacts | None = None
    mem_total_bytes: int | None = None
    total_bytes: dict[str, int | None] = field(default_factory=dict)  # the file systems' sizes
    busy_jobs: tuple[int, ...] = ()  # running jobs here other than the hook's own


def parse_meminfo(text: str, key: str = "MemAvailable") -> int | None:
    """`key` (MemAvailable, MemTotal) in bytes from /proc/meminfo text ('MemAvailable:  123
    kB')."""
    for line in text.splitlines():
        if line.startswith(f"{key}:"):
            parts = line.split()
            if len(parts) >= 2 and parts[1].isdigit():
                return int(parts[1]) * 1024
    return None


def _unescape_mount(field_: str) -> str:
    # /proc/mounts escapes space, tab, newline and backslash as \040 \011 \012 \134.
    for code, ch in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field_ = field_.replace(code, ch)
    return field_


def parse_mounts(text: str) -> frozenset[str]:
    """Mount points from /proc/mounts text."""
    out = set()
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 2:
            out.add(_unescape_mount(parts[1]))
    return frozenset(out)


def probe_node(ctx: ProbeContext) -> NodeFacts:
    """Read meminfo and mounts, statvfs the free-space paths, stat required paths/devices."""
    t = ctx.node_class.node
    from bluevela.health.jobprocs import running_jobs

    errors: list[str] = []
    mem: int | None = None
    mem_total: int | None = None
    try:
        meminfo = ctx.under_root("/proc/meminfo").read_text(errors="replace")
        mem, mem_total = parse_meminfo(meminfo), parse_meminfo(meminfo, "MemTotal")
    except OSError as exc:
        errors.append(f"meminfo: {exc.strerror or exc}")
    mounts: frozenset[str] | None = None
    if t.required_mounts:
        try:
            mounts = parse_mounts(ctx.under_root("/proc/mounts").read_text(errors="replace"))
        except OSError as exc:
            errors.append(f"mounts: {exc.strerror or exc}")
    free: dict[str, int | None] = {}
    total: dict[str, int | None] = {}
    for path in t.min_free_gib:
        try:
            st = os.statvfs(ctx.under_root(path))
            free[path] = st.f_bavail * st.f_frsize
            total[path] = st.f_blocks * st.f_frsize
        except OSError:
            free[path] = total[path] = None
    present = {p: os.path.lexists(ctx.under_root(p))
               for p in [*t.required_paths, *t.required_devices]}
    busy = tuple(sorted(running_jobs(ctx.under_root("/")).others(ctx.job_id)))
    return NodeFacts(mem, free, mounts, present, tuple(errors), gather_host(ctx, mounts),
                     mem_total, total, busy)


def node_timed_out(seconds: float, cls: NodeClass) -> CheckResult:
    """The node check killed at its timeout: with required mounts it can only have been
    stuck on a file system (each mount's own probe is bounded shorter), so CRITICAL."""
    t = cls.node
    if t.required_mounts:
        return CheckResult("node", Status.CRITICAL, f"no answer in {seconds:g} s (a file system "
                           f"is hung: required mounts {', '.join(t.required_mounts)})")
    return CheckResult("node", Status.UNKNOWN, f"timed out after {seconds:g} s, killed")


def _memory_problems(facts: NodeFacts, t: NodeThresholds, busy: bool,
                     metrics: dict[str, float]) -> list[tuple[Status, str]]:
    """MemAvailable against the floor; with a job running, the node's total instead."""
    problems: list[tuple[Status, str]] = []
    if facts.mem_available_bytes is None:
        problems.append((Status.UNKNOWN, "MemAvailable unreadable"))
    else:
        gib = facts.mem_available_bytes / GIB
        metrics["mem_available_gib"] = gib
        if not busy and gib < t.min_mem_available_gib:
            problems.append((Status.CRITICAL, f"{gib:.1f} GiB memory available < "
                             f"{t.min_mem_available_gib:g} GiB"))
    if busy and facts.mem_total_bytes is not None:
        gib = facts.mem_total_bytes / GIB
        if gib < t.min_mem_available_gib:
            problems.append((Status.CRITICAL, f"{gib:.1f} GiB memory in all < "
                             f"{t.min_mem_available_gib:g} GiB available needed"))
    return problems


def _space_problems(facts: NodeFacts, t: NodeThresholds, busy: bool
                    ) -> tuple[list[tuple[Status, str]], list[float]]:
    """Each path's free space against its floor (with a job running, its size instead); the
    problems and the free GiB of each readable path."""
    problems: list[tuple[Status, str]] = []
    frees = []
    for path, need in t.min_free_gib.items():
        free = facts.free_bytes.get(path)
        if free is None:
            problems.append((Status.CRITICAL, f"{path} missing or unreadable (free space)"))
            continue
        gib = free / GIB
        frees.append(gib)
        size = facts.total_bytes.get(path)
        if busy and size is not None:
            if size / GIB < need:
                problems.append((Status.CRITICAL, f"{path} {size / GIB:.2f} GiB in all < "
                                 f"{need:g} GiB free needed"))
        elif gib < need:
            problems.append((Status.CRITICAL, f"{path} {gib:.2f} GiB free < {need:g} GiB"))
    return problems, frees


def _presence_problems(facts: NodeFacts, t: NodeThresholds) -> list[tuple[Status, str]]:
    """The required mounts, paths and devices."""
    problems: list[tuple[Status, str]] = []
    if t.required_mounts:
        if facts.mounts is None:
            problems.append((Status.UNKNOWN, "mount table unreadable"))
        else:
            for m in t.required_mounts:
                if (m.rstrip("/") or "/") not in facts.mounts:
                    problems.append((Status.CRITICAL, f"{m} not mounted"))
    for p in t.required_paths:
        if not facts.present.get(p, False):
            problems.append((Status.CRITICAL, f"{p} missing"))
    for d in t.required_devices:
        if not facts.present.get(d, False):
            problems.append((Status.CRITICAL, f"device {d} missing"))
    return problems


def _ok_summary(facts: NodeFacts, t: NodeThresholds, metrics: dict[str, float],
                frees: list[float], busy: bool) -> str:
    """The line of a node with no problem: what was measured and found present."""
    parts = []
    if "mem_available_gib" in metrics:
        parts.append(f"{metrics['mem_available_gib']:.0f} GiB memory available")
    if frees:
        parts.append(f"min {min(frees):.0f} GiB free")
    for what, items in (("mounts", t.required_mounts), ("paths", t.required_paths),
                        ("devices", t.required_devices)):
        if items:
            parts.append(f"{len(items)} required {what} present")
    if facts.host is not None and facts.host.mounts:
        parts.append(f"{len(facts.host.mounts)} mounts answering")
    if t.required_services and facts.host is not None and facts.host.procs is not None:
        parts.append(f"{len(t.required_services)} services running")
    if busy:
        parts.append(f"{_jobs(facts.busy_jobs)} running: memory and free-space floors "
                     "judged on totals")
    return ", ".join(parts) or "OK"


@check("node", probe=probe_node, on_timeout=node_timed_out)
def evaluate_node(facts: NodeFacts, cls: NodeClass) -> CheckResult:
    """Memory available, free space, required mounts, paths and devices."""
    t = cls.node
    metrics: dict[str, float] = {}
    busy = bool(facts.busy_jobs)  # a job's use is not a node fault: totals (module docstring)
    problems = _memory_problems(facts, t, busy, metrics)
    space, frees = _space_problems(facts, t, busy)
    problems += space
    if frees:
        metrics["free_min_gib"] = min(frees)
    problems += _presence_problems(facts, t)
    for err in facts.errors:
        if not any(err.startswith(x) for x in ("meminfo", "mounts")):
            problems.append((Status.UNKNOWN, err))
    if facts.host is not None:
        host_problems, host_metrics = evaluate_host(facts.host, t)
        problems += host_problems
        metrics.update(host_metrics)
    status, summary = summarize(problems)
    if summary is None:
        summary = _ok_summary(facts, t, metrics, frees, busy)
    return CheckResult("node", status, summary, metrics)


def _jobs(ids: tuple[int, ...]) -> str:
    shown = ", ".join(str(j) for j in ids[:4]) + (", ..." if len(ids) > 4 else "")
    return f"job{'s' if len(ids) > 1 else ''} {shown}"
