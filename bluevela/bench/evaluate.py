"""The pure evaluation of a measurement: `(facts, thresholds, history) -> BenchResult`.

- Floors (and the one ceiling, MPI latency) come from the node class's `bench` thresholds; a
  figure past its limit is CRITICAL (acceptance failed: the nightly drains the node).
- History: a figure regresses when it is worse than the median of the node's last
  `regression_nights` nights by more than `regression_tolerance_pct`; that is a WARNING (reported,
  not drained: the floors are the acceptance line).
- A measurement that could not run is UNKNOWN; one that does not apply (h2d on a CPU node) is OK
  with `applicable=False`.
- Fewer GPUs than the node class has is CRITICAL (the node cannot run a whole-node job), not
  "could not run": a GPU measurement that found too few GPUs records how many it saw
  (`short_of_gpus`, figure `gpus_count`) and is judged against the class's `gpus`.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Mapping, Sequence

from bluevela.bench.registry import Check, Measurement
from bluevela.bench.result import NODE, BenchResult, Facts, Figure, FigureVerdict, Status, worst
from bluevela.site import BenchThresholds

logger = logging.getLogger(__name__)

#: figure name -> its headline values of past nights, oldest first.
History = Mapping[str, Sequence[float]]


GPUS_FIGURE = "gpus_count"


def short_of_gpus(measurement: str, expected: int, seen: int) -> Facts:
    """Facts of a GPU measurement that found fewer GPUs than the class has: not measured, but
    the count is a finding (judged CRITICAL by `evaluate`)."""
    return Facts(measurement, (Figure(GPUS_FIGURE, float(seen), "GPUs", device=NODE),), ran=False,
                 note=f"node class has {expected} GPUs, {seen} visible")


def judge_gpu_count(name: str, facts: Facts, expected: int) -> BenchResult | None:
    """CRITICAL when `facts` saw fewer than `expected` GPUs; None otherwise."""
    seen = facts.headline(GPUS_FIGURE)
    if not expected or seen is None or seen >= expected:
        return None
    message = f"{name}: {seen:g} of {expected} GPUs visible"
    verdict = FigureVerdict(GPUS_FIGURE, seen, "GPUs", Status.CRITICAL, float(expected), False,
                            message=message)
    return BenchResult(name, Status.CRITICAL, message, (verdict,), facts=facts)


def baseline_of(past: Sequence[float], nights: int) -> float:
    """Median of the last `nights` finite values of `past` (NaN when there are none)."""
    recent = [v for v in past if math.isfinite(v)][-nights:]
    return statistics.median(recent) if recent else math.nan


def judge_figure(check: Check, value: float, unit: str, thresholds: BenchThresholds,
                 past: Sequence[float]) -> FigureVerdict:
    """One headline figure against its limit and its own history."""
    limit = float(getattr(thresholds, check.threshold))
    base = baseline_of(past, thresholds.regression_nights)
    name = check.figure
    if not math.isfinite(value):
        return FigureVerdict(name, value, unit, Status.UNKNOWN, limit, check.ceiling, base,
                             f"{name} is not a number ({value})")
    if limit > 0 and (value > limit if check.ceiling else value < limit):
        sign = ">" if check.ceiling else "<"
        word = "ceiling" if check.ceiling else "floor"
        return FigureVerdict(name, value, unit, Status.CRITICAL, limit, check.ceiling, base,
                             f"{name} {value:.4g} {unit} {sign} {word} {limit:g}")
    if math.isfinite(base) and base > 0:
        tol = thresholds.regression_tolerance_pct / 100.0
        change = (value - base) / base
        worse = change > tol if check.ceiling else change < -tol
        if worse:
            return FigureVerdict(
                name, value, unit, Status.WARNING, limit, check.ceiling, base,
                f"{name} {value:.4g} {unit} regressed {abs(change) * 100:.0f}% from the median "
                f"{base:.4g} of the last nights (tolerance "
                f"{thresholds.regression_tolerance_pct:g}%)",
            )
    return FigureVerdict(name, value, unit, Status.OK, limit, check.ceiling, base,
                         f"{name} {value:.4g} {unit}")


def evaluate(measurement: Measurement, facts: Facts, thresholds: BenchThresholds,
             history: History | None = None, *, gpus: int = 0) -> BenchResult:
    """Judge `facts` of `measurement` against the floors in `thresholds` and `history`, and
    the GPUs it saw against the class's `gpus` (0: not judged)."""
    history = history or {}
    name = measurement.name
    short = judge_gpu_count(name, facts, gpus)
    if short is not None:
        return short
    if not facts.ran:
        return BenchResult(name, Status.UNKNOWN, f"{name}: could not run: {facts.note}",
                           facts=facts)
    if not facts.applicable:
        return BenchResult(name, Status.OK, f"{name}: not applicable: {facts.note}",
                           applicable=False, facts=facts)
    verdicts: list[FigureVerdict] = []
    for check in measurement.checks:
        fig = next((f for f in facts.figures if f.name == check.figure and f.headline), None)
        if fig is None and not getattr(thresholds, check.threshold):
            continue  # no limit set and nothing measured: nothing to judge
        if fig is None:
            verdicts.append(FigureVerdict(check.figure, math.nan, "", Status.UNKNOWN,
                                          0.0, check.ceiling,
                                          message=f"{check.figure}: no headline figure"))
            continue
        verdicts.append(judge_figure(check, fig.value, fig.unit, thresholds,
                                     history.get(check.figure, ())))
    status = worst(v.status for v in verdicts)
    shown = [v for v in verdicts if v.status is not Status.OK] or verdicts
    message = f"{name}: " + "; ".join(v.message for v in shown)
    return BenchResult(name, status, message, tuple(verdicts), facts=facts)
