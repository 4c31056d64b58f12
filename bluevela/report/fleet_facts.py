"""The facts the fleet report is computed from (`bv report fleet`): what `fleet_gather` reads
from the run archive and the nightly store, and what `fleet.compute` takes, with the node
classes of the site and the vocabulary of causes both sides share."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from bluevela.site import Site

CRITICAL = 2
UNKNOWN_CLASS = "(no class)"
NODE_LOST = "node lost"
LEDGER_FAILURE = "node failure"  # a lost node only a job's goodput ledger saw
REQUEUE = "requeue"


@dataclass(frozen=True)
class Event:
    """One failure signal. `node` is "" for a job-level requeue with no node cause."""

    time: float
    node: str
    source: str  # prolog | epilog | job (node lost, requeue) | nightly | ledger
    cause: str  # the check (gpu, ib, ...), nightly measurement, "node lost" or "requeue"
    drained: bool
    job_id: int = 0
    detail: str = ""


@dataclass
class Attempt:
    """One attempt (restart count) of a requeued job, from its reports."""

    first_prolog: float = math.nan
    last_epilog: float = math.nan
    prolog_nodes: set[str] = field(default_factory=set)
    epilog_nodes: set[str] = field(default_factory=set)
    prolog_failed: bool = False  # a prolog of this attempt was CRITICAL


@dataclass
class JobFacts:
    """One job (its newest archived revision), as far as the report needs it."""

    job_id: int
    start: float
    end: float
    num_nodes: int
    exit_code: int
    exit_signal: int
    nodes: list[str]  # the nodes it ran on (its nodelist, less nodes whose prolog failed)
    lost: list[str]  # nodes of its nodelist whose prolog passed and whose epilog never came
    prolog_failed: list[str]  # nodes whose prolog failed for it (Slurm requeued the job)
    epilog_critical: list[str]
    expected: int  # nodes named by its nodelists over every attempt
    restarts: int = 0  # the highest restart count (SLURM_JOB_RESTART_COUNT) its reports carry
    #: restart -> its attempt's facts (only for jobs with restarts > 0)
    attempts: dict[int, Attempt] = field(default_factory=dict)
    #: the supervisor's goodput events, one validated record per attempt that has them
    goodput: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class FleetFacts:
    """What the archive and the nightly store hold about the window."""

    events: list[Event] = field(default_factory=list)
    jobs: list[JobFacts] = field(default_factory=list)
    #: node -> sorted times of its passing (not CRITICAL) prolog reports
    passing_prologs: dict[str, list[float]] = field(default_factory=dict)
    nodes_seen: set[str] = field(default_factory=set)
    reports: int = 0
    nights: list[str] = field(default_factory=list)
    segments: int = 0


@dataclass(frozen=True)
class NodeClassInfo:
    """A node class as the report needs it: its hosts and GPUs per node."""

    nodes: frozenset[str]
    gpus: int


def classes_of(site: Site | None) -> dict[str, NodeClassInfo]:
    """site.yaml's node classes (empty without a site: every node is then in no class)."""
    if site is None:
        return {}
    return {name: NodeClassInfo(frozenset(c.hostnames), int(c.gpus))
            for name, c in site.node_classes.items()}
