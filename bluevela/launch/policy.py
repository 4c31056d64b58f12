"""What the supervisor does after a step: the relaunch policy as one pure function.

`next_action(result, allocation, options)` reads how the step ended (`StepResult`), what the
job holds (`Allocation`) and what it allows (`PolicyOptions`), and answers one of

- `Exit`: the job ends here with this status (it finished, a rank failed on nodes that all
  answered, or Slurm is ending it: SIGTERM, whenever it came, `Allocation.signal`);
- `Requeue`: through Slurm, after letting go of lost nodes (the checkpoint signal; nothing
  left in this allocation to run on; too many relaunches);
- `Relaunch`: a new step in this allocation (in place after a hang, on a spare, on fewer
  nodes, or on a node just grown: for a lost node, or for a hang's node when no spare is
  left);
- `Grow`: ask Slurm for nodes first (bluevela/launch/grow.py), then ask again with the
  outcome in `Allocation.grown`.

No sockets, no processes, no Slurm: the supervisor does what the answer says
(docs/resilience.md, "What bv does inside the job"). Standard library only.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from bluevela.goodput.outcome import Loss, StepEnd
from bluevela.launch.attempts import compress
from bluevela.launch.step_result import StepResult

GROWTH_OFF = "job growth is off in site.yaml (launch.grow_deadline_s: 0)"
NOTHING_TO_GROW_FROM = "no node of the job is left to grow from"


class JobSignal(enum.Enum):
    """A signal the job got, as the policy reads it (the supervisor maps the numbers)."""

    CHECKPOINT = "checkpoint"  # SIGUSR1: Slurm's --signal before the time limit, or an operator
    STOP = "stop"  # SIGTERM/SIGINT: Slurm is ending the job (scancel, requeue, preemption)


STOP_RC = 143  # 128 + SIGTERM: the job's status when Slurm's SIGTERM ends it


@dataclass(frozen=True)
class PolicyOptions:
    want: int  # training nodes per step (--nodes)
    min_nodes: int  # the fewest a step may run on (--min-nodes; `want` when not elastic)
    max_relaunches: int = 8  # launches in one allocation before a requeue
    grow: bool = False  # the site lets a job grow (launch.grow_deadline_s > 0)


@dataclass(frozen=True)
class Grown:
    """What a grow that `Grow` asked for did."""

    added: tuple[str, ...] = ()  # the new nodes; empty when it failed
    seconds: float = 0.0
    why: str = ""  # why it failed
    released: tuple[str, ...] = ()  # lost nodes the job already let go of

    @property
    def ok(self) -> bool:
        return bool(self.added)


@dataclass(frozen=True)
class Allocation:
    """What the job holds when the step has ended."""

    nodes: tuple[str, ...]  # the job's nodes (after a grow: with the new ones)
    excluded: Mapping[str, Loss]  # nodes no step may use, and why
    step: tuple[str, ...]  # the nodes of the step that ended
    launch: int  # launches so far in this allocation, this one included (1-based)
    grown: Grown | None = None  # the outcome of the grow a `Grow` answer asked for
    # The job's signal so far (`step.Signals.seen`), whenever it came (in the step, during
    # a grow, between steps): SIGTERM ends the job, SIGUSR1 (the checkpoint signal) requeues
    # it; neither relaunches nor grows.
    signal: JobSignal | None = None


@dataclass(frozen=True)
class Exit:
    rc: int
    cause: str  # the end line's words


@dataclass(frozen=True)
class Requeue:
    cause: str  # the end line's words
    release: tuple[str, ...] = ()  # lost nodes to let go of first (scontrol update NodeList=)
    exclude: Mapping[str, Loss] = field(default_factory=dict)  # left out from now on


@dataclass(frozen=True)
class Relaunch:
    nodes: tuple[str, ...]  # the next step's nodes
    cause: str  # the end line's words, and the next banner's `previous:`
    exclude: Mapping[str, Loss] = field(default_factory=dict)


@dataclass(frozen=True)
class Grow:
    keep: tuple[str, ...]  # the job's nodes it keeps
    lost: tuple[str, ...]  # the nodes to let go of, in whose place nodes are added
    count: int  # nodes to add
    exclude: Mapping[str, Loss] = field(default_factory=dict)
    # The nodes in `lost` answered (a hang's node): let go of them only once a node is
    # grown, so that a failed grow still relaunches in place.
    alive: bool = False


Action = Exit | Requeue | Relaunch | Grow


def choose_nodes(alloc: Sequence[str], excluded: Iterable[str], want: int,
                 min_nodes: int) -> list[str] | None:
    """The nodes of the next step: `want` healthy ones in allocation order, else at least
    `min_nodes` (elastic shrink), else None (nothing to run on inside this allocation)."""
    bad = set(excluded)
    healthy = [n for n in alloc if n not in bad]
    if len(healthy) >= want:
        return healthy[:want]
    if len(healthy) >= min_nodes:
        return healthy
    return None


def next_action(result: StepResult, alloc: Allocation, opts: PolicyOptions) -> Action:
    """What to do after a step that ended as `result`."""
    if result.kind is StepEnd.OK:
        return Exit(0, result.cause or "exit 0")
    if result.kind is StepEnd.FAILED:
        return Exit(result.rc or 1, result.cause)
    if result.kind is StepEnd.TERMINATED:
        return Exit(result.rc, result.cause)
    lost = tuple(sorted(result.lost))
    released = alloc.grown.released if alloc.grown is not None else ()
    if alloc.signal is JobSignal.STOP:
        # Slurm is ending the job (scancel, its own requeue, preemption): never requeue or
        # relaunch it; the lost nodes are named in the goodput end.
        return Exit(STOP_RC, f"{result.cause}; SIGTERM from Slurm while the "
                    "step ended: the job ends here (not relaunched, not requeued by bv)")
    if result.kind is StepEnd.SIGNAL:
        # Nodes lost in the checkpoint window are let go of first: else the requeued job
        # waits in COMPLETING for SlurmdTimeout.
        return Requeue(result.cause, tuple(n for n in lost if n not in released),
                       dict(result.lost))
    if alloc.signal is JobSignal.CHECKPOINT:
        return Requeue(f"{result.cause}; the checkpoint signal came while the step ended: "
                       "requeued by bv", tuple(n for n in lost if n not in released),
                       dict(result.lost))
    if result.kind is StepEnd.HANG and not result.lost:
        return _after_hang(result, alloc, opts)
    return _after_loss(result, alloc, opts)


def _after_hang(result: StepResult, alloc: Allocation, opts: PolicyOptions) -> Action:
    """Every node answered the abort: they are alive. Relaunch in place (no Slurm requeue, no
    credential hold), on a spare instead of the hung rank's node when the allocation has one."""
    if alloc.launch > opts.max_relaunches:
        return Requeue(f"{result.cause}; {opts.max_relaunches} relaunches done, requeued by bv")
    hung = result.hang_node
    exclude: dict[str, Loss] = {}
    how = f"relaunching on the same nodes ({compress(alloc.step)}; no Slurm requeue)"
    if hung and hung in alloc.step:
        if alloc.grown is not None:
            return _after_hang_grow(result, hung, alloc, opts)
        spare = [n for n in alloc.nodes if n not in alloc.step and n not in alloc.excluded]
        keep = tuple(n for n in alloc.nodes if n != hung and n not in alloc.excluded)
        if spare:
            exclude[hung] = Loss.hung()
            excluded = {**alloc.excluded, **exclude}
            shown = choose_nodes(alloc.nodes, excluded, opts.want, opts.want) or alloc.step
            how = (f"relaunching on {compress(shown)} (spare {spare[0]} for {hung}; no Slurm "
                   "requeue)")
        elif opts.grow and keep:
            # No spare left: a node grown in place of the hung rank's (it may be the broken
            # one); the hung node is let go only once the new one is in.
            return Grow(keep, (hung,), 1, alive=True)
    return _relaunch(f"{result.cause}; {how}", alloc, exclude, opts)


def _after_hang_grow(result: StepResult, hung: str, alloc: Allocation,
                     opts: PolicyOptions) -> Relaunch | Requeue:
    """The grow a hang asked for is done: relaunch on the grown node instead of the hung
    rank's; when none came, in place (the hung node is still the job's), or, had the grow
    already let go of it, on what is left."""
    grown = alloc.grown
    assert grown is not None
    who = f"rank {result.hang_rank}" if result.hang_rank is not None else "a rank"
    if grown.ok:
        exclude = {hung: Loss.hung()}
        nxt = choose_nodes(alloc.nodes, {**alloc.excluded, **exclude}, opts.want,
                           opts.min_nodes) or []
        cause = (f"{result.cause}; grown {compress(grown.added)} in place of {hung} ({who} "
                 f"hung there): relaunching on {compress(nxt)} (grown {compress(grown.added)} "
                 f"in {grown.seconds:.1f} s, same job, no Slurm requeue)")
        return _relaunch(cause, alloc, exclude, opts)
    if hung in grown.released:
        return _relaunch(f"{result.cause}; no node grown ({grown.why}) and {hung} let go",
                         alloc, {hung: Loss.hung()}, opts, released=grown.released)
    return _relaunch(f"{result.cause}; no node grown in place of {hung} ({grown.why}): "
                     f"relaunching on the same nodes ({compress(alloc.step)}; no Slurm "
                     "requeue)", alloc, {}, opts)


def _relaunch(cause: str, alloc: Allocation, exclude: Mapping[str, Loss],
              opts: PolicyOptions, released: tuple[str, ...] = ()) -> Relaunch | Requeue:
    nodes = choose_nodes(alloc.nodes, {**alloc.excluded, **exclude}, opts.want, opts.min_nodes)
    if nodes is None:  # only after a grow that let go of a hung node and added none
        return Requeue(f"{cause}; no healthy node left to relaunch on in this allocation "
                       f"(need {opts.min_nodes}), requeued by bv",
                       tuple(n for n in exclude if n not in released), exclude)
    return Relaunch(tuple(nodes), cause, exclude)


def _after_loss(result: StepResult, alloc: Allocation, opts: PolicyOptions) -> Action:
    """A lost node: relaunch in this allocation without it if the job allows (a spare, fewer
    nodes, or a node grown in its place), else let go of it and requeue."""
    lost = tuple(sorted(result.lost))
    exclude = dict(result.lost)
    excluded = {**alloc.excluded, **exclude}
    nxt = choose_nodes(alloc.nodes, excluded, opts.want, opts.min_nodes)
    if alloc.launch > opts.max_relaunches:
        return Requeue(f"{result.cause}; {opts.max_relaunches} relaunches done: the job lets "
                       f"go of {compress(lost)} and is requeued by bv", lost, exclude)
    grown = alloc.grown
    if nxt is None and grown is None:
        keep = tuple(n for n in alloc.nodes if n not in excluded)
        if opts.grow and keep:
            return Grow(keep, lost, max(1, opts.want - len(keep)), exclude)
        grown = Grown(why=GROWTH_OFF if not opts.grow else NOTHING_TO_GROW_FROM)
    if nxt is None:
        assert grown is not None
        why = "no spare node (--spare-nodes) and no shrink (--min-nodes)"
        if grown.why:
            why += f"; no node grown ({grown.why})"
        # Let go of the lost nodes unless the grow already did (a second `update NodeList=`
        # is refused for good on 22.05 without accounting).
        release = tuple(n for n in lost if n not in grown.released)
        return Requeue(f"{result.cause}; {why}: the job lets go of {compress(lost)} and is "
                       "requeued by bv", release, exclude)
    spare = [n for n in nxt if n not in alloc.step]
    if grown is not None and grown.ok:
        how = (f"relaunching on {compress(nxt)} (grown {compress(grown.added)} in "
               f"{grown.seconds:.1f} s, same job, no Slurm requeue)")
    elif spare:
        how = f"relaunching on {compress(nxt)} (spare {compress(spare)})"
    else:
        how = f"relaunching on {len(nxt)} of {opts.want} nodes ({compress(nxt)})"
    return Relaunch(tuple(nxt), f"{result.cause}; {how}", exclude)
