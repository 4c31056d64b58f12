"""`bv bench run`: gather measurements on this node, then judge each against the node class.

The JSON document written here (`run_document`) is also what a nightly batch job leaves behind
for the controller: it carries the raw Facts, so the controller judges them again with the
history it alone reads from the archive.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from bluevela.bench.catalog import get
from bluevela.bench.evaluate import History, evaluate
from bluevela.bench.registry import RunParams
from bluevela.bench.result import BenchResult, Facts, Status, worst
from bluevela.errors import SiteConfigError
from bluevela.site import BenchThresholds, Site

logger = logging.getLogger(__name__)

NODE_MEASUREMENTS = ("gemm", "hbm", "h2d", "d2h", "allreduce")
PAIR_MEASUREMENTS = ("allreduce-pair", "mpi")


@dataclass(frozen=True)
class LocalContext:
    """Where `bv bench run` runs: the host, its node class (if any) and its parameters."""

    host: str
    class_name: str | None
    params: RunParams


def local_context(site: Site | None, class_name: str | None = None, *,
                  budget_s: float = 0.5, host: str | None = None) -> LocalContext:
    """Parameters for this host: its class's thresholds and GPU count, else defaults.

    Raises:
        SiteConfigError: when `class_name` is given but unknown.
    """
    host = host or socket.gethostname().split(".")[0]
    if site is None:
        return LocalContext(host, None, RunParams(BenchThresholds(), budget_s=budget_s))
    name = class_name
    if name is None:
        try:
            name = site.class_name_for(host)
        except SiteConfigError:
            logger.warning("%s is in no node class: default parameters, no floors", host)
            return LocalContext(host, None, RunParams(BenchThresholds(), budget_s=budget_s))
    cls = site.node_class(name=name)
    params = RunParams(cls.bench, gpus=cls.gpus, procs=cls.nccl.procs or 2, budget_s=budget_s)
    return LocalContext(host, name, params)


def gather_safely(name: str, params: RunParams) -> Facts:
    """Run one gather; an exception (CUDA error, missing torch) becomes "could not run"."""
    measurement = get(name)
    try:
        return measurement.gather(params)
    except Exception as exc:  # noqa: BLE001 - any failure of the probe is "could not run"
        logger.warning("%s failed: %s: %s", name, type(exc).__name__, exc)
        return Facts.failed(name, f"{type(exc).__name__}: {exc}")


def run_local(names: Sequence[str], ctx: LocalContext,
              history: Mapping[str, History] | None = None) -> list[BenchResult]:
    """Gather and judge each measurement of `names`; results in the order of `names`.

    MPI is gathered last: importing torch after Open MPI is initialised in the same process
    crashed (SIGSEGV) on the dev cluster, the other order works.
    """
    order = sorted(names, key=lambda n: n == "mpi")
    by_name = {}
    for name in order:
        facts = gather_safely(name, ctx.params)
        hist = (history or {}).get(name, {})
        by_name[name] = evaluate(get(name), facts, ctx.params.thresholds, hist,
                                 gpus=ctx.params.gpus)
    return [by_name[name] for name in names]


def run_document(ctx: LocalContext, results: Sequence[BenchResult]) -> dict[str, Any]:
    """The JSON document of one `bv bench run`: raw facts and their verdicts."""
    return {
        "host": ctx.host,
        "class": ctx.class_name,
        "status": worst(r.status for r in results).name,
        "results": [
            {**r.to_dict(), "facts": r.facts.to_dict() if r.facts else None} for r in results
        ],
    }


def facts_from_document(doc: Mapping[str, Any]) -> list[Facts]:
    """The raw Facts of a `run_document` (what the nightly controller judges again)."""
    out = []
    for item in doc.get("results", ()):
        if item.get("facts"):
            out.append(Facts.from_dict(item["facts"]))
    return out


def exit_status(results: Sequence[BenchResult]) -> int:
    """The process exit status: the worst status (Nagios value)."""
    return int(worst(r.status for r in results)) if results else int(Status.OK)
