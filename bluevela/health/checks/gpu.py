"""`gpu`: NVML values (live through pynvml, or a replayed snapshot) and XIDs.

CRITICAL: on a class with GPUs, NVML that cannot start (`NVML: Driver Not Loaded`, a
driver/library version mismatch) or an NVML call that hangs (`NVML timed out after 3 s`, the
runner's timeout); fewer GPUs than the class has, a different model, volatile uncorrected ECC
errors over the ceiling, a row remap pending or failed, retired pages over NVIDIA's RMA
ceiling, temperature over the class's maximum, a hardware slowdown (HW slowdown / HW thermal /
HW power brake) seen in two readings `gpu.recheck_s` apart, a PCIe link narrower than its
maximum width, a compute process on the job's GPUs (prolog; every GPU at healthcheck) that is
not ours, not a running job's and not an MPS daemon, and is still there at the second
reading (health/jobprocs.py), or an XID whose resolution in NVIDIA's XID catalog is a reset, a
reboot or a hardware action (checks/gpu_xids.py) with no evidence of a reset since: such an
XID stays CRITICAL past `gpu.xid_window_s` until the driver is loaded again after it (its
`NVRM: loading` kernel line) or the node reboots (the kernel log is the current boot's).
WARNING: more GPUs than expected, aggregate (lifetime) uncorrected ECC over the ceiling,
retired pages pending, software thermal slowdown, a hardware slowdown gone at the second
reading, a PCIe link whose maximum generation is below the GPU's, persistence mode off, any
other XID in the window (the catalog's RESTART_APP and IGNORE among them). A running job's
processes are counted (`job_processes_count`), never drained for.
NVLink and fabric state, ECC by location, the row remapper histogram, throttle shares from the
violation counters, expected power limit and application clocks, and NVSwitch SXids: see
checks/gpu_fabric.py (their rates compare with the previous reading in the state dir,
`gpu_counters.json`).
UNKNOWN (could not run, says nothing about the node): pynvml missing (bluevela's own
installation, logged as an installation error), a snapshot file that cannot be read, a kernel
log that cannot be read (the XID part; the rest is still judged and a CRITICAL wins).
A PCIe link running below its maximum generation is normal when the GPU idles (power saving),
so the current generation is only reported.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from bluevela.checks_registry import check
from bluevela.health.checks import gpu_fabric as fabric
from bluevela.health.checks.gpu_xids import XID_TABLE as XID_TABLE  # re-exported
from bluevela.health.checks.gpu_xids import driver_loads, reset_since, xid_verdict
from bluevela.health.jobprocs import owners, parent_pid
from bluevela.health.kmsg import SXid, Xid, parse_sxids, parse_xids, read_marked_lines
from bluevela.health.nvml import LiveNVML, NVMLSource, ReplayNVML
from bluevela.health.nvml_fields import FABRIC_COMPLETED, NVLINK_COUNTERS, ProcessInfo
from bluevela.health.nvml_live import NVMLMissingError
from bluevela.health.nvml_snapshot import GPUInfo, NVMLSnapshot
from bluevela.health.result import CheckResult, Status, summarize
from bluevela.health.state import read_json, write_json
from bluevela.health.throttle import HW_SLOWDOWNS, SW_THERMAL_SLOWDOWN, reason_names

if TYPE_CHECKING:
    from bluevela.health.context import ProbeContext
    from bluevela.site import NodeClass

logger = logging.getLogger(__name__)


# Processes are leftovers only where no job of ours should be running.
PROCESS_PHASES = frozenset({"prolog", "healthcheck"})


@dataclass(frozen=True)
class GPUFacts:
    snapshot: NVMLSnapshot | None
    xids: tuple[Xid, ...] = ()
    xid_source: str | None = None  # None: no kernel log could be read
    phase: str = "manual"
    error: str | None = None  # NVML could not be used at all (our side: UNKNOWN)
    skipped: bool = False  # the class has no GPUs and no snapshot was given
    init_error: str | None = None  # nvmlInit failed: NVML's message (the node's side)
    uptime_s: float | None = None  # time since boot at the reading (dates the XIDs)
    job_gpus: tuple[int, ...] | None = None  # the job's GPUs; None: every GPU
    own_pids: frozenset[int] = frozenset()  # compute processes that are this hook's own
    job_pids: Mapping[int, int] = field(default_factory=dict)  # pid -> running job here
    mps_pids: frozenset[int] = frozenset()  # MPS daemons (never leftovers)
    driver_loads: tuple[float, ...] = ()  # NVIDIA driver loads (s since boot) in the log
    sxids: tuple[SXid, ...] = ()  # NVSwitch errors in the kernel log
    # Each GPU's previous counter reading (state dir), by fabric.gpu_key; empty: none.
    baselines: Mapping[str, fabric.Baseline] = field(default_factory=dict)
    live: bool = False  # read from this node's NVML now (not a recorded snapshot)


def _kmsg_lines(ctx: ProbeContext, snap: NVMLSnapshot | None) -> tuple[list[str] | None, str | None]:
    if ctx.kmsg is not None:
        try:
            return read_marked_lines(ctx.kmsg), str(ctx.kmsg)
        except OSError as exc:
            logger.info("cannot read %s: %s", ctx.kmsg, exc)
            return None, None
    if snap is not None and ctx.nvml_snapshot is not None:
        return (list(snap.kmsg), "snapshot kmsg") if snap.kmsg is not None else (None, None)
    if snap is not None and snap.kmsg is not None:  # live: gather_live read /dev/kmsg
        return list(snap.kmsg), "/dev/kmsg"
    return None, None


def nvml_source(ctx: ProbeContext) -> NVMLSource:
    """Where NVML is read from: the snapshot file (BV_NVML_SNAPSHOT) or the live node."""
    if ctx.nvml_snapshot is not None:
        return ReplayNVML(ctx.nvml_snapshot)
    return LiveNVML(include_kmsg=ctx.kmsg is None, recheck_s=ctx.node_class.gpu.recheck_s,
                    process_gpus=ctx.job_gpus)


def own_processes(ctx: ProbeContext, pids: set[int]) -> frozenset[int]:
    """The `pids` that descend from this hook run (the runner, or this process when run
    directly): the nccl check's own workers are not leftovers. Read from `<root>/proc`."""
    ours = {os.getpid()} | ({ctx.runner_pid} if ctx.runner_pid else set())
    proc = ctx.under_root("/proc")
    found = set()
    for pid in pids:
        cur: int | None = pid
        for _ in range(64):
            if cur is None or cur <= 1:
                break
            if cur in ours:
                found.add(pid)
                break
            cur = parent_pid(proc, cur)
    return frozenset(found)


def probe_gpu(ctx: ProbeContext) -> GPUFacts:
    """NVML values from the snapshot (BV_NVML_SNAPSHOT) or live NVML, then XIDs."""
    if ctx.nvml_snapshot is None and ctx.node_class.gpus == 0:
        return GPUFacts(None, phase=ctx.phase, skipped=True)
    live = ctx.nvml_snapshot is None
    try:
        snap = nvml_source(ctx).read()
    except (NVMLMissingError, ImportError) as exc:
        logger.error("installation error: %s: the gpu check cannot run (install nvidia-ml-py "
                     "where bluevela is installed)", exc)
        return GPUFacts(None, phase=ctx.phase,
                        error=f"bluevela installation error: {exc}")
    except (OSError, ValueError) as exc:
        return GPUFacts(None, phase=ctx.phase, error=f"{type(exc).__name__}: {exc}")
    lines, source = _kmsg_lines(ctx, snap)
    uptime = snap.uptime_s
    if uptime is None and live:
        uptime = time.clock_gettime(time.CLOCK_MONOTONIC)
    pids = {p.pid for g in snap.gpus
            for p in (*(g.compute_processes or ()), *(g.compute_processes_recheck or ()))}
    own = own_processes(ctx, pids) if pids else frozenset()
    job_pids: dict[int, int] = {}
    mps: frozenset[int] = frozenset()
    if pids - own and ctx.phase in PROCESS_PHASES:
        # A running job's processes (the healthcheck at a slurmd restart under a job, another
        # job's GPU on a shared node) and the MPS daemons are not leftovers.
        found = owners(ctx.under_root("/"), pids - own)
        job_pids, mps = found.jobs, found.mps
    return GPUFacts(snap, tuple(parse_xids(lines)), source, ctx.phase,
                    init_error=snap.init_error, uptime_s=uptime, job_gpus=ctx.job_gpus,
                    own_pids=own, job_pids=job_pids, mps_pids=mps,
                    driver_loads=driver_loads(lines),
                    sxids=tuple(parse_sxids(lines)),
                    baselines=_counter_baselines(ctx, snap), live=live)


def _counter_baselines(ctx: ProbeContext, snap: NVMLSnapshot) -> dict[str, fabric.Baseline]:
    """The previous NVLink/violation counter readings (state dir), then this reading stored
    in their place, unless the stored one is younger than `gpu.throttle_min_interval_s` (kept,
    so frequent prologs still see a long enough interval for a throttle share)."""
    if ctx.state_dir is None:
        return {}
    path = ctx.state_dir / fabric.GPU_COUNTERS
    stored = read_json(path)
    age: float | None = None
    out: dict[str, fabric.Baseline] = {}
    if isinstance(stored, dict) and isinstance(stored.get("gpus"), dict):
        if isinstance(stored.get("time"), int | float):
            age = max(0.0, time.time() - float(stored["time"]))
        for key, raw in stored["gpus"].items():
            base = fabric.parse_baseline(raw, age)
            if base is not None:
                out[str(key)] = base
    current = {fabric.gpu_key(g): rec for g in snap.gpus if g.error is None
               and (rec := fabric.counters_record(g))}
    if current and (age is None or not out
                    or age >= ctx.node_class.gpu.throttle_min_interval_s):
        write_json(path, {"time": time.time(), "gpus": current})
    return out


def _leftovers(g: GPUInfo, facts: GPUFacts) -> tuple[list[ProcessInfo], list[ProcessInfo]]:
    """(still there at the second reading, gone by then) processes of `g` that are not ours,
    not a running job's and not an MPS daemon, on the job's GPUs only."""
    if facts.job_gpus is not None and g.index not in facts.job_gpus:
        return [], []
    first = [p for p in g.compute_processes or ()
             if p.pid not in facts.own_pids and p.pid not in facts.job_pids
             and p.pid not in facts.mps_pids]
    if not first or g.compute_processes_recheck is None:  # one reading decides
        return first, []
    again = {p.pid for p in g.compute_processes_recheck}
    return [p for p in first if p.pid in again], [p for p in first if p.pid not in again]


def _gpu_problems(g: GPUInfo, cls: NodeClass, facts: GPUFacts) -> list[tuple[Status, str]]:
    t = cls.gpu
    p: list[tuple[Status, str]] = []
    lab = g.label
    if cls.gpu_model and g.name is not None and g.name != cls.gpu_model:
        p.append((Status.CRITICAL, f"{lab} is {g.name!r}, expected {cls.gpu_model!r}"))
    if g.ecc_uncorrected_volatile is not None and g.ecc_uncorrected_volatile > t.max_uncorrected_ecc_volatile:
        p.append((Status.CRITICAL, f"{lab} {g.ecc_uncorrected_volatile} uncorrected ECC errors "
                  "(volatile)"))
    if g.ecc_uncorrected_aggregate is not None and g.ecc_uncorrected_aggregate > t.max_uncorrected_ecc_aggregate:
        p.append((Status.WARNING, f"{lab} {g.ecc_uncorrected_aggregate} uncorrected ECC errors "
                  "(aggregate)"))
    if g.remapped_rows_failure:
        p.append((Status.CRITICAL, f"{lab} row remapping failed"))
    if g.remapped_rows_pending:
        p.append((Status.CRITICAL, f"{lab} row remap pending (GPU reset needed)"))
    retired = (g.retired_pages_sbe or 0) + (g.retired_pages_dbe or 0)
    if retired > t.max_retired_pages:
        p.append((Status.CRITICAL, f"{lab} {retired} retired pages > {t.max_retired_pages}"))
    if g.retired_pages_pending:
        p.append((Status.WARNING, f"{lab} page retirement pending"))
    if g.temperature_c is not None and g.temperature_c > t.max_temp_c:
        p.append((Status.CRITICAL, f"{lab} {g.temperature_c:g} C > {t.max_temp_c:g} C"))
    p += _throttle_problems(g, facts)
    cw, mw = g.pcie_link_width_current, g.pcie_link_width_max
    if cw is not None and mw is not None and cw < mw:
        p.append((Status.CRITICAL, f"{lab} PCIe x{cw} (max x{mw})"))
    lg, gg = g.pcie_link_gen_max, g.pcie_link_gen_gpu_max
    if lg is not None and gg is not None and lg < gg:
        p.append((Status.WARNING, f"{lab} PCIe link max Gen{lg} < GPU Gen{gg}"))
    if facts.phase in PROCESS_PHASES and not t.allow_leftover_processes:
        left, gone = _leftovers(g, facts)
        if left:
            pids = ",".join(str(x.pid) for x in left[:4])
            again = (f", still there after {_secs(facts)}" if g.compute_processes_recheck is not None
                     else "")
            p.append((Status.CRITICAL, f"{lab} {len(left)} leftover process(es) (pid {pids}"
                      f"{again})"))
        elif gone:  # a previous job's process winding down: reported, not drained
            pids = ",".join(str(x.pid) for x in gone[:4])
            p.append((Status.WARNING, f"{lab} process(es) {pids} exited within {_secs(facts)}"))
    if t.require_persistence_mode and g.persistence_mode is False:
        p.append((Status.WARNING, f"{lab} persistence mode off"))
    base = facts.baselines.get(fabric.gpu_key(g))
    p += fabric.nvlink_problems(g, t, base)
    p += fabric.fabric_problems(g, t)
    p += fabric.ecc_location_problems(g, t)
    p += fabric.row_remap_problems(g, t)
    p += fabric.throttle_problems(g, t, fabric.throttle_shares(g, base, t.throttle_min_interval_s),
                                  base)
    p += fabric.settings_problems(g, t)
    return p


def _secs(facts: GPUFacts) -> str:
    after = facts.snapshot.recheck_after_s if facts.snapshot is not None else None
    return f"{after:g} s" if after is not None else "a second reading"


def _confirmed_hw(g: GPUInfo) -> int:
    """HW slowdown bits that both readings show (the one reading when there is no second)."""
    hw = (g.clocks_event_reasons or 0) & HW_SLOWDOWNS
    if g.clocks_event_reasons_recheck is None:
        return hw
    return hw & g.clocks_event_reasons_recheck


def _throttle_problems(g: GPUInfo, facts: GPUFacts) -> list[tuple[Status, str]]:
    reasons = g.clocks_event_reasons or 0
    hw = reasons & HW_SLOWDOWNS
    confirmed = _confirmed_hw(g)
    if confirmed:
        how = f" (in 2 readings {_secs(facts)} apart)" if g.clocks_event_reasons_recheck is not None else ""
        return [(Status.CRITICAL, f"{g.label} throttled: {','.join(reason_names(confirmed))}{how}")]
    if hw:
        return [(Status.WARNING, f"{g.label} transient {','.join(reason_names(hw))} "
                 f"(gone after {_secs(facts)})")]
    if reasons & SW_THERMAL_SLOWDOWN:
        return [(Status.WARNING, f"{g.label} throttled: sw_thermal_slowdown")]
    return []


def _xid_problems(facts: GPUFacts, usable: list[GPUInfo], window_s: float
                  ) -> tuple[list[tuple[Status, str]], int, int]:
    """Problems of the XIDs within the window; (problems, counted, older ones ignored)."""
    if facts.xid_source is None:
        return [(Status.UNKNOWN, "kernel log unreadable: XIDs not checked")], 0, 0
    by_bus = {g.bus: g for g in usable if g.bus}
    problems: list[tuple[Status, str]] = []
    seen: set[tuple[str, int, Status]] = set()
    counted = old = 0
    for x in facts.xids:
        verdict = xid_verdict(x.code, x.line)
        if not _xid_counts(x, verdict, facts, window_s):
            old += 1
            continue
        counted += 1
        key = (x.bus, x.code, verdict[0] if verdict else Status.WARNING)
        if key in seen:
            continue
        seen.add(key)
        gpu = by_bus.get(x.bus)
        where = f"{gpu.label} (PCI {x.pci})" if gpu else f"PCI {x.pci}"
        if verdict is None:
            problems.append((Status.WARNING, f"XID {x.code} on {where}"))
        else:
            status, what, action = verdict
            stale = (status is Status.CRITICAL and window_s > 0 and _outside(x, facts, window_s))
            since = " (no GPU reset since: reload the driver or reboot)" if stale else ""
            problems.append((status, f"XID {x.code} on {where}: {what}; {action}{since}"))
    return problems, counted, old


def _outside(x: Xid, facts: GPUFacts, window_s: float) -> bool:
    return (x.at_s is not None and facts.uptime_s is not None
            and facts.uptime_s - x.at_s > window_s)


def _xid_counts(x: Xid, verdict: tuple[Status, str, str] | None, facts: GPUFacts,
                window_s: float) -> bool:
    """Whether an XID of the kernel log is judged now.

    An XID bv drains for (CRITICAL) counts until the GPU was reset after it: a driver load
    logged later (`reset_since`), or a reboot (it is then not in this boot's log). The window
    does not end it: a GPU that needs a reset still needs one an hour later. Any other XID
    counts within `gpu.xid_window_s` (0: every one since boot).
    """
    if verdict is not None and verdict[0] is Status.CRITICAL:
        return reset_since(x.at_s, facts.driver_loads) is None
    return not (window_s > 0 and _outside(x, facts, window_s))


def _metrics(gpus: list[GPUInfo], xids: int, facts: GPUFacts,
             throttle_min_interval_s: float = 0.0) -> dict[str, float]:
    m: dict[str, float] = {"gpus_count": len(gpus), "xid_count": xids}

    def vals(attr: str) -> list[float]:
        return [float(v) for g in gpus if (v := getattr(g, attr)) is not None]

    for attr, name, agg in (
        ("temperature_c", "temp_max_c", max),
        ("power_w", "power_w", sum),
        ("ecc_uncorrected_volatile", "ecc_uncorrected_volatile_total", sum),
        ("ecc_uncorrected_aggregate", "ecc_uncorrected_aggregate_total", sum),
        ("remapped_rows_uncorrectable", "remapped_rows_uncorrectable_total", sum),
        ("remapped_rows_correctable", "remapped_rows_correctable_total", sum),
        ("pcie_link_width_current", "pcie_width_min_lanes", min),
        ("pcie_link_gen_current", "pcie_gen_min", min),
    ):
        v = vals(attr)
        if v:
            m[name] = agg(v)
    energy = vals("total_energy_mj")
    if energy:
        m["energy_j"] = sum(energy) / 1000.0
    m["remapped_rows_pending_count"] = sum(1 for g in gpus if g.remapped_rows_pending)
    m["remapped_rows_failure_count"] = sum(1 for g in gpus if g.remapped_rows_failure)
    m["retired_pages_total"] = sum((g.retired_pages_sbe or 0) + (g.retired_pages_dbe or 0)
                                   for g in gpus)
    m["throttle_hw_count"] = sum(1 for g in gpus if _confirmed_hw(g))
    links = [s for g in gpus for s in (g.nvlink_state or ())]
    if any(g.nvlink_state is not None for g in gpus):
        m["nvlink_up_count"] = sum(1 for s in links if s)
        m["nvlink_down_count"] = sum(1 for s in links if s is False)
    for attr in ("ecc_sram_uncorrected_volatile", "ecc_dram_uncorrected_volatile",
                 "ecc_sram_corrected_volatile", "ecc_dram_corrected_volatile"):
        v = vals(attr)
        if v:
            m[f"{attr}_total"] = sum(v)
    low = [h.get("low", 0) + h.get("none", 0) for g in gpus if (h := g.row_remap_histogram)]
    if low:
        m["row_remap_low_banks_max"] = max(low)
    fab = [g for g in gpus if g.fabric_state is not None]
    if fab:
        m["fabric_not_completed_count"] = sum(
            1 for g in fab if g.fabric_state != FABRIC_COMPLETED or (g.fabric_status or 0) != 0)
    for g in gpus:
        shares = fabric.throttle_shares(g, facts.baselines.get(fabric.gpu_key(g)),
                                        throttle_min_interval_s)
        for name in ("power", "thermal"):
            if name in shares:
                key = f"throttle_{name}_pct_max"
                m[key] = max(m.get(key, 0.0), shares[name])
    m["processes_count"] = sum(len(_leftovers(g, facts)[0]) for g in gpus)
    if facts.job_pids:
        m["job_processes_count"] = len(facts.job_pids)
    return m


def _components(gpus: list[GPUInfo], facts: GPUFacts, window_s: float) -> tuple[dict[str, object], ...]:
    """One entry per GPU (labels gpu/uuid/pci_bus_id/model, its NVML readings and its XIDs
    within the window) for the per-GPU Prometheus series; None readings are left out."""
    xids: dict[str, list[int]] = {}
    # The last XID per GPU that bv drains for (its line decides for 154 and 144-150, so the
    # code alone cannot tell a rule in Prometheus): the reset alert reads this, not a code list.
    critical: dict[str, int] = {}
    for x in facts.xids if facts.xid_source is not None else ():
        verdict = xid_verdict(x.code, x.line)
        if _xid_counts(x, verdict, facts, window_s):
            xids.setdefault(x.bus, []).append(x.code)
            if verdict is not None and verdict[0] is Status.CRITICAL:
                critical[x.bus] = x.code
    out: list[dict[str, object]] = []
    for g in gpus:
        values: dict[str, float | None] = {
            attr: getattr(g, attr) for attr in (
                "temperature_c", "power_w", "power_limit_w", "ecc_uncorrected_volatile",
                "ecc_uncorrected_aggregate", "retired_pages_sbe", "retired_pages_dbe",
                "retired_pages_pending", "remapped_rows_correctable",
                "remapped_rows_uncorrectable", "remapped_rows_pending", "remapped_rows_failure",
                "clocks_event_reasons", "pcie_link_gen_current", "pcie_link_width_current",
                "memory_used_bytes", "memory_total_bytes", "persistence_mode",
                "ecc_sram_uncorrected_volatile", "ecc_dram_uncorrected_volatile",
                "ecc_sram_corrected_volatile", "ecc_dram_corrected_volatile",
                "app_clock_sm_mhz", "app_clock_mem_mhz")}
        if g.nvlink_state is not None:
            values["nvlink_up_count"] = sum(1 for s in g.nvlink_state if s)
            values["nvlink_down_count"] = sum(1 for s in g.nvlink_state if s is False)
        for name in NVLINK_COUNTERS:
            per_link = [e[name] for e in g.nvlink_errors or () if e is not None and name in e]
            if per_link:
                values[f"nvlink_{name}_total"] = sum(per_link)
        values["fabric_state"] = g.fabric_state
        if g.total_energy_mj is not None:
            values["energy_j"] = g.total_energy_mj / 1000.0
        if facts.xid_source is not None:
            codes = xids.get(g.bus or "", [])
            values["xid_count"] = len(codes)
            values["xid_last"] = codes[-1] if codes else 0
            values["xid_critical_last"] = critical.get(g.bus or "", 0)
            values["xid_fallen_off_bus"] = 1 if 79 in codes else 0
        values["processes_count"] = len(_leftovers(g, facts)[0])
        out.append({"kind": "gpu",
                    "labels": {"gpu": str(g.index), "uuid": g.uuid, "pci_bus_id": g.pci_bus_id,
                               "model": g.name},
                    "values": {k: v for k, v in values.items() if v is not None}})
    # A GPU that fell off the bus logs XID 79 and NVML stops listing it: its XIDs go on a
    # series of its PCI address alone, or no per-GPU series would carry them to an alert.
    listed = {g.bus for g in gpus if g.bus}
    for x in facts.xids if facts.xid_source is not None else ():
        if x.bus in xids and x.bus not in listed:
            codes = xids[x.bus]
            listed.add(x.bus)
            out.append({"kind": "gpu", "labels": {"pci_bus_id": _nvml_pci(x.pci)},
                        "values": {"xid_count": len(codes), "xid_last": codes[-1],
                                   "xid_critical_last": critical.get(x.bus, 0),
                                   "xid_fallen_off_bus": 1 if 79 in codes else 0}})
    return tuple(out)


def _nvml_pci(pci: str) -> str:
    """The kernel's `0000:5d:00` (an XID line's) in NVML's form `00000000:5D:00.0`, so a GPU's
    series keep one pci_bus_id before and after it leaves NVML's list; other forms unchanged."""
    parts = pci.split(":")
    if len(parts) != 3 or not all(parts):
        return pci
    dom, bus, dev = parts
    try:
        return f"{int(dom, 16):08X}:{bus.upper()}:{dev.upper()}{'' if '.' in dev else '.0'}"
    except ValueError:
        return pci


def gpu_timed_out(seconds: float, cls: NodeClass) -> CheckResult:
    """The runner killed the gpu check at its timeout: NVML hung (a probe only reads NVML and
    the kernel log). On a class with GPUs the node cannot run a job: CRITICAL."""
    if cls.gpus > 0:
        return CheckResult("gpu", Status.CRITICAL, f"NVML timed out after {seconds:g} s")
    return CheckResult("gpu", Status.UNKNOWN, f"timed out after {seconds:g} s, killed")


@check("gpu", probe=probe_gpu, on_timeout=gpu_timed_out)
def evaluate_gpu(facts: GPUFacts, cls: NodeClass) -> CheckResult:
    """GPU count and model, ECC, row remapping, temperature, throttling, PCIe, processes, XIDs."""
    if facts.skipped:
        return CheckResult("gpu", Status.OK, "no GPUs expected", {"gpus_count": 0})
    if facts.init_error is not None:
        if cls.gpus > 0:  # the node's GPU stack is broken: no job can use a GPU here
            return CheckResult("gpu", Status.CRITICAL, f"NVML: {facts.init_error}",
                               {"gpus_count": 0})
        return CheckResult("gpu", Status.UNKNOWN, f"NVML: {facts.init_error}")
    if facts.error or facts.snapshot is None:
        return CheckResult("gpu", Status.UNKNOWN, f"NVML unavailable: {facts.error}")
    snap = facts.snapshot
    usable = [g for g in snap.gpus if g.error is None]
    lost = [g for g in snap.gpus if g.error is not None]
    problems: list[tuple[Status, str]] = []
    if len(usable) < cls.gpus:
        why = f"; {', '.join(f'{g.label}: {g.error}' for g in lost)}" if lost else ""
        problems.append((Status.CRITICAL, f"{len(usable)} of {cls.gpus} GPUs visible{why}"))
    elif len(usable) > cls.gpus:
        problems.append((Status.WARNING, f"{len(usable)} GPUs visible, class has {cls.gpus}"))
    for g in usable:
        problems += _gpu_problems(g, cls, facts)
    problems += fabric.nvlink_unreported_problems(usable, cls.gpu, facts.live)
    xid_problems, counted, old = _xid_problems(facts, usable, cls.gpu.xid_window_s)
    problems += xid_problems
    sxid_problems, sxids = fabric.sxid_problems(facts.sxids, facts.uptime_s, cls.gpu.xid_window_s)
    problems += sxid_problems
    metrics = _metrics(usable, counted, facts, cls.gpu.throttle_min_interval_s)
    metrics["xid_outside_window_count"] = old
    if facts.xid_source is not None:
        metrics["sxid_count"] = sxids
    status, summary = summarize(problems)
    if summary is None:
        model = usable[0].name if usable else "GPU"
        temp = f", max {metrics['temp_max_c']:g} C" if "temp_max_c" in metrics else ""
        drv = f", driver {snap.driver_version}" if snap.driver_version else ""
        links = (f", {metrics['nvlink_up_count']:g} NVLinks up"
                 if metrics.get("nvlink_up_count") else "")
        missing = fabric.not_reported(usable, cls.gpu)
        unsup = f"; not reported by NVML: {', '.join(missing)}" if missing else ""
        summary = f"{len(usable)} x {model} OK{temp}{drv}{links}{unsup}"
    return CheckResult("gpu", status, summary, metrics,
                       components=_components(usable, facts, cls.gpu.xid_window_s))
