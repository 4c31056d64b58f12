"""The sampler's GPU columns: one reading of every GPU per tick, off the loop's thread.

The NVML source is the gpu health check's own (`BV_NVML_SNAPSHOT` replayed, else live NVML
through pynvml via `bluevela.health.nvml.LiveNVML`), so the same fixtures drive both.
Utilisation and the SM clock are not in the health snapshot: live NVML reads them in the
same session (`LiveNVML.sample`: one nvmlInit and one nvmlShutdown per sample); a snapshot may
carry them as optional `util_pct` / `sm_clock_mhz` keys per GPU. XIDs: kernel log lines (`BV_KMSG`, the snapshot's `kmsg`, else /dev/kmsg read
incrementally), counted per GPU since the sampler started.

NVML is read on a thread of its own (`NVMLWorker`) and awaited with a deadline: a call that
hangs (a GPU fallen off the bus) leaves the tick without GPUs, never the loop stuck.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bluevela.health.kmsg import KmsgFollower, parse_xids, read_marked_lines

if TYPE_CHECKING:
    from bluevela.health.context import ProbeContext
    from bluevela.health.nvml_snapshot import NVMLSnapshot

logger = logging.getLogger(__name__)

NAN = float("nan")
GPU_UNITS = (("util_pct", "%"), ("mem_used_bytes", "B"), ("power_w", "W"), ("temp_c", "Cel"),
             ("sm_clock_mhz", "MHz"), ("clocks_event_reasons", "bitmask"), ("xid_count", "1"))


def _num(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float):
        return NAN
    return float(v)


class XidCounter:
    """XIDs per PCI bus seen since the sampler started."""

    def __init__(self) -> None:
        self.baseline: set[str] | None = None
        self.counts: dict[str, int] = {}
        self._seen: set[str] = set()
        self._follower: KmsgFollower | None = None
        self._kmsg_failed = False

    def add_lines(self, lines: list[str] | tuple[str, ...]) -> None:
        """Lines of a file or snapshot re-read each time: only lines new since the first."""
        if self.baseline is None:
            self.baseline = set(lines)
            return
        new = [ln for ln in lines if ln not in self.baseline and ln not in self._seen]
        self._seen.update(new)
        self._add(new)

    def read_kmsg(self) -> None:
        """New /dev/kmsg records (from the end at the first call: only XIDs after the start)."""
        if self._kmsg_failed:
            return
        if self._follower is None:
            self._follower = KmsgFollower()
        try:
            self._add(self._follower.new_lines())
        except OSError as exc:
            logger.warning("no XIDs: /dev/kmsg: %s", exc.strerror or exc)
            self._kmsg_failed = True

    def _add(self, lines: list[str]) -> None:
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
        from bluevela.health.nvml_snapshot import parse_snapshot

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
        from bluevela.health.nvml import LiveNVML, ReplayNVML
        from bluevela.health.nvml_live import NVMLMissingError

        if self.ctx.nvml_snapshot is not None:
            snap, extra = self._replay(self.ctx.nvml_snapshot)
            if snap is not None and snap.hang is not None:
                ReplayNVML(self.ctx.nvml_snapshot).read()  # blocks as the recorded call did
            return snap, extra, "snapshot"
        try:
            # One NVML session: the snapshot (no kernel log, no second reading: a sampler
            # never sleeps inside a sample), utilisation and the SM clock.
            snap, activity = LiveNVML().sample()
        except (NVMLMissingError, OSError, ValueError) as exc:
            self._warn_once("live", f"no GPU values: {exc}")
            return None, {}, "live"
        more = {i: dict(v) for i, v in activity.items()} if snap.gpus else {}
        return snap, more, "live"

    def _count_xids(self, snap: NVMLSnapshot, source: str) -> None:
        """New XIDs from `BV_KMSG` (a file re-read), else the snapshot's lines, else /dev/kmsg."""
        if self.ctx.kmsg is not None:
            try:
                self.xids.add_lines(read_marked_lines(self.ctx.kmsg))
            except OSError as exc:
                self._warn_once("kmsg", f"no XIDs: {self.ctx.kmsg}: {exc.strerror or exc}")
        elif source == "snapshot":
            self.xids.add_lines(list(snap.kmsg or ()))
        else:
            self.xids.read_kmsg()

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
        self._count_xids(snap, source)
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

