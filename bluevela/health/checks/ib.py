"""`ib`: InfiniBand ports from sysfs (`<root>/sys/class/infiniband/<hca>/ports/<n>/`).

Formats are the kernel's (drivers/infiniband/core/sysfs.c): `state` "4: ACTIVE",
`phys_state` "5: LinkUp", `rate` "400 Gb/sec (4X NDR)", `link_layer` "InfiniBand", and one
decimal number per file in `counters/` and in the driver's `hw_counters/` (mlx5:
`rnr_nak_retry_err`, `out_of_buffer`, ...; `lifespan` there is a period, not a counter).
`port_xmit_data`/`port_rcv_data` count 4-byte words. The HCA's PCIe link is read from its PCI
device (`<hca>/device/current_link_width`, `max_link_width`, `current_link_speed` "32.0 GT/s
PCIe", `max_link_speed`; drivers/pci/pci-sysfs.c), GPUDirect RDMA from `<root>/proc/modules`
(`nvidia_peermem`, or Mellanox's older `nv_peer_mem`) or `<root>/proc/driver/nvidia/version`
(the open kernel module, whose DMA-BUF export Linux >= 5.12 can register).

Verdicts: a missing port, a port not ACTIVE/LinkUp, a rate under the class's, the wrong
link layer, an HCA's PCIe link below its maximum width or speed, or GPUDirect RDMA missing
where the class asks for it is CRITICAL; an error counter over its absolute ceiling is
WARNING (counters accumulate since boot); an error counter that rose more than allowed since
the last reading (kept in the state dir) is CRITICAL (`link_downed` and
`local_link_integrity_errors` allow +0: a link that went down or failed its integrity check
since the last reading); a rate per hour over the interval since the last reading above
`ib_limits.max_rate_per_h` is WARNING.

The increase ceilings hold over an interval up to `ib_limits.increase_window_s` (1 h) since
the last reading. The last reading can be days old (the epilog of a long job compares with
its prolog's): then one burst (a switch reboot: `link_downed` +1 on every attached node) says
nothing about the link now, so the increase is judged as a rate over the real interval: it is
CRITICAL only when it averages at least `allowed + 1` per window (`link_downed` +72 in 3 days:
a link going down every hour), else WARNING with its rate (`link_downed +1 in 3 d, 0.0139/h`). The baseline is replaced by every run, so a node
drained for a rising counter passes again once the counter stops rising.
"""

from __future__ import annotations

import logging
import os
import re
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from bluevela.checks_registry import check
from bluevela.health.result import CheckResult, Status, duration_text, summarize
from bluevela.health.state import IB_COUNTERS, read_json, write_json

if TYPE_CHECKING:
    from bluevela.health.context import ProbeContext
    from bluevela.site import IBExpect, IBThresholds, NodeClass

logger = logging.getLogger(__name__)

SYSFS_IB = "sys/class/infiniband"
_RATE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*Gb/sec")
_GTS = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*GT/s")
WORD_COUNTERS = ("port_xmit_data", "port_rcv_data")  # in 4-byte words
HW_NOT_COUNTERS = ("lifespan",)  # hw_counters/lifespan: the refresh period in ms
PEERMEM_MODULES = ("nvidia_peermem", "nv_peer_mem")
PCI_LINK_FILES = ("current_link_width", "max_link_width", "current_link_speed", "max_link_speed")


@dataclass(frozen=True)
class PCILink:
    """An HCA's PCIe link as sysfs shows it (texts kept for the message); `error` when unread."""

    hca: str
    width: int | None = None
    max_width: int | None = None
    speed_text: str | None = None
    max_speed_text: str | None = None
    error: str | None = None

    @property
    def speed_gts(self) -> float | None:
        return parse_gts(self.speed_text) if self.speed_text else None

    @property
    def max_speed_gts(self) -> float | None:
        return parse_gts(self.max_speed_text) if self.max_speed_text else None


@dataclass(frozen=True)
class GPUDirectFacts:
    """What the kernel shows of GPUDirect RDMA: loaded peer-memory modules, and whether the
    NVIDIA module is the open one (DMA-BUF) on a kernel that can import DMA-BUFs."""

    modules: frozenset[str] = frozenset()
    nvidia_open: bool | None = None  # None: /proc/driver/nvidia/version unreadable
    kernel: str | None = None
    error: str | None = None  # /proc/modules unreadable


@dataclass(frozen=True)
class PortFacts:
    """One port as read from sysfs. `error` is set when it could not be read."""

    port: str
    present: bool
    state: str | None = None
    phys_state: str | None = None
    rate_text: str | None = None
    link_layer: str | None = None
    counters: dict[str, int] = field(default_factory=dict)
    previous: dict[str, int] | None = None
    error: str | None = None
    hw_counters: dict[str, int] = field(default_factory=dict)
    previous_hw: dict[str, int] | None = None

    @property
    def rate_gbps(self) -> float | None:
        return parse_rate(self.rate_text) if self.rate_text is not None else None


@dataclass(frozen=True)
class IBFacts:
    ports: tuple[PortFacts, ...]
    found: tuple[str, ...] = ()  # every "<hca>/<port>" under sysfs
    previous_age_s: float | None = None
    error: str | None = None  # the sysfs tree itself could not be listed
    pci: tuple[PCILink, ...] = ()  # one per HCA of the expected ports (when checked)
    gpudirect: GPUDirectFacts | None = None  # None: not asked for by the class


def parse_state(text: str) -> str:
    """'4: ACTIVE\\n' -> 'ACTIVE'; '5: LinkUp' -> 'LinkUp'; anything else stripped."""
    text = text.strip()
    _, sep, name = text.partition(":")
    return name.strip() if sep else text


# IBTA port states and physical states by name (sysfs prints "4: ACTIVE", "5: LinkUp")
STATE_IDS = {"DOWN": 1, "INIT": 2, "ARMED": 3, "ACTIVE": 4, "ACTIVE_DEFER": 5}
PHYS_STATE_IDS = {"Sleep": 1, "Polling": 2, "Disabled": 3, "PortConfigurationTraining": 4,
                  "LinkUp": 5, "LinkErrorRecovery": 6, "PhyTest": 7}


def port_components(ports: tuple[PortFacts, ...]) -> tuple[dict[str, object], ...]:
    """One entry per readable port (labels device/port, state ids, rate, raw counters) for
    the per-port Prometheus series."""
    out: list[dict[str, object]] = []
    for p in ports:
        if not p.present or p.error:
            continue
        device, _, num = p.port.partition("/")
        values: dict[str, float] = {f"counter_{k}": v for k, v in p.counters.items()}
        values.update({f"hw_counter_{k}": v for k, v in p.hw_counters.items()})
        if p.state in STATE_IDS:
            values["state_id"] = STATE_IDS[p.state]
        if p.phys_state in PHYS_STATE_IDS:
            values["phys_state_id"] = PHYS_STATE_IDS[p.phys_state]
        if p.rate_gbps is not None:
            values["rate_gbps"] = p.rate_gbps
        out.append({"kind": "ib_port", "labels": {"device": device, "port": num},
                    "values": values})
    return tuple(out)


def parse_rate(text: str) -> float | None:
    """'400 Gb/sec (4X NDR)' -> 400.0; '2.5 Gb/sec (1X SDR)' -> 2.5; None when unparsable."""
    m = _RATE.match(text)
    return float(m.group(1)) if m else None


def parse_gts(text: str) -> float | None:
    """'32.0 GT/s PCIe' -> 32.0; '8 GT/s' -> 8.0; 'Unknown' -> None."""
    m = _GTS.match(text)
    return float(m.group(1)) if m else None


def parse_modules(text: str) -> frozenset[str]:
    """Module names from /proc/modules ('nvidia_peermem 16384 0 - Live 0x0000000000000000')."""
    return frozenset(line.split()[0] for line in text.splitlines() if line.split())


def kernel_at_least(release: str | None, major: int, minor: int) -> bool:
    """'5.15.0-91-generic' >= (5, 12)."""
    m = re.match(r"^\s*([0-9]+)\.([0-9]+)", release or "")
    return bool(m) and (int(m.group(1)), int(m.group(2))) >= (major, minor)  # type: ignore[union-attr]


def _read(path: Path) -> str:
    with open(path, encoding="ascii", errors="replace") as fh:
        return fh.read(4096)


def _read_counters(directory: Path) -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        names = sorted(os.listdir(directory))
    except FileNotFoundError:
        return out
    for name in names:
        try:
            text = _read(directory / name).strip()
        except OSError:
            continue  # some counters are unreadable on some HCAs (EINVAL): skip them
        if text.isdigit():
            out[name] = int(text)
    return out


def list_ports(root: Path) -> list[str]:
    """Every '<hca>/<port>' present under `<root>/sys/class/infiniband`."""
    base = root / SYSFS_IB
    found = []
    for hca in sorted(os.listdir(base)):
        try:
            ports = sorted(os.listdir(base / hca / "ports"), key=lambda p: (len(p), p))
        except (FileNotFoundError, NotADirectoryError):
            continue
        found += [f"{hca}/{p}" for p in ports]
    return found


def read_port(root: Path, port: str) -> PortFacts:
    hca, _, num = port.partition("/")
    base = root / SYSFS_IB / hca / "ports" / num
    if not base.is_dir():
        return PortFacts(port, present=False)
    try:
        return PortFacts(
            port,
            present=True,
            state=parse_state(_read(base / "state")),
            phys_state=parse_state(_read(base / "phys_state")),
            rate_text=_read(base / "rate").strip(),
            link_layer=_read(base / "link_layer").strip(),
            counters=_read_counters(base / "counters"),
            hw_counters={k: v for k, v in _read_counters(base / "hw_counters").items()
                         if k not in HW_NOT_COUNTERS},
        )
    except OSError as exc:
        return PortFacts(port, present=True, error=f"{exc.strerror or exc} reading {base}")


def read_pci_link(root: Path, hca: str) -> PCILink:
    """The HCA's PCIe link from its PCI device (`<hca>/device` is the kernel's link to it)."""
    base = root / SYSFS_IB / hca / "device"
    try:
        texts = {name: _read(base / name).strip() for name in PCI_LINK_FILES}
    except OSError as exc:
        return PCILink(hca, error=f"{exc.strerror or exc} reading {base}")

    def num(text: str) -> int | None:
        return int(text) if text.isdigit() else None

    return PCILink(hca, num(texts["current_link_width"]), num(texts["max_link_width"]),
                   texts["current_link_speed"], texts["max_link_speed"])


def read_gpudirect(ctx: ProbeContext) -> GPUDirectFacts:
    try:
        modules = parse_modules(ctx.under_root("/proc/modules").read_text(errors="replace"))
    except OSError as exc:
        return GPUDirectFacts(error=f"/proc/modules: {exc.strerror or exc}")
    try:
        version = ctx.under_root("/proc/driver/nvidia/version").read_text(errors="replace")
        nvidia_open: bool | None = "Open Kernel Module" in version
    except OSError:
        nvidia_open = None
    try:
        kernel: str | None = ctx.under_root("/proc/sys/kernel/osrelease").read_text().strip()
    except OSError:
        kernel = None
    return GPUDirectFacts(modules, nvidia_open, kernel)


def probe_ib(ctx: ProbeContext) -> IBFacts:
    """Read the class's expected ports; compare with, then replace, the stored baseline."""
    expected = list(ctx.node_class.ib.ports)
    base = ctx.under_root(SYSFS_IB)
    try:
        found = tuple(list_ports(ctx.root)) if base.is_dir() else ()
    except OSError as exc:
        return IBFacts((), error=f"cannot list {base}: {exc.strerror or exc}")
    ports = [read_port(ctx.root, p) for p in expected]
    previous: dict[str, dict[str, int]] = {}
    previous_hw: dict[str, dict[str, int]] = {}
    age: float | None = None
    if ctx.state_dir is not None and expected:
        stored = read_json(ctx.state_dir / IB_COUNTERS)
        if isinstance(stored, dict) and isinstance(stored.get("ports"), dict):
            previous = {k: v for k, v in stored["ports"].items() if isinstance(v, dict)}
            if isinstance(stored.get("hw"), dict):
                previous_hw = {k: v for k, v in stored["hw"].items() if isinstance(v, dict)}
            if isinstance(stored.get("time"), int | float):
                age = max(0.0, time.time() - float(stored["time"]))
        current = {p.port: p.counters for p in ports if p.present and p.counters}
        if current:
            hw = {p.port: p.hw_counters for p in ports if p.present and p.hw_counters}
            write_json(ctx.state_dir / IB_COUNTERS,
                       {"time": time.time(), "ports": current, "hw": hw})
    with_prev = tuple(replace(p, previous=previous.get(p.port), previous_hw=previous_hw.get(p.port))
                      if p.port in previous else p for p in ports)
    cls = ctx.node_class.ib
    pci: tuple[PCILink, ...] = ()
    if cls.pcie_at_max:
        hcas = dict.fromkeys(p.partition("/")[0] for p in expected)
        pci = tuple(read_pci_link(ctx.root, h) for h in hcas if (base / h).is_dir())
    gpudirect = read_gpudirect(ctx) if cls.gpudirect != "off" and expected else None
    return IBFacts(with_prev, found=found, previous_age_s=age, pci=pci, gpudirect=gpudirect)


def _increase(now: int, before: int) -> int:
    """Counter increase; a counter that went down was reset (reboot, perfquery -R)."""
    return now - before if now >= before else now


def fmt_interval(seconds: float | None) -> str:
    """'in 40 min', 'in 45 s', 'in 5.2 h', 'in 12 d'; 'since the last reading' when unknown."""
    if seconds is None:
        return "since the last reading"
    return f"in {duration_text(seconds)}"


def judge_increase(port: str, name: str, before: int, cur: int, allowed: int,
                   age_s: float | None, window_s: float) -> tuple[Status, str]:
    """The verdict on a counter that rose more than `allowed` since the last reading,
    `age_s` ago (None: unknown).

    Over an interval up to `window_s` the increase itself is judged (CRITICAL). Over a longer
    one, the events may have come in one burst long ago: the increase is averaged over the real
    interval, and is CRITICAL only at `allowed + 1` or more per window (events are whole: "more
    than `allowed` in a window", on average); under that it is a WARNING that names its rate.
    """
    inc = _increase(cur, before)
    text = f"{port} {name} +{inc} {fmt_interval(age_s)} ({before} -> {cur}, allowed +{allowed}"
    if age_s is None or window_s <= 0 or age_s <= window_s:
        return Status.CRITICAL, text + ")"
    per_window = inc * window_s / age_s
    per = f"per {duration_text(window_s)}"
    rate = f"{inc * 3600.0 / age_s:.3g}/h"
    if per_window >= allowed + 1:
        return Status.CRITICAL, text + f" {per}; {per_window:.3g} {per} on average, {rate})"
    return Status.WARNING, text + (f" {per}; over {duration_text(age_s)} that is {rate}, "
                                   f"under {allowed + 1} {per}: not a drain)")


def evaluate_pci(links: tuple[PCILink, ...]) -> list[tuple[Status, str]]:
    """Each HCA's PCIe link at its maximum width and speed (a downtrained link halves or worse
    the HCA's bandwidth while the port still shows 400 Gb/s)."""
    problems: list[tuple[Status, str]] = []
    for link in links:
        if link.error:
            problems.append((Status.UNKNOWN, f"{link.hca} PCIe link unreadable: {link.error}"))
            continue
        if link.width is None or link.max_width is None:
            problems.append((Status.UNKNOWN, f"{link.hca} PCIe link width unreadable"))
        elif link.width < link.max_width:
            problems.append((Status.CRITICAL, f"{link.hca} PCIe x{link.width} (max x{link.max_width})"))
        cur, top = link.speed_gts, link.max_speed_gts
        if cur is None or top is None:
            problems.append((Status.UNKNOWN, f"{link.hca} PCIe link speed unreadable "
                             f"({link.speed_text!r}, max {link.max_speed_text!r})"))
        elif cur < top:
            problems.append((Status.CRITICAL, f"{link.hca} PCIe {cur:g} GT/s (max {top:g} GT/s)"))
    return problems


def evaluate_gpudirect(facts: GPUDirectFacts | None, want: str) -> list[tuple[Status, str]]:
    """GPUDirect RDMA as the class asks: `peermem`, `dmabuf` or `any` of the two."""
    if want == "off" or facts is None:
        return []
    if facts.error:
        return [(Status.UNKNOWN, f"GPUDirect RDMA unknown: {facts.error}")]
    peermem = bool(facts.modules & set(PEERMEM_MODULES))
    dmabuf = bool(facts.nvidia_open) and kernel_at_least(facts.kernel, 5, 12)
    if want == "peermem" and not peermem:
        return [(Status.CRITICAL, "GPUDirect RDMA unavailable: nvidia_peermem not loaded")]
    if want == "dmabuf" and not dmabuf:
        why = ("the NVIDIA module is not the open one" if facts.nvidia_open is False
               else "no NVIDIA module" if facts.nvidia_open is None
               else f"kernel {facts.kernel} < 5.12")
        return [(Status.CRITICAL, f"GPUDirect RDMA (DMA-BUF) unavailable: {why}")]
    if want == "any" and not (peermem or dmabuf):
        return [(Status.CRITICAL, "GPUDirect RDMA unavailable: nvidia_peermem not loaded and "
                 "no DMA-BUF path (open NVIDIA module on Linux >= 5.12)")]
    return []


def _link_problems(p: PortFacts, expected: IBExpect) -> tuple[list[tuple[Status, str]], bool,
                                                             float | None]:
    """One present, readable port's link: ACTIVE/LinkUp, its rate against the class's, its link
    layer. Returns the problems, whether the port is up (ACTIVE and LinkUp) and its rate when
    up and readable."""
    problems: list[tuple[Status, str]] = []
    up = p.state == "ACTIVE" and p.phys_state == "LinkUp"
    if p.state != "ACTIVE":
        phys = f" (phys_state {p.phys_state})" if p.phys_state != "LinkUp" else ""
        problems.append((Status.CRITICAL, f"{p.port} state {p.state}{phys}"))
    elif p.phys_state != "LinkUp":
        problems.append((Status.CRITICAL, f"{p.port} phys_state {p.phys_state}"))
    rate = p.rate_gbps if up else None
    if up and rate is None:
        problems.append((Status.UNKNOWN, f"{p.port} rate unreadable {p.rate_text!r}"))
    elif rate is not None and rate < expected.rate_gbps:
        problems.append((Status.CRITICAL, f"{p.port} rate {rate:g} Gb/s < "
                         f"{expected.rate_gbps:g} ({p.rate_text})"))
    if p.link_layer != expected.link_layer:
        problems.append((Status.CRITICAL, f"{p.port} link_layer {p.link_layer} "
                         f"(expected {expected.link_layer})"))
    return problems, up, rate


@dataclass
class _Counters:
    """The error counters summed over the ports, for the metrics: totals, increases since the
    last reading, and each counter's highest per-hour rate on one port."""

    totals: dict[str, float] = field(default_factory=dict)
    increases: dict[str, float] = field(default_factory=dict)
    rate_max: dict[str, float] = field(default_factory=dict)


def _counter_problems(p: PortFacts, limits: IBThresholds, age: float | None,
                      sums: _Counters) -> list[tuple[Status, str]]:
    """One readable port's error counters against the class's limits: a ceiling on the value,
    on the increase since the last reading, and on the rate; the port's figures are added to
    `sums`."""
    problems: list[tuple[Status, str]] = []
    for name, value in {**p.counters, **p.hw_counters}.items():
        sums.totals[name] = sums.totals.get(name, 0.0) + value
    for name, ceiling in limits.max_counters.items():
        now_v = p.counters.get(name)
        if now_v is not None and now_v > ceiling:
            problems.append((Status.WARNING, f"{p.port} {name} {now_v} > {ceiling}"))
    if p.previous is None:
        return problems
    both = {**p.counters, **p.hw_counters}
    prev = {**p.previous, **(p.previous_hw or {})}
    for name, now_v in both.items():
        before = prev.get(name)
        if isinstance(before, int):
            sums.increases[name] = sums.increases.get(name, 0.0) + _increase(now_v, before)
    for name, allowed in limits.max_increase.items():
        cur, before = both.get(name), prev.get(name)
        if isinstance(cur, int) and isinstance(before, int):
            inc = _increase(cur, before)
            if inc > allowed:
                problems.append(judge_increase(p.port, name, before, cur, allowed, age,
                                               limits.increase_window_s))
    if age is None or age < max(limits.rate_min_interval_s, 1.0):
        return problems
    for name, rate_cap in limits.max_rate_per_h.items():
        cur, before = both.get(name), prev.get(name)
        if not (isinstance(cur, int) and isinstance(before, int)):
            continue
        inc = _increase(cur, before)
        per_h = inc * 3600.0 / age
        sums.rate_max[name] = max(sums.rate_max.get(name, 0.0), per_h)
        already = name in limits.max_increase and inc > limits.max_increase[name]
        if per_h > rate_cap and not already:  # CRITICAL above already
            problems.append((Status.WARNING, f"{p.port} {name} {per_h:.3g}/h > "
                             f"{rate_cap:g}/h (+{inc} {fmt_interval(age)})"))
    return problems


def _ib_metrics(facts: IBFacts, expected: IBExpect, active: int, rates: list[float],
                sums: _Counters) -> dict[str, float]:
    metrics: dict[str, float] = {
        "ports_expected_count": len(expected.ports),
        "ports_active_count": active,
    }
    for name, per_h in sums.rate_max.items():
        metrics[f"{name}_max_per_h"] = per_h
    widths = [link.width for link in facts.pci if link.width is not None]
    if widths:
        metrics["hca_pcie_width_min"] = min(widths)
    if rates:
        metrics["rate_min_gbps"] = min(rates)
    for name, total in sums.totals.items():
        if name in WORD_COUNTERS:
            metrics[f"{name}_bytes"] = total * 4
        else:
            metrics[f"{name}_total"] = total
    for name, total_inc in sums.increases.items():
        if name not in WORD_COUNTERS:
            metrics[f"{name}_increase_count"] = total_inc
    if facts.previous_age_s is not None:
        metrics["baseline_age_s"] = facts.previous_age_s
    return metrics


@check("ib", probe=probe_ib)
def evaluate_ib(facts: IBFacts, cls: NodeClass) -> CheckResult:
    """InfiniBand ports present, ACTIVE/LinkUp at the class's rate; error counters."""
    expected = cls.ib
    if facts.error:
        return CheckResult("ib", Status.UNKNOWN, facts.error)
    if not expected.ports:
        return CheckResult("ib", Status.OK, f"no InfiniBand ports expected ({len(facts.found)} present)",
                           {"ports_expected_count": 0, "ports_present_count": len(facts.found)})
    problems: list[tuple[Status, str]] = []
    sums = _Counters()
    rates: list[float] = []
    active = 0
    for p in facts.ports:
        if not p.present:
            problems.append((Status.CRITICAL, f"{p.port} missing"))
            continue
        if p.error:
            problems.append((Status.UNKNOWN, f"{p.port} unreadable: {p.error}"))
            continue
        link, up, rate = _link_problems(p, expected)
        problems += link
        active += up
        if rate is not None:
            rates.append(rate)
        problems += _counter_problems(p, cls.ib_limits, facts.previous_age_s, sums)
    problems += evaluate_pci(facts.pci)
    problems += evaluate_gpudirect(facts.gpudirect, expected.gpudirect)
    metrics = _ib_metrics(facts, expected, active, rates, sums)
    status, summary = summarize(problems)
    if summary is None:
        rate_txt = f" at {min(rates):g} Gb/s" if rates else ""
        summary = f"{active}/{len(expected.ports)} ports ACTIVE LinkUp{rate_txt}"
    return CheckResult("ib", status, summary, metrics, components=port_components(facts.ports))
