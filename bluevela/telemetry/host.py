"""The sampler's InfiniBand and node columns, read from sysfs and /proc under a root.

- IB ports: `<BV_SYSFS_ROOT>/sys/class/infiniband` as `checks/ib.py` reads it; byte rates from
  `port_rcv_data`/`port_xmit_data` (4-byte words), errors/s from the increase of the error
  counters (every `counters/` file but data, packets and xmit_wait).
- Node: `/proc/stat` (CPU busy share), `/proc/meminfo` (MemTotal - MemAvailable),
  `/proc/net/dev` (non-lo interfaces of the sampler's network namespace), each read under
  `BV_SYSFS_ROOT` when the fixture tree has the file, else from the real /proc. With a cgroup
  directory (`BV_SAMPLER_CGROUP`), CPU busy and throttled come from that cgroup: v2 `cpu.stat`
  (usage_usec, nr_periods, nr_throttled); v1 `cpuacct.usage` (in the directory or the same
  path under the `cpuacct` hierarchy) and the `cpu` controller's `cpu.stat`.

Rates are per second between two readings: NaN at the first one and after a counter reset.
Standard library only.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

NAN = float("nan")
IB_UNITS = (("rx_bytes_per_s", "B/s"), ("tx_bytes_per_s", "B/s"), ("errors_per_s", "1/s"))
NODE_UNITS = (("cpu_busy_pct", "%"), ("cpu_throttled_pct", "%"), ("mem_used_bytes", "B"),
              ("net_rx_bytes_per_s", "B/s"), ("net_tx_bytes_per_s", "B/s"))
_NOT_ERRORS = ("data", "packets", "xmit_wait")


def _rate(cur: float | None, prev: float | None, dt: float, scale: float = 1.0) -> float:
    """Increase per second; NaN without a previous reading or after a reset."""
    if cur is None or prev is None or dt <= 0 or cur < prev:
        return NAN
    return (cur - prev) * scale / dt


# -- IB ports ---------------------------------------------------------------------------------


class IBReader:
    """Byte and error rates per port from sysfs, as the ib check reads it."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.prev: dict[str, tuple[float, dict[str, int]]] = {}

    def read(self, now: float) -> list[tuple[str, dict[str, float]]]:
        from bluevela.health.checks.ib import list_ports, read_port

        try:
            ports = list_ports(self.root)
        except OSError:
            return []
        out = []
        for port in ports:
            facts = read_port(self.root, port)
            if not facts.present or facts.error:
                continue
            c = facts.counters
            before = self.prev.get(port)
            self.prev[port] = (now, dict(c))
            if before is None:
                out.append((port, dict.fromkeys(("rx_bytes_per_s", "tx_bytes_per_s",
                                                 "errors_per_s"), NAN)))
                continue
            t0, p = before
            dt = now - t0
            errs = [k for k in c if not any(s in k for s in _NOT_ERRORS)]
            if all(k in p and c[k] >= p[k] for k in errs) and dt > 0:
                err_rate = sum(c[k] - p[k] for k in errs) / dt
            else:
                err_rate = NAN
            out.append((port, {
                "rx_bytes_per_s": _rate(c.get("port_rcv_data"), p.get("port_rcv_data"), dt, 4.0),
                "tx_bytes_per_s": _rate(c.get("port_xmit_data"), p.get("port_xmit_data"), dt, 4.0),
                "errors_per_s": err_rate,
            }))
        return out


# -- node -------------------------------------------------------------------------------------


def _read_text(path: Path, limit: int = 1 << 20) -> str:
    with open(path, encoding="ascii", errors="replace") as fh:
        return fh.read(limit)


def _kv(text: str) -> dict[str, int]:
    out = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[1].lstrip("-").isdigit():
            out[parts[0].rstrip(":")] = int(parts[1])
    return out


@dataclass
class CgroupCPU:
    """A CPU cgroup, v1 (cpu + cpuacct, maybe separate hierarchies) or v2."""

    cpu_dir: Path
    usage_file: Path | None = None  # v1 cpuacct.usage (ns)
    v2: bool = False

    @classmethod
    def find(cls, path: Path) -> CgroupCPU:
        stat_text = ""
        try:
            stat_text = _read_text(path / "cpu.stat")
        except OSError:
            pass
        if "usage_usec" in stat_text:
            return cls(path, None, True)
        usage = path / "cpuacct.usage"
        if not usage.exists():
            # v1 with cpu and cpuacct mounted apart: the same path in the cpuacct hierarchy.
            parts = list(path.parts)
            for i, part in enumerate(parts):
                if part == "cpu":
                    cand = Path(*parts[:i], "cpuacct", *parts[i + 1:]) / "cpuacct.usage"
                    if cand.exists():
                        usage = cand
                        break
        return cls(path, usage, False)

    def read(self) -> tuple[float | None, float | None, float | None]:
        """(usage seconds, periods, throttled periods); None where unreadable."""
        try:
            st = _kv(_read_text(self.cpu_dir / "cpu.stat"))
        except OSError:
            st = {}
        usage: float | None = None
        if self.v2:
            usage = st["usage_usec"] / 1e6 if "usage_usec" in st else None
        elif self.usage_file is not None:
            try:
                usage = int(_read_text(self.usage_file).strip()) / 1e9
            except (OSError, ValueError):
                usage = None
        periods = st.get("nr_periods")
        throttled = st.get("nr_throttled")
        return usage, (float(periods) if periods is not None else None), \
            (float(throttled) if throttled is not None else None)


@dataclass
class NodeReader:
    root: Path
    cgroup: CgroupCPU | None = None
    ncpu: int = field(default_factory=lambda: len(os.sched_getaffinity(0)) or 1)
    prev: dict[str, float] = field(default_factory=dict)
    prev_t: float | None = None

    def _proc(self, name: str) -> Path:
        under = self.root / "proc" / name
        if str(self.root) != "/" and under.exists():
            return under
        return Path("/proc") / name

    @property
    def cpu_source(self) -> str:
        """Where CPU busy/throttled come from, as the segment header records it."""
        if self.cgroup is not None:
            return f"cgroup{' v2' if self.cgroup.v2 else ' v1'} {self.cgroup.cpu_dir}"
        return f"proc {self._proc('stat')}"

    def read(self, now: float) -> dict[str, float]:
        cur: dict[str, float] = {}
        if self.cgroup is not None:
            usage, periods, throttled = self.cgroup.read()
            if usage is not None:
                cur["cg_usage"] = usage
            if periods is not None and throttled is not None:
                cur["cg_periods"], cur["cg_throttled"] = periods, throttled
        else:
            try:
                first = _read_text(self._proc("stat"), 4096).splitlines()[0].split()
                ticks = [int(x) for x in first[1:9]]
                cur["cpu_total"] = float(sum(ticks))
                cur["cpu_idle"] = float(ticks[3] + ticks[4])
            except (OSError, IndexError, ValueError):
                pass
        try:
            dev = _read_text(self._proc("net/dev"))
            rx = tx = 0
            for line in dev.splitlines()[2:]:
                name, _, rest = line.partition(":")
                f = rest.split()
                if name.strip() != "lo" and len(f) >= 9:
                    rx += int(f[0])
                    tx += int(f[8])
            cur["net_rx"], cur["net_tx"] = float(rx), float(tx)
        except (OSError, ValueError):
            pass
        out = dict.fromkeys((k for k, _ in NODE_UNITS), NAN)
        try:
            mem = _kv(_read_text(self._proc("meminfo")))
            out["mem_used_bytes"] = float((mem["MemTotal"] - mem["MemAvailable"]) * 1024)
        except (OSError, KeyError):
            pass
        p, dt = self.prev, (now - self.prev_t) if self.prev_t is not None else 0.0
        if dt > 0:
            if "cg_usage" in cur and "cg_usage" in p:
                busy = _rate(cur["cg_usage"], p["cg_usage"], dt)
                out["cpu_busy_pct"] = busy * 100.0 / self.ncpu
            if "cg_periods" in cur and "cg_periods" in p:
                dp = cur["cg_periods"] - p["cg_periods"]
                dtr = cur["cg_throttled"] - p["cg_throttled"]
                out["cpu_throttled_pct"] = 100.0 * dtr / dp if dp > 0 and dtr >= 0 else 0.0
            if "cpu_total" in cur and "cpu_total" in p:
                total = cur["cpu_total"] - p["cpu_total"]
                idle = cur["cpu_idle"] - p["cpu_idle"]
                if total > 0:
                    out["cpu_busy_pct"] = 100.0 * (total - idle) / total
                    out["cpu_throttled_pct"] = 0.0  # no cap outside a cgroup
            out["net_rx_bytes_per_s"] = _rate(cur.get("net_rx"), p.get("net_rx"), dt)
            out["net_tx_bytes_per_s"] = _rate(cur.get("net_tx"), p.get("net_tx"), dt)
        self.prev, self.prev_t = cur, now
        return out
