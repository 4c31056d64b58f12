"""The hooks' worst case in seconds, from the site settings: what Slurm's timeouts must cover.

Slurm kills a Prolog or Epilog that runs past `PrologEpilogTimeout` and drains the node
("Prolog error", outside the fleet breaker), and kills a HealthCheckProgram at 60 s
(`HEALTHCHECK_KILL_S`, hard-coded in slurmd 22.05). Each hook's worst case is the sum of bounds
the code enforces (pure arithmetic, no Slurm call):

| term | prolog / epilog | healthcheck | bound by |
| --- | --- | --- | --- |
| `start_s` | 5 | 5 | interpreter start, site load (cache), local state writes: measured under 1 s on a 2-core VM (docs/health.md, "Speed"); 5 s leaves room for a cold page cache |
| `lock_wait_s` | 65 | 0 | waiting for another hook (`BV_HOOK_LOCK_WAIT_S`, hooks/lock.py); the healthcheck never waits |
| `run_s` | prolog: the quick tier with nccl (full tier's bounds) when stale; epilog: quick | `healthcheck_cap_s(site)` | the run's cap plus the gpu check's deliberate recheck sleep `gpu.recheck_s` (health/runner.py) |
| `jitter_s` | 2 | 2 | the random wait before a drain's first Slurm call (`HOOK_JITTER_S`) |
| `rpc_s` | (2 reads + 3 creates per partition + 1 drain) x `drain_timeout_s`; the epilog one more read (Slurm's record of the job: slurm/job_record.py) | the larger of the drain's and the resume's calls | fleet/nodestate.py, hooks/phases.py: every Slurm call bounded, no retries |
| `spool_s` | prolog: 1 write (the report), epilog: 2 (the series side file, the report), x `SPOOL_WRITE_TIMEOUT_S` | 0 (no job, no report) | archive/spool.py `run_bounded`: a hung spool costs 10 s per write |

With the repo's site.yaml (quick cap 5 s, full cap 180 s, recheck 1 s, drain_timeout_s 5 s)
and a node in one partition the prolog's worst case is 5 + 65 + 181 + 2 + 30 + 10 = 293 s,
under slurm/hooks.conf's `PrologEpilogTimeout=300`.

The healthcheck's run cap is what is left of slurmd's 60 s once the rest is paid:
60 - start 5 - recheck - max(jitter 2 + drain calls, resume calls), at most
`HEALTHCHECK_LIMIT_S` (55 s): 22 s with the repo's site (a 3 s drain_timeout_s gives 34 s), so
a run that ends at its cap still drains (or resumes) before slurmd's kill. `bv site validate`
compares these with the running Slurm's settings.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from bluevela.site import Site

START_S = 5.0  # interpreter, site load, local state writes (measured < 1 s)
PHASES = ("prolog", "epilog", "healthcheck")
HEALTHCHECK_KILL_S = 60.0  # slurmd kills a HealthCheckProgram after this long (22.05)
HEALTHCHECK_LIMIT_S = 55.0  # the healthcheck's run never longer, whatever the site allows
HEALTHCHECK_MIN_RUN_S = 10.0  # a shorter healthcheck run cap is a site problem (validate)
SPOOL_WRITES = {"prolog": 1, "epilog": 2, "healthcheck": 0}  # bounded spool writes per run


@dataclass(frozen=True)
class Budget:
    """One hook's worst case: its terms (seconds) and their sum."""

    phase: str
    terms: Mapping[str, float]

    @property
    def total_s(self) -> float:
        return sum(self.terms.values())

    def text(self) -> str:
        """`prolog worst case 293 s = start 5 + lock_wait 65 + ...`."""
        parts = " + ".join(f"{k.removesuffix('_s')} {v:g}" for k, v in self.terms.items())
        return f"{self.phase} worst case {self.total_s:g} s = {parts}"


def _recheck_s(site: Site) -> float:
    """The longest deliberate recheck sleep of a class with GPUs (0 on a CPU-only site)."""
    return max((c.gpu.recheck_s for c in site.node_classes.values() if c.gpus > 0), default=0.0)


def drain_rpc_s(site: Site, partitions: int = 1) -> float:
    """A drain's Slurm calls at their timeout: 2 reads + 3 creates per partition + 1 drain."""
    from bluevela.fleet.nodestate import MAX_CREATE_TRIES

    return (2 + MAX_CREATE_TRIES * max(1, partitions) + 1) * site.health.drain_timeout_s


def resume_tail_s(site: Site, partitions: int = 1) -> float:
    """The healthcheck's resume calls after its DCGM gate, at their timeout (nodestate's
    `resume_if_passing`): the kill-switch read, the node read, the resume, the reservations
    read and one slot delete per partition."""
    return (4 + max(1, partitions)) * site.health.drain_timeout_s


def resume_rpc_s(site: Site, partitions: int = 1) -> float:
    """A resume's Slurm calls: the node read before the DCGM gate, then `resume_tail_s`."""
    return site.health.drain_timeout_s + resume_tail_s(site, partitions)


def healthcheck_cap_s(site: Site, partitions: int | None = None) -> float:
    """The healthcheck's run cap: slurmd's 60 s less start-up, the recheck sleep and the
    longer of a drain (jitter + calls) and a resume after it; at most `HEALTHCHECK_LIMIT_S`,
    at least 1 s (`problems` names a site where it is under `HEALTHCHECK_MIN_RUN_S`). The
    drain's calls for `partitions` (default: site.yaml `health.partitions_per_node`, the
    most partitions a node of the site is in)."""
    from bluevela.fleet.nodestate import HOOK_JITTER_S

    if partitions is None:
        partitions = site.health.partitions_per_node

    after = max(HOOK_JITTER_S + drain_rpc_s(site, partitions), resume_rpc_s(site, partitions))
    left = HEALTHCHECK_KILL_S - START_S - _recheck_s(site) - after
    return max(1.0, min(HEALTHCHECK_LIMIT_S, left))


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
    from bluevela.archive.spool import SPOOL_WRITE_TIMEOUT_S
    from bluevela.fleet.nodestate import HOOK_JITTER_S
    from bluevela.health.runner import plan_prolog, plan_tier
    from bluevela.hooks.lock import wait_s

    if phase not in PHASES:
        raise ValueError(f"unknown hook phase {phase!r} (known: {', '.join(PHASES)})")
    rpc = drain_rpc_s(site, partitions)
    if phase == "prolog":
        cap = plan_prolog(site, nccl_stale=True).cap_s
    elif phase == "epilog":
        cap = plan_tier(site, "quick").cap_s
        # One read of Slurm's record of the job, on the node holding the goodput events or a
        # node grown into the job (hooks/phases.py `_slurm_record`).
        rpc += site.health.drain_timeout_s
    else:
        # What the hook runs with (hooks/phases.py): its cap assumes one partition.
        cap = min(plan_tier(site, "full").cap_s, healthcheck_cap_s(site))
        rpc = max(rpc, resume_rpc_s(site, partitions) - HOOK_JITTER_S)
    wait = wait_s(phase) if lock_wait_s is None else (0.0 if phase == "healthcheck"
                                                      else lock_wait_s)
    return Budget(phase, {
        "start_s": START_S,
        "lock_wait_s": wait,
        "run_s": cap + _recheck_s(site),
        "jitter_s": HOOK_JITTER_S,
        "rpc_s": rpc,
        "spool_s": SPOOL_WRITES[phase] * SPOOL_WRITE_TIMEOUT_S,
    })


def worst_case_s(site: Site, phase: str = "prolog", *, partitions: int = 1,
                 lock_wait_s: float | None = None) -> float:
    """The hook's worst case in seconds (`hook_budget(...).total_s`): compare the prolog's and
    the epilog's with Slurm's `PrologEpilogTimeout`, the healthcheck's with 60 s."""
    return hook_budget(site, phase, partitions=partitions, lock_wait_s=lock_wait_s).total_s


def healthcheck_problems(site: Site, *, partitions: int = 1) -> list[str]:
    """The healthcheck against slurmd's 60 s kill: its worst case past it (a node in more
    partitions than the cap assumes), or a run cap too short to check anything."""
    out: list[str] = []
    b = hook_budget(site, "healthcheck", partitions=partitions, lock_wait_s=0.0)
    if b.total_s > HEALTHCHECK_KILL_S:
        hint = (f" (a node in {partitions} partitions: set health.partitions_per_node: "
                f"{partitions})" if partitions > site.health.partitions_per_node else "")
        out.append(f"{b.text()} > slurmd's HealthCheckProgram kill at "
                   f"{HEALTHCHECK_KILL_S:g} s{hint}")
    cap = healthcheck_cap_s(site)
    if cap < HEALTHCHECK_MIN_RUN_S:
        out.append(f"healthcheck run cap {cap:g} s < {HEALTHCHECK_MIN_RUN_S:g} s: the drain's "
                   f"Slurm calls ({drain_rpc_s(site, partitions):g} s at health.drain_timeout_s "
                   f"{site.health.drain_timeout_s:g} s) leave the checks no time")
    return out


def problems(site: Site, prolog_epilog_timeout_s: float | None, *, partitions: int = 1,
             lock_wait_s: float | None = None) -> list[str]:
    """One line per hook whose worst case exceeds its kill: the prolog's and the epilog's
    against Slurm's `PrologEpilogTimeout` (None: not compared), the healthcheck's against
    slurmd's 60 s (`healthcheck_problems`). Empty: every hook fits."""
    out: list[str] = []
    if prolog_epilog_timeout_s is not None:
        for phase in ("prolog", "epilog"):
            b = hook_budget(site, phase, partitions=partitions, lock_wait_s=lock_wait_s)
            if b.total_s > prolog_epilog_timeout_s:
                out.append(f"{b.text()} > PrologEpilogTimeout={prolog_epilog_timeout_s:g}")
    return out + healthcheck_problems(site, partitions=partitions)
