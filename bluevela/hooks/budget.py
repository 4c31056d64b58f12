"""The hooks' worst case in seconds, from the site settings: what Slurm's timeouts must cover.

Slurm kills a Prolog or Epilog that runs past `PrologEpilogTimeout` and drains the node
("Prolog error", outside the fleet breaker), and kills a HealthCheckProgram at 60 s. Each hook's
worst case is the sum of bounds the code enforces (pure arithmetic, no Slurm call):

| term | prolog / epilog | healthcheck | bound by |
| --- | --- | --- | --- |
| `start_s` | 5 | 5 | interpreter start, site load (cache), state and spool writes: measured under 1 s on a 2-core VM (docs/health.md, "Speed"); 5 s leaves room for a cold page cache |
| `lock_wait_s` | 65 | 0 | waiting for another hook (`BV_HOOK_LOCK_WAIT_S`, hooks/lock.py); the healthcheck never waits |
| `run_s` | prolog: the quick tier with nccl (full tier's bounds) when stale; epilog: quick | full tier, at most `HEALTHCHECK_LIMIT_S` | the run's cap plus the gpu check's deliberate recheck sleep `gpu.recheck_s` (health/runner.py) |
| `jitter_s` | 2 | 2 | the random wait before a drain's first Slurm call (`HOOK_JITTER_S`) |
| `rpc_s` | (2 reads + 3 creates per partition + 1 drain) x `drain_timeout_s` | same (a resume instead of a drain costs less) | fleet/nodestate.py: every Slurm call bounded, no retries |

With the repo's site.yaml (quick cap 5 s, full cap 180 s, recheck 1 s, drain_timeout_s 5 s)
and a node in one partition the prolog's worst case is 5 + 65 + 181 + 2 + 30 = 283 s, under
slurm/hooks.conf's `PrologEpilogTimeout=300`. `bv site validate` compares these with the
running Slurm's settings.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from bluevela.site import Site

START_S = 5.0  # interpreter, site load, state and spool writes (measured < 1 s)
PHASES = ("prolog", "epilog", "healthcheck")


@dataclass(frozen=True)
class Budget:
    """One hook's worst case: its terms (seconds) and their sum."""

    phase: str
    terms: Mapping[str, float]

    @property
    def total_s(self) -> float:
        return sum(self.terms.values())

    def text(self) -> str:
        """`prolog worst case 283 s = start 5 + lock_wait 65 + ...`."""
        parts = " + ".join(f"{k.removesuffix('_s')} {v:g}" for k, v in self.terms.items())
        return f"{self.phase} worst case {self.total_s:g} s = {parts}"


def _recheck_s(site: Site) -> float:
    """The longest deliberate recheck sleep of a class with GPUs (0 on a CPU-only site)."""
    return max((c.gpu.recheck_s for c in site.node_classes.values() if c.gpus > 0), default=0.0)


def hook_budget(site: Site, phase: str = "prolog", *, partitions: int = 1,
                lock_wait_s: float | None = None) -> Budget:
    """The worst case of one hook, term by term (module docstring).

    Args:
        site: the validated site.
        phase: prolog, epilog or healthcheck.
        partitions: how many partitions a node is in (the breaker takes a slot in each).
        lock_wait_s: the hooks' lock wait; None: `BV_HOOK_LOCK_WAIT_S` of this process's
            environment, else its default (65 s).

    Raises:
        ValueError: an unknown phase.
    """
    from bluevela.fleet.nodestate import HOOK_JITTER_S, MAX_CREATE_TRIES
    from bluevela.health.runner import plan_prolog, plan_tier
    from bluevela.hooks.lock import wait_s

    if phase not in PHASES:
        raise ValueError(f"unknown hook phase {phase!r} (known: {', '.join(PHASES)})")
    if phase == "prolog":
        cap = plan_prolog(site, nccl_stale=True).cap_s
    elif phase == "epilog":
        cap = plan_tier(site, "quick").cap_s
    else:
        from bluevela.hooks.phases import HEALTHCHECK_LIMIT_S

        cap = min(plan_tier(site, "full").cap_s, HEALTHCHECK_LIMIT_S)
    calls = 2 + MAX_CREATE_TRIES * max(1, partitions) + 1
    wait = wait_s(phase) if lock_wait_s is None else (0.0 if phase == "healthcheck"
                                                      else lock_wait_s)
    return Budget(phase, {
        "start_s": START_S,
        "lock_wait_s": wait,
        "run_s": cap + _recheck_s(site),
        "jitter_s": HOOK_JITTER_S,
        "rpc_s": calls * site.health.drain_timeout_s,
    })


def worst_case_s(site: Site, phase: str = "prolog", *, partitions: int = 1,
                 lock_wait_s: float | None = None) -> float:
    """The hook's worst case in seconds (`hook_budget(...).total_s`): compare the prolog's and
    the epilog's with Slurm's `PrologEpilogTimeout`, the healthcheck's with 60 s."""
    return hook_budget(site, phase, partitions=partitions, lock_wait_s=lock_wait_s).total_s


def problems(site: Site, prolog_epilog_timeout_s: float | None, *, partitions: int = 1,
             lock_wait_s: float | None = None) -> list[str]:
    """One line per hook (prolog, epilog) whose worst case exceeds Slurm's
    `PrologEpilogTimeout` (empty: both fit; None: not checked).

    The healthcheck is not judged here: its run ends at `HEALTHCHECK_LIMIT_S` (55 s) and a
    drain after it can take `rpc_s` more in the worst case (30 s with the defaults), past
    slurmd's 60 s; `hook_budget(site, "healthcheck")` shows it.
    """
    out: list[str] = []
    if prolog_epilog_timeout_s is None:
        return out
    for phase in ("prolog", "epilog"):
        b = hook_budget(site, phase, partitions=partitions, lock_wait_s=lock_wait_s)
        if b.total_s > prolog_epilog_timeout_s:
            out.append(f"{b.text()} > PrologEpilogTimeout={prolog_epilog_timeout_s:g}")
    return out
