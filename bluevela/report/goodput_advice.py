"""Advice from a job's goodput ledger (bluevela/report/goodput.py): the checkpoint interval
(Young/Daly, from the job's measured checkpoint cost and the node class's MTBF in the
fleet's history) and the number of hot spares that maximises expected goodput
(docs/resilience.md, "The goodput ledger"). Pure functions; `fleet_advice`, which feeds
`advise` the fleet report's MTBF, is report/fleet_advice.py (above both).
"""

from __future__ import annotations

import math
from typing import Any

from bluevela.report.goodput import Ledger


def young_interval(cost_s: float, mtbf_s: float) -> float:
    """Young (1974): the interval between checkpoints that minimises the expected loss,
    sqrt(2 C M), for a checkpoint cost C and a mean time between failures M."""
    return math.sqrt(2.0 * cost_s * mtbf_s)


def daly_interval(cost_s: float, mtbf_s: float) -> float:
    """Daly (2006), the higher-order optimum: sqrt(2CM) [1 + sqrt(C/2M)/3 + C/(18M)] - C
    for C < 2M, else M."""
    if cost_s >= 2.0 * mtbf_s:
        return mtbf_s
    r = math.sqrt(cost_s / (2.0 * mtbf_s))
    return math.sqrt(2.0 * cost_s * mtbf_s) * (1.0 + r / 3.0 + cost_s / (18.0 * mtbf_s)) - cost_s


def expected_waste_fraction(interval_s: float, cost_s: float, restart_s: float,
                            mtbf_s: float) -> float:
    """The first-order share of time lost: C/tau (saving) + (tau + C)/(2M) (re-done work,
    half an interval per failure on average) + R/M (detection, teardown, restart)."""
    if interval_s <= 0 or mtbf_s <= 0:
        return 1.0
    return min(1.0, cost_s / interval_s + (interval_s + cost_s) / (2.0 * mtbf_s)
               + restart_s / mtbf_s)


MIN_FAILURES = 5  # fewer failures observed: the fleet's MTBF is "too short a history to trust"


def interval_advice(cost_s: float | None, used_interval_s: float | None, node_mtbf_s: float | None,
                    failures_seen: int, nodes: int, restart_s: float, job_s: float,
                    gpus: int) -> dict[str, Any]:
    """The checkpoint interval to use for a job of `nodes` nodes: the job's MTBF is the
    node MTBF over the node count (independent failures)."""
    out: dict[str, Any] = {"model": "Young/Daly", "checkpoint_cost_s": cost_s,
                           "interval_used_s": used_interval_s, "node_mtbf_s": node_mtbf_s,
                           "failures_seen": failures_seen, "min_failures": MIN_FAILURES,
                           "nodes": nodes, "restart_s": restart_s}
    if cost_s is None:
        out["verdict"] = "no advice: the job recorded no checkpoint (its cost is unknown)"
        return out
    if node_mtbf_s is None or nodes < 1:
        out["verdict"] = ("no advice: no failure of this node class in the fleet's history "
                          "(too short to measure an MTBF)")
        return out
    job_mtbf = node_mtbf_s / nodes
    tau_y, tau_d = young_interval(cost_s, job_mtbf), daly_interval(cost_s, job_mtbf)
    out.update({"job_mtbf_s": job_mtbf, "young_interval_s": tau_y, "daly_interval_s": tau_d,
                "trust": failures_seen >= MIN_FAILURES})
    if used_interval_s:
        w_used = expected_waste_fraction(used_interval_s, cost_s, restart_s, job_mtbf)
        w_best = expected_waste_fraction(tau_d, cost_s, restart_s, job_mtbf)
        out["expected_waste_used"] = w_used
        out["expected_waste_daly"] = w_best
        out["gpu_hours_saved"] = max(0.0, (w_used - w_best) * job_s * nodes * gpus / 3600.0)
        out["node_hours_saved"] = max(0.0, (w_used - w_best) * job_s * nodes / 3600.0)
    out["verdict"] = (f"checkpoint every {tau_d:.0f} s (Daly; Young {tau_y:.0f} s)"
                      + ("" if out["trust"] else f": only {failures_seen} failure(s) in the "
                         f"fleet's history, fewer than {MIN_FAILURES}: too short to trust"))
    return out


def spare_advice(nodes: int, node_mtbf_s: float, job_s: float, *, spare_swap_s: float = 5.0,
                 requeue_s: float = 120.0, startup_s: float = 60.0, max_spares: int = 8
                 ) -> dict[str, Any]:
    """The number of hot spares that maximises expected goodput for a job of `nodes` nodes
    and `job_s` seconds of work. The job sees K ~ Poisson(n T / M) node failures; the first
    s of them cost `spare_swap_s` each (a spare in the allocation), the rest a requeue hold
    plus start-up each; every spare is allocated (and idle) for the whole run:

        E[loss(s)] = E[min(K, s)] * swap + E[max(K - s, 0)] * (requeue + start-up)
        G(s) = (T n) / ((T + E[loss(s)]) (n + s))

    (the useful node-seconds over the node-seconds allocated). Re-done work is the same
    with or without spares and is left out.
    """
    from math import exp, factorial

    lam = nodes * job_s / node_mtbf_s if node_mtbf_s > 0 else 0.0
    rows = []
    for s in range(max_spares + 1):
        # E[min(K, s)] and E[max(K - s, 0)] for K ~ Poisson(lam)
        p_k = [exp(-lam) * lam**k / factorial(k) for k in range(s + 1)]
        e_min = sum(k * p for k, p in enumerate(p_k)) + s * max(0.0, 1.0 - sum(p_k))
        e_over = max(0.0, lam - e_min)
        loss = e_min * spare_swap_s + e_over * (requeue_s + startup_s)
        goodput = (job_s * nodes) / ((job_s + loss) * (nodes + s))
        rows.append({"spares": s, "expected_failures_covered": e_min,
                     "expected_requeues": e_over, "expected_loss_s": loss,
                     "expected_goodput": goodput})
    best = max(rows, key=lambda r: r["expected_goodput"])
    return {"model": "Poisson failures, spare swap vs requeue", "expected_failures": lam,
            "spare_swap_s": spare_swap_s, "requeue_s": requeue_s, "startup_s": startup_s,
            "best_spares": best["spares"], "table": rows}


def advise(ledger: Ledger, node_mtbf_h: float | None, failures_seen: int) -> dict[str, Any]:
    """The checkpoint-interval and spare advice for this job (pure): its measured
    checkpoint cost, interval and interruption cost, the class's node MTBF."""
    restart_s = (sum(i.lost_s - i.redone_s for i in ledger.interruptions)
                 / len(ledger.interruptions)) if ledger.interruptions else 0.0
    out = interval_advice(ledger.checkpoint_mean_s, ledger.checkpoint_interval_s,
                          node_mtbf_h * 3600.0 if node_mtbf_h else None, failures_seen,
                          max(ledger.nodes, 1), restart_s, ledger.phases["productive"],
                          ledger.gpus_per_node)
    if node_mtbf_h:
        starts = ledger.phases["startup"] / max(1, len(ledger.interruptions) + 1)
        sp = spare_advice(max(ledger.nodes, 1), node_mtbf_h * 3600.0,
                          max(ledger.phases["productive"], 1.0), startup_s=starts)
        out["spares"] = {k: sp[k] for k in ("best_spares", "expected_failures", "model",
                                            "spare_swap_s", "requeue_s", "startup_s")}
    return out

