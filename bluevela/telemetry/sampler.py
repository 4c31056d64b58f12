"""The node sampler: `python -I -m bluevela.telemetry.sampler` (systemd `bv-sampler.service`).

Every `telemetry.interval_s` (site.yaml; `BV_SAMPLER_INTERVAL_S` overrides it, e.g. in the dev
cluster's hook.env) it appends one record to `<state>/samples/seg-<unix_start>.bvts`
(`bluevela.telemetry.format`): per GPU, per InfiniBand port and for the node. Samples are taken
on multiples of the interval of the wall clock, so every node of a job samples at the same
instants and the archive's common time grid loses nothing.

Sources are the health checks' own probes, so the same fixtures drive both:
- GPUs: the NVML source (`BV_NVML_SNAPSHOT` replayed, else live NVML through pynvml via
  `bluevela.health.nvml.LiveNVML`). Utilisation and the SM clock are not in the health
  snapshot: live NVML reads them here (`live_util_clocks`); a snapshot may carry them as
  optional `util_pct` / `sm_clock_mhz` keys per GPU. XIDs: kernel log lines (`BV_KMSG`, the
  snapshot's `kmsg`, else /dev/kmsg read incrementally), counted per GPU since the sampler
  started.
- IB ports: `<BV_SYSFS_ROOT>/sys/class/infiniband` as `checks/ib.py` reads it; byte rates from
  `port_rcv_data`/`port_xmit_data` (4-byte words), errors/s from the increase of the error
  counters (every `counters/` file but data, packets and xmit_wait).
- Node: `/proc/stat` (CPU busy share), `/proc/meminfo` (MemTotal - MemAvailable),
  `/proc/net/dev` (non-lo interfaces of the sampler's network namespace), each read under
  `BV_SYSFS_ROOT` when the fixture tree has the file, else from the real /proc. With
  `BV_SAMPLER_CGROUP` naming a cgroup directory, CPU busy and throttled come from that cgroup:
  v2 `cpu.stat` (usage_usec, nr_periods, nr_throttled); v1 `cpuacct.usage` (in the directory
  or the same path under the `cpuacct` hierarchy) and the `cpu` controller's `cpu.stat`.

Disk is bounded: a new segment every hour, at every start, when the column set changes and
when the clock steps back; before a new segment is opened, segments dated in the future
(written under a wrong clock) go, then those older than `telemetry.retain_h`, then the oldest
while the directory is over `telemetry.max_mb`. SIGTERM/SIGINT end the loop after the current
sample and close the segment. Only the standard library runs in the loop (no numpy, torch,
h5py).

Faults (docs/install.md, "The node sampler"):
- NVML is read on a thread of its own (`NVMLWorker`) and awaited at most half an interval
  (0.05-10 s). A call that hangs (a GPU fallen off the bus) leaves the GPU columns NaN and
  `node.gpus_missing` / `node.nvml_hung_s` say so per tick; IB and node go on, the log says
  it once, and SIGTERM still ends the sampler.
- A write that fails (ENOSPC) closes and unlinks what it opened, cuts off a partial record,
  and the next attempts back off (1, 2, 4 ... 32 intervals) until one succeeds.
- systemd (Type=notify): READY=1, WATCHDOG=1 from the loop after each completed tick, STATUS=
  on a fault (`Notifier`, the sd_notify datagram protocol; no library).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bluevela.telemetry.format import (
    TMP_SEGMENT_RE,
    Column,
    FormatError,
    Header,
    SegmentWriter,
    list_segments,
    probe_file,
)

if TYPE_CHECKING:
    from bluevela.health.context import ProbeContext
    from bluevela.health.nvml import NVMLSnapshot

logger = logging.getLogger(__name__)

NAN = float("nan")
GPU_UNITS = (("util_pct", "%"), ("mem_used_bytes", "B"), ("power_w", "W"), ("temp_c", "Cel"),
             ("sm_clock_mhz", "MHz"), ("clocks_event_reasons", "bitmask"), ("xid_count", "1"))
IB_UNITS = (("rx_bytes_per_s", "B/s"), ("tx_bytes_per_s", "B/s"), ("errors_per_s", "1/s"))
NODE_UNITS = (("cpu_busy_pct", "%"), ("cpu_throttled_pct", "%"), ("mem_used_bytes", "B"),
              ("net_rx_bytes_per_s", "B/s"), ("net_tx_bytes_per_s", "B/s"))
# Per tick, how NVML fared: GPUs of the node class (or of an earlier reading) that gave no
# values, and how long the NVML call in flight has not returned (0: it answered).
NVML_UNITS = (("gpus_missing", "1"), ("nvml_hung_s", "s"))
# Slack before a segment counts as dated in the future (written under a wrong clock).
FUTURE_SLACK_S = 60.0
# The longest pause between write attempts while the disk is full, in intervals.
MAX_BACKOFF_TICKS = 32
_NOT_ERRORS = ("data", "packets", "xmit_wait")


def _num(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float):
        return NAN
    return float(v)


def _rate(cur: float | None, prev: float | None, dt: float, scale: float = 1.0) -> float:
    """Increase per second; NaN without a previous reading or after a reset."""
    if cur is None or prev is None or dt <= 0 or cur < prev:
        return NAN
    return (cur - prev) * scale / dt


# -- GPUs -------------------------------------------------------------------------------------


def live_util_clocks() -> dict[int, dict[str, float]]:
    """Utilisation (%) and SM clock (MHz) per GPU index from live NVML (not in the health
    snapshot). {} when pynvml is missing or NVML does not start."""
    try:
        import pynvml
    except ImportError:
        return {}
    out: dict[int, dict[str, float]] = {}
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return {}
    try:
        for i in range(pynvml.nvmlDeviceGetCount()):
            vals: dict[str, float] = {}
            try:
                h = pynvml.nvmlDeviceGetHandleByIndex(i)
                vals["util_pct"] = float(pynvml.nvmlDeviceGetUtilizationRates(h).gpu)
                vals["sm_clock_mhz"] = float(pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM))
            except pynvml.NVMLError:
                pass
            out[i] = vals
    except pynvml.NVMLError:
        pass
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass
    return out


class XidCounter:
    """XIDs per PCI bus seen since the sampler started."""

    def __init__(self) -> None:
        self.baseline: set[str] | None = None
        self.counts: dict[str, int] = {}
        self._seen: set[str] = set()
        self._kmsg_fd: int | None = None
        self._kmsg_failed = False

    def add_lines(self, lines: list[str] | tuple[str, ...]) -> None:
        """Lines of a file or snapshot re-read each time: only lines new since the first."""
        from bluevela.health.nvml import parse_xids

        if self.baseline is None:
            self.baseline = set(lines)
            return
        new = [ln for ln in lines if ln not in self.baseline and ln not in self._seen]
        self._seen.update(new)
        for x in parse_xids(new):
            self.counts[x.bus] = self.counts.get(x.bus, 0) + 1

    def read_kmsg(self) -> None:
        """New /dev/kmsg records (from the end at the first call: only XIDs after the start)."""
        from bluevela.health.nvml import kmsg_record_line, parse_xids

        if self._kmsg_failed:
            return
        if self._kmsg_fd is None:
            try:
                self._kmsg_fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
                os.lseek(self._kmsg_fd, 0, os.SEEK_END)
            except OSError as exc:
                logger.warning("no XIDs: /dev/kmsg: %s", exc.strerror or exc)
                self._kmsg_failed = True
                return
            return
        lines = []
        for _ in range(100_000):
            try:
                rec = os.read(self._kmsg_fd, 8192)
            except BlockingIOError:
                break
            except BrokenPipeError:
                continue
            if not rec:
                break
            line = kmsg_record_line(rec.decode("utf-8", "replace"))
            if line is not None:
                lines.append(line)
        for x in parse_xids(lines):
            self.counts[x.bus] = self.counts.get(x.bus, 0) + 1

    def count(self, bus: str | None) -> float:
        if bus is None:
            return NAN
        return float(self.counts.get(bus, 0))


GPUFetch = tuple["NVMLSnapshot | None", dict[int, dict[str, Any]], str]


class NVMLWorker:
    """Runs NVML readings on a thread of their own, one at a time, each awaited with a deadline.

    A GPU fallen off the bus can hang `nvmlInit` or a query inside the kernel: the call never
    returns and no signal ends it. The loop waits for a reading at most `deadline_s`; past it
    the tick goes on without GPUs, and nothing more is asked while the call hangs (one stuck
    thread, never one per tick). A reading that arrives after its tick's deadline (a slow
    NVML, not a hung one) is used by the next tick when at most `max_age_s` old, so a slow
    NVML lags by a tick instead of missing every one. Only the tick that asks waits; later
    ticks find the call still in flight and go on at once.
    """

    def __init__(self, fetch: Callable[[], GPUFetch]) -> None:
        self._fetch = fetch
        self._cond = threading.Condition()
        self._asked = 0
        self._answered = 0
        self._consumed = 0
        self._result: GPUFetch | BaseException | None = None
        self._answered_at = 0.0
        self._since: float | None = None  # monotonic start of the call in flight
        self._thread: threading.Thread | None = None

    def in_flight_s(self) -> float:
        """How long the call in flight has run; 0.0 when none is."""
        with self._cond:
            return 0.0 if self._since is None else time.monotonic() - self._since

    def _ask(self) -> None:
        self._asked += 1
        self._since = time.monotonic()
        if self._thread is None:
            # A daemon: a call stuck in the driver must not keep the process from exiting.
            self._thread = threading.Thread(target=self._loop, name="bv-nvml", daemon=True)
            self._thread.start()
        self._cond.notify_all()

    def _take(self) -> GPUFetch:
        self._consumed = self._answered
        res = self._result
        self._result = None
        if isinstance(res, BaseException):
            raise res
        assert res is not None
        return res

    def get(self, deadline_s: float, max_age_s: float) -> GPUFetch | None:
        """A reading, or None when NVML did not answer within `deadline_s`.

        Raises:
            Whatever the reading raised (NVMLMissingError, OSError, ValueError).
        """
        with self._cond:
            if self._answered > self._consumed:
                fresh = time.monotonic() - self._answered_at <= max_age_s
                if fresh:
                    res = self._take()
                    self._ask()  # the next tick's reading starts now
                    return res
                self._consumed, self._result = self._answered, None  # stale: drop
            if self._since is not None:
                return None  # an earlier tick's call, past its deadline: no wait again
            self._ask()
            want = self._asked
            if not self._cond.wait_for(lambda: self._answered >= want, timeout=deadline_s):
                return None
            return self._take()

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._asked > self._answered)
                n = self._asked
            res: GPUFetch | BaseException
            try:
                res = self._fetch()
            except Exception as exc:  # handed to the loop, which decides
                res = exc
            with self._cond:
                self._result, self._answered = res, n
                self._answered_at = time.monotonic()
                self._since = None
                self._cond.notify_all()


class GPUReader:
    """One reading of every GPU through the NVML source the gpu check uses, off the loop's
    thread (`NVMLWorker`)."""

    def __init__(self, ctx: ProbeContext) -> None:
        self.ctx = ctx
        self.xids = XidCounter()
        self._cache: tuple[tuple[int, int, int], NVMLSnapshot, dict[int, dict[str, Any]]] | None
        self._cache = None
        self._warned: set[str] = set()
        self.worker = NVMLWorker(self._fetch)
        self.hung = False
        self.expected = ctx.node_class.gpus

    def _warn_once(self, what: str, msg: str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            logger.warning("%s", msg)

    def _replay(self, path: Path) -> tuple[NVMLSnapshot | None, dict[int, dict[str, Any]]]:
        from bluevela.health.nvml import parse_snapshot

        try:
            st = os.stat(path)
            key = (st.st_ino, st.st_size, st.st_mtime_ns)
            if self._cache is not None and self._cache[0] == key:
                return self._cache[1], self._cache[2]
            with open(path, encoding="utf-8") as fh:
                data = json.load(fh)
            snap = parse_snapshot(data, source=f"snapshot {path}")
        except (OSError, ValueError) as exc:
            self._warn_once("replay", f"NVML snapshot {path} unreadable: {exc}")
            return None, {}
        extra = {g["index"]: g for g in data.get("gpus") or ()
                 if isinstance(g, dict) and isinstance(g.get("index"), int)}
        self._cache = (key, snap, extra)
        return snap, extra

    def _fetch(self) -> GPUFetch:
        """One NVML reading, on the worker thread: this may never return."""
        from bluevela.health.nvml import LiveNVML, NVMLMissingError, ReplayNVML

        if self.ctx.nvml_snapshot is not None:
            snap, extra = self._replay(self.ctx.nvml_snapshot)
            if snap is not None and snap.hang is not None:
                ReplayNVML(self.ctx.nvml_snapshot).read()  # blocks as the recorded call did
            return snap, extra, "snapshot"
        try:
            # No second reading: a sampler never sleeps inside a sample.
            snap = LiveNVML(include_kmsg=False, recheck_s=0.0).read()
        except (NVMLMissingError, OSError, ValueError) as exc:
            self._warn_once("live", f"no GPU values: {exc}")
            return None, {}, "live"
        more = {i: dict(v) for i, v in live_util_clocks().items()} if snap.gpus else {}
        return snap, more, "live"

    def read(self, deadline_s: float = 5.0, max_age_s: float = 10.0
             ) -> tuple[list[tuple[int, str | None, dict[str, float]]], str, float]:
        """[(index, uuid, {metric: value})], where NVML was read from, and for how long the NVML
        call in flight has not returned (0.0 when NVML answered within `deadline_s`)."""
        if self.ctx.nvml_snapshot is None and not self.ctx.node_class.gpus:
            return [], "none", 0.0  # a class without GPUs: NVML is not even looked for
        source = "snapshot" if self.ctx.nvml_snapshot is not None else "live"
        try:
            got = self.worker.get(deadline_s, max_age_s)
        except (OSError, ValueError) as exc:  # a replayed snapshot gone mid-run
            self._warn_once("read", f"no GPU values: {exc}")
            return [], source, 0.0
        if got is None:
            hung_s = self.worker.in_flight_s()
            if not self.hung:
                self.hung = True
                logger.warning("NVML has not answered for %.1f s (a hung call: a GPU fallen off "
                               "the bus?): GPUs recorded as missing until it returns; IB and "
                               "node sampled as usual", hung_s)
            return [], source, max(hung_s, deadline_s)
        if self.hung:
            self.hung = False
            logger.warning("NVML answered again: GPUs sampled again")
        snap, extra, source = got
        if snap is not None and snap.hang is not None:
            snap = None  # only reached if a replayed hang ever returned
        if snap is None or snap.init_error:
            if snap is not None:
                self._warn_once("init", f"NVML: {snap.init_error}")
            return [], source, 0.0
        if self.ctx.kmsg is not None:
            try:
                with open(self.ctx.kmsg, encoding="utf-8", errors="replace") as fh:
                    self.xids.add_lines([ln.rstrip("\n") for ln in fh if "NVRM" in ln])
            except OSError as exc:
                self._warn_once("kmsg", f"no XIDs: {self.ctx.kmsg}: {exc.strerror or exc}")
        elif source == "snapshot":
            self.xids.add_lines(list(snap.kmsg or ()))
        else:
            self.xids.read_kmsg()
        out = []
        for g in snap.gpus:
            if g.error:
                continue
            more = extra.get(g.index) or {}
            out.append((g.index, g.uuid, {
                "util_pct": _num(more.get("util_pct")),
                "mem_used_bytes": _num(g.memory_used_bytes),
                "power_w": _num(g.power_w),
                "temp_c": _num(g.temperature_c),
                "sm_clock_mhz": _num(more.get("sm_clock_mhz")),
                "clocks_event_reasons": _num(g.clocks_event_reasons),
                "xid_count": self.xids.count(g.bus),
            }))
        self.expected = max(self.expected, len(snap.gpus))
        return out, source, 0.0


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


# -- the loop ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    samples: Path
    node: str
    interval_s: float
    retain_s: float
    max_bytes: int


class Notifier:
    """systemd's notify protocol (sd_notify(3)): datagrams to `$NOTIFY_SOCKET`; silent without
    it. The watchdog is on when `$WATCHDOG_USEC` is set (and `$WATCHDOG_PID`, if set, is us)."""

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        env = os.environ if env is None else env
        addr = env.get("NOTIFY_SOCKET", "")
        self.addr: str | None = None
        if addr.startswith("@"):
            self.addr = "\0" + addr[1:]  # the abstract namespace
        elif addr.startswith("/"):
            self.addr = addr
        self.watchdog_s: float | None = None
        usec, pid = env.get("WATCHDOG_USEC", ""), env.get("WATCHDOG_PID", "")
        if usec.isdigit() and int(usec) > 0 and (not pid or pid == str(os.getpid())):
            self.watchdog_s = int(usec) / 1e6
        self.sock: socket.socket | None = None
        self._failed = False
        if self.addr is not None:
            try:
                self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            except OSError as exc:
                logger.warning("no systemd notifications: %s", exc.strerror or exc)

    def send(self, *lines: str) -> None:
        if self.sock is None or self.addr is None:
            return
        try:
            self.sock.sendto("\n".join(lines).encode("utf-8", "replace"), socket.MSG_DONTWAIT,
                             self.addr)
            self._failed = False
        except OSError as exc:
            if not self._failed:  # once per run of failures
                logger.warning("systemd notification not sent: %s", exc.strerror or exc)
            self._failed = True

    def ping(self) -> None:
        if self.watchdog_s is not None:
            self.send("WATCHDOG=1")

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None


class Sampler:
    """Takes samples and keeps the segments of `<state>/samples` within their bounds."""

    def __init__(self, ctx: ProbeContext, cfg: Config, cgroup: Path | None = None) -> None:
        self.cfg = cfg
        self.gpu = GPUReader(ctx)
        self.ib = IBReader(ctx.root)
        self.node = NodeReader(ctx.root, CgroupCPU.find(cgroup) if cgroup else None)
        self.writer: SegmentWriter | None = None
        self._hour: int | None = None
        self._last_t = -math.inf
        self._gpu_cols: list[tuple[int, str | None]] = []  # GPUs of the last good reading
        self.samples_taken = 0
        self.write_failures = 0  # consecutive failed writes (a full disk)
        self._retry_at = -math.inf
        self.status = ""

    @property
    def nvml_deadline_s(self) -> float:
        """How long a tick waits for NVML: half an interval, within [0.05, 10] s."""
        return min(max(0.5 * self.cfg.interval_s, 0.05), 10.0)

    def sample(self, now: float) -> tuple[list[Column], list[float], dict[str, dict[str, str]]]:
        """One record: its columns, values and component labels."""
        cols: list[Column] = []
        vals: list[float] = []
        comps: dict[str, dict[str, str]] = {}
        gpus, _, hung_s = self.gpu.read(self.nvml_deadline_s, self.cfg.interval_s)
        if hung_s > 0 and not gpus:
            # NVML hangs: the GPUs of the last reading stay as columns with no values, so the
            # segment does not roll on every hang and the missing ticks are NaN in place.
            gpus = [(i, uuid, dict.fromkeys((m for m, _ in GPU_UNITS), NAN))
                    for i, uuid in self._gpu_cols]
            read = 0
        else:
            self._gpu_cols = [(i, uuid) for i, uuid, _ in gpus]
            read = len(gpus)
        for index, uuid, values in gpus:
            comp = f"gpu{index}"
            if uuid:
                comps[comp] = {"uuid": uuid}
            for metric, unit in GPU_UNITS:
                cols.append(Column(f"{comp}.{metric}", comp, unit))
                vals.append(values[metric])
        for port, values in self.ib.read(now):
            comp = f"ib.{port}"
            for metric, unit in IB_UNITS:
                cols.append(Column(f"{comp}.{metric}", comp, unit))
                vals.append(values[metric])
        node = self.node.read(now)
        for metric, unit in NODE_UNITS:
            cols.append(Column(f"node.{metric}", "node", unit))
            vals.append(node[metric])
        for metric, unit in NVML_UNITS:
            cols.append(Column(f"node.{metric}", "node", unit))
        vals.append(float(max(0, self.gpu.expected - read)))
        vals.append(round(hung_s, 3))
        comps["node"] = {"cpu_source": self.node.cpu_source}
        return cols, vals, comps

    def record(self, now: float) -> None:
        cols, vals, comps = self.sample(now)
        hour = int(now // 3600)
        w = self.writer
        if w is not None and now < self._last_t:
            # Records of a segment are in time order: a clock stepped back starts a new one.
            logger.warning("the clock stepped back %.1f s: a new segment", self._last_t - now)
            w = None
        if w is None or hour != self._hour or w.header.columns != tuple(cols) \
                or w.header.components != comps:
            self._roll(now, tuple(cols), comps)
            self._hour = hour
        assert self.writer is not None
        self.writer.append(now, vals)
        self._last_t = now
        self.samples_taken += 1

    def _close_writer(self, *, failed: bool = False) -> None:
        w, self.writer = self.writer, None
        if w is None:
            return
        w.close(sync=not failed)
        if failed and w.records == 0:  # a header alone is nothing to keep
            try:
                os.unlink(w.path)
            except OSError:
                pass

    def _roll(self, now: float, cols: tuple[Column, ...], comps: dict[str, dict[str, str]]) -> None:
        self._close_writer()
        # Room first: on a full disk the old segments past their bounds must go before a new
        # file is asked for.
        self.prune(now)
        self.cfg.samples.mkdir(mode=0o750, parents=True, exist_ok=True)
        start = int(now)
        while (self.cfg.samples / f"seg-{start}.bvts").exists():
            start += 1  # a restart within the same second: never append to an old segment
        header = Header(self.cfg.node, self.cfg.interval_s, cols, float(now), comps)
        self.writer = SegmentWriter(self.cfg.samples / f"seg-{start}.bvts", header)

    def prune(self, now: float) -> list[str]:
        """Remove segments dated in the future (more than FUTURE_SLACK_S + one interval after
        `now`: written under a wrong clock, later corrected), then those that ended more than
        `retain_s` ago (at the next one's start; the newest closed one at its last record),
        then the oldest while over `max_bytes` (never the one being written). Returns the
        names removed."""
        segs = list_segments(self.cfg.samples)
        current = self.writer.path.name if self.writer is not None else None
        removed = []

        def unlink(name: str) -> bool:
            try:
                os.unlink(self.cfg.samples / name)
            except FileNotFoundError:
                pass
            except OSError as exc:
                logger.warning("cannot remove %s: %s", self.cfg.samples / name, exc.strerror)
                return False
            removed.append(name)
            return True

        self._prune_stale_tmp(now)
        future = now + FUTURE_SLACK_S + self.cfg.interval_s
        kept = []
        for start, name in segs:
            if start > future and name != current:
                logger.warning("segment %s starts %.0f s in the future (a wrong clock when it "
                               "was written): removed", name, start - now)
                if unlink(name):
                    continue
            kept.append((start, name))
        segs = kept
        sizes = {}
        for _, name in segs:
            try:
                sizes[name] = os.stat(self.cfg.samples / name, follow_symlinks=False).st_size
            except OSError:
                sizes[name] = 0
        total = sum(sizes.values())
        for i, (_, name) in enumerate(segs):
            if name == current:
                break
            if i + 1 < len(segs):
                ended = segs[i + 1][0]
            else:  # the newest, closed: it ended at its last record (a sampler down since?)
                try:
                    ended = min(now, probe_file(self.cfg.samples / name).t_last)
                except (OSError, FormatError):
                    ended = now
            if ended >= now - self.cfg.retain_s and total <= self.cfg.max_bytes:
                continue
            if unlink(name):
                total -= sizes[name]
        return removed

    def _prune_stale_tmp(self, now: float) -> None:
        """A segment's header is written under `.seg-<start>.bvts.<pid>.tmp` and linked into
        place; a sampler killed in between leaves that name behind. Gone after a minute."""
        try:
            names = os.listdir(self.cfg.samples)
        except OSError:
            return
        for name in names:
            if not TMP_SEGMENT_RE.match(name):
                continue
            try:
                st = os.stat(self.cfg.samples / name, follow_symlinks=False)
                if st.st_mtime < now - 60:
                    os.unlink(self.cfg.samples / name)
            except OSError:
                pass

    def _set_status(self, notify: Notifier, status: str) -> None:
        if status != self.status:
            self.status = status
            notify.send(f"STATUS={status}")

    def tick(self, now: float) -> None:
        """One sample written, or the failure to write it handled (a full disk backs off)."""
        if now < self._retry_at:
            return
        try:
            self.record(now)
        except OSError as exc:  # ENOSPC and friends: closed, unlinked, tried again later
            self._close_writer(failed=True)
            self.write_failures += 1
            ticks = min(2 ** (self.write_failures - 1), MAX_BACKOFF_TICKS)
            self._retry_at = now + (ticks - 0.5) * self.cfg.interval_s
            if self.write_failures == 1:
                logger.error("sample not written: %s; trying again in %d interval(s), backing "
                             "off to %d while it fails", exc, ticks, MAX_BACKOFF_TICKS)
            else:
                logger.debug("sample not written (%d in a row): %s", self.write_failures, exc)
            return
        if self.write_failures:
            logger.warning("writing samples again after %d failed attempt(s)",
                           self.write_failures)
            self.write_failures = 0
            self._retry_at = -math.inf

    def run(self, stop: threading.Event, *, duration_s: float | None = None,
            notify: Notifier | None = None) -> int:
        """Sample on multiples of the interval until `stop` is set (or `duration_s` passes).

        With systemd's notify socket: READY=1 once started, WATCHDOG=1 after every tick that
        completed (and while waiting for the next when the watchdog period is shorter than two
        intervals), STATUS= when NVML hangs or the disk is full, STOPPING=1 at the end.
        """
        notify = Notifier() if notify is None else notify
        interval = self.cfg.interval_s
        end = time.time() + duration_s if duration_s is not None else math.inf
        logger.info("sampling every %g s into %s (CPU from %s)", interval, self.cfg.samples,
                    self.node.cpu_source)
        notify.send("READY=1", f"STATUS=sampling every {interval:g} s")
        try:
            while not stop.is_set():
                self.tick(time.time())
                notify.ping()
                if self.gpu.hung:
                    status = f"NVML hung {self.gpu.worker.in_flight_s():.0f} s: GPUs missing"
                elif self.write_failures:
                    status = f"samples not written ({self.write_failures} failures in a row)"
                else:
                    status = f"sampling every {interval:g} s"
                self._set_status(notify, status)
                nxt = (math.floor(time.time() / interval) + 1) * interval
                if nxt > end:
                    break
                wait = max(0.0, nxt - time.time())
                step = notify.watchdog_s / 2 if notify.watchdog_s else math.inf
                while wait > 0 and not stop.is_set():
                    if stop.wait(min(wait, step)):
                        break
                    wait -= min(wait, step)
                    if wait > 0:
                        notify.ping()
        finally:
            notify.send("STOPPING=1")
            self._close_writer()
        logger.info("stopped after %d samples", self.samples_taken)
        return 0


def _daemonize(pidfile: Path | None, log: Path | None) -> None:
    """Double fork (the dev cluster starts the sampler like slurmd: it must return)."""
    if os.fork() > 0:
        os._exit(0)
    os.setsid()
    if os.fork() > 0:
        os._exit(0)
    fd = os.open(os.devnull, os.O_RDWR)
    os.dup2(fd, 0)
    out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o640) if log else fd
    os.dup2(out, 1)
    os.dup2(out, 2)
    if pidfile is not None:
        pidfile.write_text(f"{os.getpid()}\n")


def build(cgroup_env: str | None = None) -> Sampler:
    """A sampler for this node from hook.env, the site file and the environment."""
    from bluevela.health.context import ProbeContext
    from bluevela.site import load_site

    site = load_site(cwd=False)
    node = socket.gethostname().split(".")[0]
    class_name = site.class_name_for(node)
    ctx = ProbeContext.from_env(site.node_classes[class_name], class_name)
    env_interval = os.environ.get("BV_SAMPLER_INTERVAL_S")
    try:
        interval = float(env_interval) if env_interval else site.telemetry.interval_s
    except ValueError:
        interval = site.telemetry.interval_s
    if not 0.05 <= interval <= 3600:
        interval = site.telemetry.interval_s
    cfg = Config(site.path("state") / "samples", node, interval,
                 site.telemetry.retain_h * 3600.0, int(site.telemetry.max_mb * (1 << 20)))
    cg = cgroup_env if cgroup_env is not None else os.environ.get("BV_SAMPLER_CGROUP")
    if cg and not os.path.isdir(cg):
        logger.warning("BV_SAMPLER_CGROUP %s is not a directory: CPU from /proc/stat", cg)
        cg = None
    return Sampler(ctx, cfg, Path(cg) if cg else None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bv-sampler", description=__doc__.splitlines()[0])
    parser.add_argument("--once", action="store_true", help="print one sample as JSON and exit")
    parser.add_argument("--duration", type=float, default=None, help="stop after this many s")
    parser.add_argument("--daemonize", action="store_true", help="fork into the background")
    parser.add_argument("--pidfile", type=Path, default=None)
    parser.add_argument("--log", type=Path, default=None)
    args = parser.parse_args(argv)
    from bluevela.errors import BluevelaError
    from bluevela.hooks.env import load_hook_env

    if args.daemonize:
        _daemonize(args.pidfile, args.log)
    load_hook_env()
    level = getattr(logging, os.environ.get("BV_HOOK_LOG_LEVEL", "INFO").upper(), logging.INFO)
    logging.basicConfig(level=level if isinstance(level, int) else logging.INFO,
                        format="bv-sampler: %(levelname)s: %(message)s", stream=sys.stderr)
    try:
        sampler = build()
    except BluevelaError as exc:
        print(f"bv-sampler: {exc}", file=sys.stderr)
        return 2
    if args.once:
        cols, vals, comps = sampler.sample(time.time())
        time.sleep(min(1.0, sampler.cfg.interval_s))
        cols, vals, comps = sampler.sample(time.time())
        print(json.dumps({"node": sampler.cfg.node, "components": comps,
                          "values": {c.name: (None if math.isnan(v) else v)
                                     for c, v in zip(cols, vals, strict=True)}}, indent=1))
        return 0
    stop = threading.Event()

    def on_signal(signum: int, frame: Any) -> None:
        del frame
        logger.info("signal %d: stopping", signum)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    notify = Notifier()
    try:
        return sampler.run(stop, duration_s=args.duration, notify=notify)
    finally:
        notify.close()


if __name__ == "__main__":
    sys.exit(main())
