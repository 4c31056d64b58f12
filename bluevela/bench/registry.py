"""The one place a measurement is registered: `@register(...)` on its gather function.

A measurement is a gather function (`RunParams -> Facts`, imports torch/mpi4py inside) and the
checks its headline figures are judged by (figure name -> `BenchThresholds` field). A leaf of
bench/: the modules that define measurements import it to register; `bench.catalog` imports
them and looks the measurements up, so importing this module stays cheap.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from bluevela.bench.result import Facts
from bluevela.site import BenchThresholds

logger = logging.getLogger(__name__)

Scope = Literal["node", "pair"]


@dataclass(frozen=True)
class Check:
    """A headline figure judged against a `BenchThresholds` field.

    Args:
        figure: headline figure name, e.g. `pair_busbw_gbs`.
        threshold: the `BenchThresholds` field, e.g. `pair_busbw_gbs`; 0 there = no limit.
        ceiling: True when lower is better (a latency ceiling), else the field is a floor.
    """

    figure: str
    threshold: str
    ceiling: bool = False


@dataclass(frozen=True)
class RunParams:
    """What a gather function needs to know about the node it runs on.

    Args:
        thresholds: the node class's `bench` section (sizes come from it too).
        gpus: GPUs the node class promises (0: use whatever torch sees); fewer visible GPUs
            than promised make a GPU measurement "could not run".
        procs: ranks for an in-node all_reduce on a CPU node (GPU nodes: one per GPU).
        budget_s: rough time budget per sweep point; iterations adapt to it.
        warmup: warm-up iterations before timing.
        max_iters: upper bound of timed iterations per sweep point.
    """

    thresholds: BenchThresholds
    gpus: int = 0
    procs: int = 2
    budget_s: float = 0.5
    warmup: int = 2
    max_iters: int = 20


Gather = Callable[[RunParams], Facts]


@dataclass(frozen=True)
class Measurement:
    name: str
    scope: Scope
    checks: tuple[Check, ...]
    gather: Gather
    summary: str


_REGISTRY: dict[str, Measurement] = {}


def register(name: str, *, scope: Scope, checks: tuple[Check, ...],
             summary: str) -> Callable[[Gather], Gather]:
    """Register the decorated gather function as measurement `name`.

    Raises:
        ValueError: when `name` is registered twice, or a check names no threshold field.
    """
    for check in checks:
        if check.threshold not in {f.name for f in dataclasses.fields(BenchThresholds)}:
            raise ValueError(f"{name}: no BenchThresholds field {check.threshold!r}")

    def deco(fn: Gather) -> Gather:
        if name in _REGISTRY:
            raise ValueError(f"measurement {name!r} registered twice")
        _REGISTRY[name] = Measurement(name, scope, checks, fn, summary)
        return fn

    return deco


def registered() -> dict[str, Measurement]:
    """The measurements registered so far, by name (all of them: `bench.catalog`)."""
    return dict(_REGISTRY)
