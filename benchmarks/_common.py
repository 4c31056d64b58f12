"""Shared helpers for the benchmark modules: the Figure record and timing of commands."""

from __future__ import annotations

import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Figure:
    """One measured figure with its unit and goal. `goal` is text like '<= 2.0' or '>= 50'."""

    name: str
    value: float
    unit: str
    goal: str = ""
    note: str = ""

    def met(self) -> bool | None:
        if not self.goal:
            return None
        op, _, num = self.goal.partition(" ")
        target = float(num)
        return {"<=": self.value <= target, ">=": self.value >= target,
                "<": self.value < target, ">": self.value > target}.get(op)

    def line(self) -> str:
        verdict = {True: "MET", False: "MISSED", None: ""}[self.met()]
        goal = f"goal {self.goal}" if self.goal else ""
        return f"{self.name:<44} {self.value:>12.4g} {self.unit:<10} {goal:<14} {verdict} {self.note}".rstrip()

    def as_dict(self) -> dict[str, object]:
        return {"name": self.name, "value": self.value, "unit": self.unit, "goal": self.goal,
                "met": self.met(), "note": self.note}


def time_cmd(argv: Sequence[str], *, env: dict[str, str] | None = None,
             stdin: str | None = None, cwd: Path | None = None) -> float:
    """Wall seconds of one run of a command (process start included); raises on failure."""
    t0 = time.perf_counter()
    subprocess.run(list(argv), check=True, capture_output=True, text=True, input=stdin,
                   env={**os.environ, **(env or {})}, cwd=cwd)
    return time.perf_counter() - t0


def paired_ratio(a: Sequence[str], b: Sequence[str], n: int, **kw: object) -> tuple[float, float, float]:
    """Median of per-pair ratios a/b over n alternating runs; also the medians of a and b."""
    ta, tb, ratios = [], [], []
    for _ in range(n):
        x = time_cmd(a, **kw)  # type: ignore[arg-type]
        y = time_cmd(b, **kw)  # type: ignore[arg-type]
        ta.append(x)
        tb.append(y)
        ratios.append(x / y)
    return statistics.median(ratios), statistics.median(ta), statistics.median(tb)


def percentile(values: Sequence[float], p: float) -> float:
    s = sorted(values)
    k = max(0, min(len(s) - 1, round(p / 100 * (len(s) - 1))))
    return s[k]


PY = sys.executable


def devcluster_env(nodes: int = 3) -> dict[str, str] | None:
    """Bring the dev cluster up (slurm/devcluster; needs root) and return os.environ plus the
    variables its `env` exports; None when it cannot be brought up."""
    import shlex

    if os.geteuid() != 0:
        return None
    dc = [PY, str(REPO / "slurm" / "devcluster")]
    up = subprocess.run([*dc, "up", "--nodes", str(nodes)], capture_output=True, text=True,
                        timeout=600, check=False, env={**os.environ, "BV_PYTHON": PY})
    if up.returncode != 0:
        return None
    out = subprocess.run([*dc, "env"], capture_output=True, text=True, check=True).stdout
    env = dict(os.environ)
    for line in out.splitlines():
        words = shlex.split(line)
        if len(words) == 2 and words[0] == "export":
            key, _, value = words[1].partition("=")
            env[key] = value
    return env


def fit_exponent(ns: Sequence[int], values: Sequence[float]) -> float | None:
    """How a figure grows with N: the least-squares slope of log(value) on log(N) over the
    points with a value > 0 (1: linear, 2: quadratic); None with fewer than 3 such points."""
    pts = [(math.log(n), math.log(v)) for n, v in zip(ns, values, strict=True) if v > 0]
    if len(pts) < 3:
        return None
    mx = sum(x for x, _ in pts) / len(pts)
    my = sum(y for _, y in pts) / len(pts)
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    return sum((x - mx) * (y - my) for x, y in pts) / sxx if sxx else None


def loadavg() -> float:
    """The 1-minute load average, recorded next to a figure on a shared machine."""
    return os.getloadavg()[0]
