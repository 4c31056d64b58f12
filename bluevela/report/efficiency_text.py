"""The terminal summary of a job's efficiency (`bv archive show JOB --efficiency`): the job's
figures in a few lines; the stragglers follow in a table (`cli/cmd_archive.py`). Durations in
the pages' words (`report/page.fmt_duration`, `?` when unknown).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from bluevela.report.page import fmt_duration as _fmt_duration

if TYPE_CHECKING:
    from bluevela.report.efficiency_model import Efficiency


def fmt_duration(s: float | None) -> str:
    """`12 s`, `7 min`, `3.5 h`; `?` when unknown."""
    return _fmt_duration(s, "?")


def summary_lines(eff: Efficiency) -> list[str]:
    """The terminal summary: the job's figures in a few lines (stragglers go in a table)."""
    d = eff.to_dict()
    g, cpu, en, rs = d["gpu"], d["cpu"], d["energy"], d["restarts"]
    lines = [f"job {eff.job_id}: {len(eff.nodes)} node(s) x {eff.n_gpus} GPU(s), "
             f"{fmt_duration(eff.duration_s)} at {eff.interval_s:g} s ({eff.n_samples} samples); "
             f"steady state {fmt_duration(d['steady']['samples'] * eff.interval_s)} "
             f"(by {d['steady']['basis']})"]
    if g:
        lines.append(f"GPU util {g['util_steady_pct']}% steady, {g['util_mean_pct']}% whole job; "
                     f"power {g['power_steady_w']} W per GPU, {g['power_total_steady_kw']} kW "
                     f"the job; SM clock {g['sm_clock_steady_mhz']} MHz")
    parts = []
    if en["series_kwh"] is not None:
        parts.append(f"GPU energy {en['series_kwh']} kWh from the samples "
                     f"({en['series_coverage']:.0%} covered)")
    if en["epilog_j"] is not None:
        parts.append(f"{en['epilog_j'] / 3.6e6:.3f} kWh from the epilogs' NVML counters "
                     f"({en['epilog_nodes']} node(s))")
    if parts:
        lines.append("; ".join(parts))
    if cpu["busy_mean_pct"] is not None:
        lines.append(f"CPU busy {cpu['busy_mean_pct']}%, throttled {cpu['throttled_mean_pct']}%"
                     " of the time")
    if eff.idle_gpus:
        shown = ", ".join(f"{x['node']} GPU {x['gpu']}" for x in eff.idle_gpus[:6])
        more = f" (+{len(eff.idle_gpus) - 6})" if len(eff.idle_gpus) > 6 else ""
        lines.append(f"idle GPUs: {len(eff.idle_gpus)}: {shown}{more}")
    if rs.get("requeues"):
        lines.append(f"restarts: {rs['requeues']} requeue(s) (archive) + {len(rs['gaps'])} "
                     f"gap(s) inside attempts, {fmt_duration(rs['lost_s'])} lost "
                     f"({rs['lost_unit_h']} {rs.get('unit', 'GPU')} h)")
    elif rs["count"]:
        lines.append(f"restarts: {rs['count']} gap(s), {fmt_duration(rs['lost_s'])} lost "
                     f"({rs['lost_unit_h']} {rs.get('unit', 'GPU')} h; approximate, from the "
                     "series)")
    if rs["stalls"]:
        lines.append(f"stalls (job-wide idle < {fmt_duration(eff.thresholds.gap_min_s)}, e.g. "
                     f"checkpoints): {rs['stalls']}, {fmt_duration(rs['stalls_s'])} in all")
    for m in eff.missing[:10]:
        lines.append(f"no verdict on {m['node']}: {m['why']}")
    if len(eff.missing) > 10:
        lines.append(f"no verdict on {len(eff.missing) - 10} more node(s)")
    lines.extend(eff.notes)
    n = len(eff.straggler_nodes)
    lines.append(f"stragglers: {n} node(s)" + (":" if n else " (every GPU and node within "
                                               "the thresholds of the job's median)"))
    return lines
