"""`ib`: InfiniBand ports from sysfs (`<root>/sys/class/infiniband/<hca>/ports/<n>/`).

Formats are the kernel's (drivers/infiniband/core/sysfs.c): `state` "4: ACTIVE",
`phys_state` "5: LinkUp", `rate` "400 Gb/sec (4X NDR)", `link_layer` "InfiniBand", and one
decimal number per file in `counters/`. `port_xmit_data`/`port_rcv_data` count 4-byte words.

Verdicts: a missing port, a port not ACTIVE/LinkUp, a rate under the class's, or the wrong
link layer is CRITICAL; an error counter over its absolute ceiling is WARNING (counters
accumulate since boot); an error counter that rose more than allowed since the last reading
(kept in the state dir) is CRITICAL. The baseline is replaced by every run, so a node drained
for a rising counter passes again once the counter stops rising.
"""

from __future__ import annotations

import logging
import os
import re
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from bluevela.health.registry import check
from bluevela.health.result import CheckResult, Status, summarize
from bluevela.health.state import IB_COUNTERS, read_json, write_json

if TYPE_CHECKING:
    from bluevela.health.context import ProbeContext
    from bluevela.site import NodeClass

logger = logging.getLogger(__name__)

SYSFS_IB = "sys/class/infiniband"
_RATE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*Gb/sec")
WORD_COUNTERS = ("port_xmit_data", "port_rcv_data")  # in 4-byte words


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

    @property
    def rate_gbps(self) -> float | None:
        return parse_rate(self.rate_text) if self.rate_text is not None else None


@dataclass(frozen=True)
class IBFacts:
    ports: tuple[PortFacts, ...]
    found: tuple[str, ...] = ()  # every "<hca>/<port>" under sysfs
    previous_age_s: float | None = None
    error: str | None = None  # the sysfs tree itself could not be listed


def parse_state(text: str) -> str:
    """'4: ACTIVE\\n' -> 'ACTIVE'; '5: LinkUp' -> 'LinkUp'; anything else stripped."""
    text = text.strip()
    _, sep, name = text.partition(":")
    return name.strip() if sep else text


def parse_rate(text: str) -> float | None:
    """'400 Gb/sec (4X NDR)' -> 400.0; '2.5 Gb/sec (1X SDR)' -> 2.5; None when unparsable."""
    m = _RATE.match(text)
    return float(m.group(1)) if m else None


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
        )
    except OSError as exc:
        return PortFacts(port, present=True, error=f"{exc.strerror or exc} reading {base}")


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
    age: float | None = None
    if ctx.state_dir is not None and expected:
        stored = read_json(ctx.state_dir / IB_COUNTERS)
        if isinstance(stored, dict) and isinstance(stored.get("ports"), dict):
            previous = {k: v for k, v in stored["ports"].items() if isinstance(v, dict)}
            if isinstance(stored.get("time"), int | float):
                age = max(0.0, time.time() - float(stored["time"]))
        current = {p.port: p.counters for p in ports if p.present and p.counters}
        if current:
            write_json(ctx.state_dir / IB_COUNTERS, {"time": time.time(), "ports": current})
    with_prev = tuple(replace(p, previous=previous[p.port]) if p.port in previous else p
                      for p in ports)
    return IBFacts(with_prev, found=found, previous_age_s=age)


def _increase(now: int, before: int) -> int:
    """Counter increase; a counter that went down was reset (reboot, perfquery -R)."""
    return now - before if now >= before else now


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
    totals: dict[str, float] = {}
    increases: dict[str, float] = {}
    rates: list[float] = []
    active = 0
    limits = cls.ib_limits
    for p in facts.ports:
        if not p.present:
            problems.append((Status.CRITICAL, f"{p.port} missing"))
            continue
        if p.error:
            problems.append((Status.UNKNOWN, f"{p.port} unreadable: {p.error}"))
            continue
        up = p.state == "ACTIVE" and p.phys_state == "LinkUp"
        if p.state != "ACTIVE":
            phys = f" (phys_state {p.phys_state})" if p.phys_state != "LinkUp" else ""
            problems.append((Status.CRITICAL, f"{p.port} state {p.state}{phys}"))
        elif p.phys_state != "LinkUp":
            problems.append((Status.CRITICAL, f"{p.port} phys_state {p.phys_state}"))
        else:
            active += 1
        rate = p.rate_gbps
        if up:
            if rate is None:
                problems.append((Status.UNKNOWN, f"{p.port} rate unreadable {p.rate_text!r}"))
            else:
                rates.append(rate)
                if rate < expected.rate_gbps:
                    problems.append((Status.CRITICAL, f"{p.port} rate {rate:g} Gb/s < "
                                     f"{expected.rate_gbps:g} ({p.rate_text})"))
        if p.link_layer != expected.link_layer:
            problems.append((Status.CRITICAL, f"{p.port} link_layer {p.link_layer} "
                             f"(expected {expected.link_layer})"))
        for name, value in p.counters.items():
            totals[name] = totals.get(name, 0.0) + value
        for name, ceiling in limits.max_counters.items():
            now_v = p.counters.get(name)
            if now_v is not None and now_v > ceiling:
                problems.append((Status.WARNING, f"{p.port} {name} {now_v} > {ceiling}"))
        if p.previous is not None:
            for name, now_v in p.counters.items():
                before = p.previous.get(name)
                if isinstance(before, int):
                    increases[name] = increases.get(name, 0.0) + _increase(now_v, before)
            for name, allowed in limits.max_increase.items():
                cur, before = p.counters.get(name), p.previous.get(name)
                if isinstance(cur, int) and isinstance(before, int):
                    inc = _increase(cur, before)
                    if inc > allowed:
                        problems.append((Status.CRITICAL, f"{p.port} {name} +{inc} since last "
                                         f"reading ({before} -> {cur}, allowed +{allowed})"))
    metrics: dict[str, float] = {
        "ports_expected_count": len(expected.ports),
        "ports_active_count": active,
    }
    if rates:
        metrics["rate_min_gbps"] = min(rates)
    for name, total in totals.items():
        if name in WORD_COUNTERS:
            metrics[f"{name}_bytes"] = total * 4
        else:
            metrics[f"{name}_total"] = total
    for name, total_inc in increases.items():
        if name not in WORD_COUNTERS:
            metrics[f"{name}_increase_count"] = total_inc
    if facts.previous_age_s is not None:
        metrics["baseline_age_s"] = facts.previous_age_s
    status, summary = summarize(problems)
    if summary is None:
        rate_txt = f" at {min(rates):g} Gb/s" if rates else ""
        summary = f"{active}/{len(expected.ports)} ports ACTIVE LinkUp{rate_txt}"
    return CheckResult("ib", status, summary, metrics)
