"""The node sampler: `python -I -m bluevela.telemetry.sampler` (systemd `bv-sampler.service`).

Every `telemetry.interval_s` (site.yaml; `BV_SAMPLER_INTERVAL_S` overrides it, e.g. in the dev
cluster's hook.env) it appends one record to `<state>/samples/seg-<unix_start>.bvts`
(`bluevela.telemetry.format`): per GPU, per InfiniBand port and for the node. Samples are taken
on multiples of the interval of the wall clock, so every node of a job samples at the same
instants and the archive's common time grid loses nothing.

This module is the loop; the rest is apart:
- `telemetry.gpu`: the GPU columns (the gpu check's NVML source, on a thread of its own with a
  deadline, and the XIDs of the kernel log);
- `telemetry.host`: the InfiniBand ports and the node (CPU, cgroup, memory, network);
- `telemetry.store`: the segments on disk (rolling, pruning, a full disk's back-off);
- `util.sdnotify` / `util.daemon`: systemd's notify protocol and the dev cluster's daemonizing.
What reads the samples back is `telemetry.format` (`read_file`, `cut_window`) and the
epilog's `telemetry.window`; never the loop.

Faults (docs/install.md, "The node sampler"):
- NVML awaited at most half an interval (0.05-10 s). A call that hangs (a GPU fallen off the
  bus) leaves the GPU columns NaN and `node.gpus_missing` / `node.nvml_hung_s` say so per
  tick; IB and node go on, the log says it once, and SIGTERM still ends the sampler.
- A write that fails (ENOSPC) closes and unlinks what it opened, cuts off a partial record,
  and the next attempts back off (1, 2, 4 ... 32 intervals) until one succeeds.
- systemd (Type=notify): READY=1, WATCHDOG=1 from the loop after each completed tick, STATUS=
  on a fault.
SIGTERM/SIGINT end the loop after the current sample and close the segment. Only the standard
library runs in the loop (no numpy, torch, h5py).
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
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bluevela.telemetry.format import Column
from bluevela.telemetry.gpu import GPU_UNITS, NAN, GPUReader
from bluevela.telemetry.host import IB_UNITS, NODE_UNITS, CgroupCPU, IBReader, NodeReader
from bluevela.telemetry.store import SegmentStore
from bluevela.util.daemon import daemonize
from bluevela.util.sdnotify import Notifier

if TYPE_CHECKING:
    from bluevela.health.context import ProbeContext

logger = logging.getLogger(__name__)

# Per tick, how NVML fared: GPUs of the node class (or of an earlier reading) that gave no
# values, and how long the NVML call in flight has not returned (0: it answered).
NVML_UNITS = (("gpus_missing", "1"), ("nvml_hung_s", "s"))

Record = tuple[list[Column], list[float], dict[str, dict[str, str]]]


@dataclass(frozen=True)
class Config:
    samples: Path
    node: str
    interval_s: float
    retain_s: float
    max_bytes: int


class Sampler:
    """Takes samples on the interval's grid and hands them to the segment store."""

    def __init__(self, ctx: ProbeContext, cfg: Config, cgroup: Path | None = None) -> None:
        self.cfg = cfg
        self.gpu = GPUReader(ctx)
        self.ib = IBReader(ctx.root)
        self.node = NodeReader(ctx.root, CgroupCPU.find(cgroup) if cgroup else None)
        self.store = SegmentStore(cfg.samples, cfg.node, cfg.interval_s, cfg.retain_s,
                                  cfg.max_bytes)
        self._gpu_cols: list[tuple[int, str | None]] = []  # GPUs of the last good reading
        self.samples_taken = 0
        self.status = ""

    @property
    def nvml_deadline_s(self) -> float:
        """How long a tick waits for NVML: half an interval, within [0.05, 10] s."""
        return min(max(0.5 * self.cfg.interval_s, 0.05), 10.0)

    def _gpus(self) -> tuple[list[tuple[int, str | None, dict[str, float]]], int, float]:
        """The GPUs' values, how many NVML gave, and how long its call has hung (0.0)."""
        gpus, _, hung_s = self.gpu.read(self.nvml_deadline_s, self.cfg.interval_s)
        if hung_s > 0 and not gpus:
            # NVML hangs: the GPUs of the last reading stay as columns with no values, so the
            # segment does not roll on every hang and the missing ticks are NaN in place.
            gpus = [(i, uuid, dict.fromkeys((m for m, _ in GPU_UNITS), NAN))
                    for i, uuid in self._gpu_cols]
            return gpus, 0, hung_s
        self._gpu_cols = [(i, uuid) for i, uuid, _ in gpus]
        return gpus, len(gpus), hung_s

    def sample(self, now: float) -> Record:
        """One record: its columns, values and component labels."""
        cols: list[Column] = []
        vals: list[float] = []
        comps: dict[str, dict[str, str]] = {}
        gpus, read, hung_s = self._gpus()
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
        """One sample taken and appended to the store.

        Raises:
            OSError: not written (a full disk).
        """
        cols, vals, comps = self.sample(now)
        self.store.append(now, tuple(cols), comps, vals)
        self.samples_taken += 1

    def tick(self, now: float) -> None:
        """One sample written, or the failure to write it handled (a full disk backs off)."""
        if self.store.backing_off(now):
            return
        try:
            self.record(now)
        except OSError as exc:  # ENOSPC and friends: closed, unlinked, tried again later
            self.store.write_failed(now, exc)
            return
        self.store.write_ok()

    def _set_status(self, notify: Notifier) -> None:
        if self.gpu.hung:
            status = f"NVML hung {self.gpu.worker.in_flight_s():.0f} s: GPUs missing"
        elif self.store.write_failures:
            status = f"samples not written ({self.store.write_failures} failures in a row)"
        else:
            status = f"sampling every {self.cfg.interval_s:g} s"
        if status != self.status:
            self.status = status
            notify.send(f"STATUS={status}")

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
                self._set_status(notify)
                nxt = (math.floor(time.time() / interval) + 1) * interval
                if nxt > end:
                    break
                _wait_until(nxt, stop, notify)
        finally:
            notify.send("STOPPING=1")
            self.store.close()
        logger.info("stopped after %d samples", self.samples_taken)
        return 0


def _wait_until(t: float, stop: threading.Event, notify: Notifier) -> None:
    """Sleep until wall-clock `t` or `stop`, pinging the watchdog every half period."""
    wait = max(0.0, t - time.time())
    step = notify.watchdog_s / 2 if notify.watchdog_s else math.inf
    while wait > 0 and not stop.is_set():
        if stop.wait(min(wait, step)):
            break
        wait -= min(wait, step)
        if wait > 0:
            notify.ping()


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
        daemonize(args.pidfile, args.log)
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
