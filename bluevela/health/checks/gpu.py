"""`gpu`: NVML values (live through pynvml, or a replayed snapshot) and XIDs.

CRITICAL: fewer GPUs than the class has, a different model, volatile uncorrected ECC errors
over the ceiling, a row remap pending or failed, retired pages over NVIDIA's RMA ceiling,
temperature over the class's maximum, a hardware slowdown (HW slowdown / HW thermal / HW power
brake), a PCIe link narrower than its maximum width, leftover compute processes at prolog or
healthcheck time, or a fatal XID (48 DBE, 64 row-remap failure, 79 fallen off the bus, 95
uncontained ECC) in the kernel log.
WARNING: more GPUs than expected, aggregate (lifetime) uncorrected ECC over the ceiling,
retired pages pending, software thermal slowdown, a PCIe link whose maximum generation is
below the GPU's, persistence mode off, any other XID.
A PCIe link running below its maximum generation is normal when the GPU idles (power saving),
so the current generation is only reported. NVML unavailable is UNKNOWN (could not run).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from bluevela.health.nvml import (
    HW_REASONS,
    SW_THERMAL,
    GPUInfo,
    NVMLSnapshot,
    Xid,
    load_snapshot,
    parse_snapshot,
    parse_xids,
    reason_names,
)
from bluevela.health.registry import check
from bluevela.health.result import CheckResult, Status, summarize

if TYPE_CHECKING:
    from bluevela.health.context import ProbeContext
    from bluevela.site import NodeClass

logger = logging.getLogger(__name__)

FATAL_XIDS = frozenset({48, 64, 79, 95})
# Processes are leftovers only where no job of ours should be running.
PROCESS_PHASES = frozenset({"prolog", "healthcheck"})


@dataclass(frozen=True)
class GPUFacts:
    snapshot: NVMLSnapshot | None
    xids: tuple[Xid, ...] = ()
    xid_source: str | None = None  # None: no kernel log could be read
    phase: str = "manual"
    error: str | None = None  # NVML could not be used at all
    skipped: bool = False  # the class has no GPUs and no snapshot was given


def _kmsg_lines(ctx: ProbeContext, snap: NVMLSnapshot | None) -> tuple[list[str] | None, str | None]:
    if ctx.kmsg is not None:
        try:
            with open(ctx.kmsg, encoding="utf-8", errors="replace") as fh:
                return [ln for ln in fh if "NVRM" in ln], str(ctx.kmsg)
        except OSError as exc:
            logger.info("cannot read %s: %s", ctx.kmsg, exc)
            return None, None
    if snap is not None and ctx.nvml_snapshot is not None:
        return (list(snap.kmsg), "snapshot kmsg") if snap.kmsg is not None else (None, None)
    if snap is not None and snap.kmsg is not None:  # live: gather_live read /dev/kmsg
        return list(snap.kmsg), "/dev/kmsg"
    return None, None


def probe_gpu(ctx: ProbeContext) -> GPUFacts:
    """NVML values from the snapshot (BV_NVML_SNAPSHOT) or live NVML, then XIDs."""
    if ctx.nvml_snapshot is None and ctx.node_class.gpus == 0:
        return GPUFacts(None, phase=ctx.phase, skipped=True)
    snap: NVMLSnapshot | None = None
    try:
        if ctx.nvml_snapshot is not None:
            snap = load_snapshot(ctx.nvml_snapshot)
        else:
            from bluevela.health.nvml import gather_live

            snap = parse_snapshot(gather_live(include_kmsg=ctx.kmsg is None), "live NVML")
    except ImportError:
        return GPUFacts(None, phase=ctx.phase, error="pynvml is not installed (nvidia-ml-py)")
    except (OSError, ValueError, RuntimeError) as exc:
        return GPUFacts(None, phase=ctx.phase, error=f"{type(exc).__name__}: {exc}")
    lines, source = _kmsg_lines(ctx, snap)
    return GPUFacts(snap, tuple(parse_xids(lines)), source, ctx.phase)


def _gpu_problems(g: GPUInfo, cls: NodeClass, phase: str) -> list[tuple[Status, str]]:
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
    reasons = g.clocks_event_reasons or 0
    if reasons & HW_REASONS:
        p.append((Status.CRITICAL, f"{lab} throttled: {','.join(reason_names(reasons & HW_REASONS))}"))
    elif reasons & SW_THERMAL:
        p.append((Status.WARNING, f"{lab} throttled: sw_thermal_slowdown"))
    cw, mw = g.pcie_link_width_current, g.pcie_link_width_max
    if cw is not None and mw is not None and cw < mw:
        p.append((Status.CRITICAL, f"{lab} PCIe x{cw} (max x{mw})"))
    lg, gg = g.pcie_link_gen_max, g.pcie_link_gen_gpu_max
    if lg is not None and gg is not None and lg < gg:
        p.append((Status.WARNING, f"{lab} PCIe link max Gen{lg} < GPU Gen{gg}"))
    if phase in PROCESS_PHASES and not t.allow_leftover_processes and g.compute_processes:
        pids = ",".join(str(x.pid) for x in g.compute_processes[:4])
        p.append((Status.CRITICAL, f"{lab} {len(g.compute_processes)} leftover process(es) "
                  f"(pid {pids})"))
    if t.require_persistence_mode and g.persistence_mode is False:
        p.append((Status.WARNING, f"{lab} persistence mode off"))
    return p


def _metrics(gpus: list[GPUInfo], xids: tuple[Xid, ...]) -> dict[str, float]:
    m: dict[str, float] = {"gpus_count": len(gpus), "xid_count": len(xids)}

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
    m["throttle_hw_count"] = sum(1 for g in gpus if (g.clocks_event_reasons or 0) & HW_REASONS)
    m["processes_count"] = sum(len(g.compute_processes or ()) for g in gpus)
    return m


@check("gpu", probe=probe_gpu)
def evaluate_gpu(facts: GPUFacts, cls: NodeClass) -> CheckResult:
    """GPU count and model, ECC, row remapping, temperature, throttling, PCIe, processes, XIDs."""
    if facts.skipped:
        return CheckResult("gpu", Status.OK, "no GPUs expected", {"gpus_count": 0})
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
        problems += _gpu_problems(g, cls, facts.phase)
    by_bus = {g.bus: g.label for g in usable if g.bus}
    seen: set[tuple[str, int]] = set()
    for x in facts.xids:
        if (x.bus, x.code) in seen:
            continue
        seen.add((x.bus, x.code))
        where = by_bus.get(x.bus, f"PCI {x.pci}")
        status = Status.CRITICAL if x.code in FATAL_XIDS else Status.WARNING
        problems.append((status, f"XID {x.code} on {where}"))
    metrics = _metrics(usable, facts.xids)
    status, summary = summarize(problems)
    if summary is None:
        model = usable[0].name if usable else "GPU"
        temp = f", max {metrics['temp_max_c']:g} C" if "temp_max_c" in metrics else ""
        drv = f", driver {snap.driver_version}" if snap.driver_version else ""
        summary = f"{len(usable)} x {model} OK{temp}{drv}"
    return CheckResult("gpu", status, summary, metrics)
