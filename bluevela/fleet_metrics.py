"""The fleet's Slurm view as Prometheus text: drains by bluevela, the nightly, operators, and the
fleet breaker's budget per partition.

A node's own textfile (`bluevela.health.metrics`) cannot say that the node is drained: the
drain is Slurm's state, and `bv health resume` changes it from another host. So one host (the
controller, or the admin host that runs the nightly) writes `bluevela_fleet.prom` into its own
node_exporter's textfile directory, from one `sinfo` and one `scontrol show reservation`::

    python -m bluevela.fleet_metrics --out /var/lib/node_exporter/textfile [--every 30]

Families (docs/monitoring.md)::

    bluevela_slurm_node_info{node="gpu001",class="h100"} 1                    # every node
    bluevela_slurm_node_busy{node="gpu001"} 1                                 # runs a job
    bluevela_slurm_node_drained{node="gpu007",class="h100",source="bv",reason="bv: ib: ..."} 1
    bluevela_breaker_nodes{partition="gpu"} 128                               # nodes counted
    bluevela_breaker_limit_nodes{partition="gpu"} 20                          # ceil(N * pct)
    bluevela_breaker_drained_nodes{partition="gpu"} 3                         # used slots
    bluevela_fleet_scrape_success 1                                           # 0: Slurm unreachable

`source` is `bv` (a health check's drain), `nightly` (the acceptance run's) or `operator`
(any reason without the site's prefix). Only drained nodes have a `_drained` series, so the
cardinality is one series per node plus one per drained node. Slurm being unreachable writes
`bluevela_fleet_scrape_success 0` and keeps no other family (stale data would look healthy);
every alert that reads these families is gated on a fresh, successful file
(prolog_epilog/prometheus/bluevela.rules.yml), and BluevelaFleetViewStale fires without one.

`reason` is free text from whoever drained the node: it is made one printable line and cut to
`REASON_MAX_BYTES` UTF-8 bytes, below any `label_value_length_limit` a site sets in its scrape
config (a longer value fails the whole scrape, every node's series with it). Run it as a
daemon (`prolog_epilog/bv-fleet-metrics.service`, unprivileged); one failed cycle logs one line
and the loop goes on.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

from bluevela.errors import BluevelaError
from bluevela.health.metrics import family_lines
from bluevela.site import Site
from bluevela.slurm.client import NodeInfo, ReservationInfo

logger = logging.getLogger(__name__)

FLEET_FILE = "bluevela_fleet.prom"
# Prometheus counts `label_value_length_limit` in bytes (len() of a Go string) and fails the
# whole scrape above it. 128 bytes keeps a reason readable in an alert summary and fits any
# limit a site is likely to set (sites that set one choose 256 or more); Slurm's own reasons
# and bv's `bv: <check>: <summary>` are shorter.
REASON_MAX_BYTES = 128
_ELLIPSIS = "\u2026"


def reason_label(reason: str) -> str:
    """`reason` as one printable line of at most REASON_MAX_BYTES UTF-8 bytes (cut at a
    character, ending in an ellipsis when cut); undecodable bytes already replaced by U+FFFD
    and lone surrogates replaced here."""
    text = reason.encode("utf-8", "replace").decode("utf-8")
    text = "".join(ch if ch.isprintable() else " " for ch in text).strip()
    raw = text.encode("utf-8")
    if len(raw) <= REASON_MAX_BYTES:
        return text
    cut = raw[: REASON_MAX_BYTES - len(_ELLIPSIS.encode("utf-8"))]
    return cut.decode("utf-8", "ignore").rstrip() + _ELLIPSIS


def _class_of(site: Site, node: str) -> str:
    for name, cls in site.node_classes.items():
        if node in cls.hostnames:
            return name
    return ""


def _busy(state: str) -> bool:
    flags = set(state.upper().split("+"))
    return bool(flags & {"ALLOCATED", "MIXED", "COMPLETING"})


def source_of(site: Site, reason: str) -> str:
    """`bv`, `nightly` or `operator`: who drained a node with this reason."""
    from bluevela.fleet.nodestate import is_nightly, is_ours

    if is_nightly(site, reason):
        return "nightly"
    return "bv" if is_ours(site, reason) else "operator"


def render_fleet(site: Site, nodes: Sequence[NodeInfo] | None,
                 reservations: Sequence[ReservationInfo] = ()) -> str:
    """The fleet file's text; `nodes` None means Slurm could not be read."""
    from bluevela.fleet.nodestate import NO_PARTITION, budgets, parse_slots

    lines: list[str] = []
    ok = nodes is not None
    lines += family_lines("bluevela_fleet_scrape_success", "gauge",
                          "1 when sinfo and scontrol answered for this file.",
                          [({}, 1 if ok else 0)])
    lines += family_lines("bluevela_fleet_timestamp_seconds", "gauge",
                          "When this file was written (unix seconds).", [({}, time.time())])
    if nodes is None:
        return "\n".join(lines) + "\n"
    ordered = sorted(nodes, key=lambda n: n.name)
    lines += family_lines("bluevela_slurm_node_info", "gauge",
                          "Every Slurm node and its bluevela class (value 1).",
                          [({"node": n.name, "class": _class_of(site, n.name)}, 1)
                           for n in ordered])
    lines += family_lines("bluevela_slurm_node_busy", "gauge",
                          "1 while the node runs a job (allocated, mixed, completing).",
                          [({"node": n.name}, 1 if _busy(n.state) else 0) for n in ordered])
    drained = [({"node": n.name, "class": _class_of(site, n.name),
                 "source": source_of(site, n.reason), "reason": reason_label(n.reason)}, 1.0)
               for n in ordered if n.drained]
    if drained:
        lines += family_lines("bluevela_slurm_node_drained", "gauge",
                              "1 for each drained or draining node; source bv, nightly or "
                              "operator; reason as Slurm shows it (one line, at most "
                              f"{REASON_MAX_BYTES} bytes).", drained)
    parts = sorted({p for n in ordered for p in n.partitions})
    if any(not n.partitions for n in ordered):
        parts.append(NO_PARTITION)
    found = budgets(site, ordered, parse_slots(reservations), parts)
    for name, help_, attr in (
        ("bluevela_breaker_nodes", "Nodes the fleet breaker counts in the partition.", "total"),
        ("bluevela_breaker_limit_nodes",
         "Nodes bluevela may drain in the partition (health.fleet_breaker_pct).", "limit"),
        ("bluevela_breaker_drained_nodes",
         "Nodes of the partition drained by bluevela (breaker slots in use).", "used"),
    ):
        lines += family_lines(name, "gauge", help_,
                              [({"partition": b.partition}, getattr(b, attr)) for b in found])
    return "\n".join(lines) + "\n"


def write_fleet(site: Site, out_dir: Path, timeout_s: float = 10.0) -> tuple[Path, bool]:
    """Read Slurm once and write `<out_dir>/bluevela_fleet.prom`; (path, Slurm answered).

    Raises:
        OSError: the file could not be written.
    """
    from bluevela.slurm.cli_client import CliSlurmClient
    from bluevela.util.fs import atomic_write, ensure_dir

    client = CliSlurmClient(retry_s=0.0, command_timeout_s=timeout_s)
    nodes: list[NodeInfo] | None
    try:
        nodes = client.nodes()
        reservations = client.reservations(timeout_s=timeout_s)
    except BluevelaError as exc:
        logger.warning("Slurm not readable: %s", exc)
        nodes, reservations = None, []
    ensure_dir(out_dir, 0o755)
    path = out_dir / FLEET_FILE
    atomic_write(path, render_fleet(site, nodes, reservations).encode(), 0o644)
    return path, nodes is not None


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m bluevela.fleet_metrics --out DIR [--every S]`: once, or every S seconds."""
    parser = argparse.ArgumentParser(prog="python -m bluevela.fleet_metrics",
                                     description="Write the fleet's Slurm view for "
                                     "node_exporter's textfile collector.")
    parser.add_argument("--out", required=True, type=Path, help="textfile directory")
    parser.add_argument("--every", type=float, default=0.0,
                        help="rewrite every this many seconds (default: once)")
    parser.add_argument("--site", default=None, help="site.yaml (default: $BV_SITE or /etc)")
    args = parser.parse_args(argv)
    if args.every < 0 or args.every != args.every:
        print("bluevela fleet_metrics: --every must be >= 0", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="bluevela fleet_metrics: %(message)s")
    from bluevela.site import load_site

    try:
        site = load_site(args.site, cwd=False)
    except BluevelaError as exc:
        print(f"bluevela fleet_metrics: {exc}", file=sys.stderr)
        return 2
    stop = False

    def on_term(signum: int, frame: FrameType | None) -> None:
        del signum, frame
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    while True:
        try:
            write_fleet(site, args.out)
        except OSError as exc:
            logger.error("cannot write %s: %s", args.out, str(exc).replace("\n", " "))
            if not args.every:
                return 1
        except Exception as exc:  # noqa: BLE001 - a daemon: one bad cycle must not end it
            # Whatever Slurm's output or a site's value does to one cycle, the next one runs;
            # the file keeps its last timestamp, so BluevelaFleetViewStale says it is old.
            first = (str(exc).splitlines() or [""])[0]
            logger.error("cycle failed: %s: %s", type(exc).__name__, first)
            if not args.every:
                return 1
        if not args.every or stop:
            return 0
        deadline = time.monotonic() + args.every
        while not stop and time.monotonic() < deadline:
            time.sleep(min(0.2, args.every))
        if stop:
            return 0


if __name__ == "__main__":
    sys.exit(main())
