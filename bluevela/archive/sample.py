"""Synthetic node reports in the spool format, for tests, benchmarks and the docs' examples.

The shape follows `bluevela.archive.spool` (schema 1) and the quick health tier of an
8x H100 node (checks gpu, ib, node; metrics and telemetry named `<what>_<unit>`). Values are
deterministic functions of (job, node, phase) so that a test can recompute what it stored.
"""

from __future__ import annotations

import functools
import zlib
from typing import Any

GPU_TELEMETRY = (
    "gpu_energy_j", "gpu_temp_max_c", "gpu_ecc_corrected_delta_count",
    "gpu_ecc_uncorrected_delta_count", "gpu_row_remap_delta_count", "gpu_xid_count",
    "ib_symbol_error_delta_count", "ib_link_downed_delta_count",
    "ib_port_rcv_errors_delta_count", "ib_rcv_data_delta_bytes", "ib_xmit_data_delta_bytes",
)


def _val(*parts: object) -> int:
    return zlib.crc32("/".join(map(str, parts)).encode())


@functools.lru_cache(maxsize=16)
def _expand(hostlist_expr: str) -> tuple[str, ...]:
    import hostlist

    return tuple(hostlist.expand_hostlist(hostlist_expr))


def sample_report(job_id: int, node: str, phase: str, *,
                  nodelist: list[str] | str | None = None,
                  time: float = 1.7e9, user: str = "alice", partition: str = "gpu",
                  exit_code: int = 0, status_code: int = 0) -> dict[str, Any]:
    """A realistic prolog or epilog report of `node` for `job_id` (without schema/kind).

    `nodelist` may be a hostlist expression (what SLURM_JOB_NODELIST holds); it is then
    written as such.
    """
    nodes = _expand(nodelist) if isinstance(nodelist, str) else (nodelist or [node])
    h = _val(job_id, node, phase)
    checks: list[dict[str, Any]] = [
        {"name": "gpu", "status_code": status_code,
         "status": ("OK", "WARNING", "CRITICAL", "UNKNOWN")[status_code],
         "summary": f"8 GPUs, max {40 + h % 40} C, no uncorrected ECC", "duration_s": 0.41,
         "metrics": {"gpu_count": 8, "temp_max_c": 40 + h % 40, "retired_pages_count": h % 3,
                     "ecc_uncorrected_volatile_count": 0}},
        {"name": "ib", "status_code": 0, "status": "OK", "summary": "8/8 ports ACTIVE at 400 Gb/s",
         "duration_s": 0.05,
         "metrics": {"ports_active_count": 8, "rate_min_gbps": 400.0,
                     "symbol_error_count": h % 7}},
        {"name": "node", "status_code": 0, "status": "OK", "summary": "memory and /tmp OK",
         "duration_s": 0.01,
         "metrics": {"mem_available_gib": 1800.5 - h % 100, "tmp_free_gib": 812.0}},
    ]
    worst = max(int(c["status_code"]) for c in checks)
    report: dict[str, Any] = {
        "job_id": job_id, "node": node, "phase": phase, "user": user, "partition": partition,
        "num_nodes": len(nodes), "nodelist": nodelist if nodelist is not None else nodes,
        "time": time,
        "health": {"status_code": worst, "status": ("OK", "WARNING", "CRITICAL", "UNKNOWN")[worst],
                   "tier": "quick", "duration_s": 0.47, "checks": checks},
        "drained": False, "drain_reason": None,
        "exit_code": None, "exit_signal": None, "derived_exit_code": None, "telemetry": {},
    }
    if phase == "epilog":
        report.update(exit_code=exit_code, exit_signal=0, derived_exit_code=exit_code)
        report["telemetry"] = {k: float(_val(job_id, node, k) % 100000) for k in GPU_TELEMETRY}
    return report
