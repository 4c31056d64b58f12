"""The nightly acceptance run: every selected idle node alone, then node pairs, judged against
the node class floors and the nodes' own history; failing nodes drained; everything archived.

Phases:

1. Select: idle nodes of the partition (or of `--nodes`), each in a node class.
2. Single-node jobs, one per node, all at once: `bv bench run gemm hbm h2d d2h allreduce`.
3. Pair jobs (`allreduce-pair` over NCCL/gloo, `mpi` under `srun --mpi=pmix`) in rounds of
   node-disjoint pairs: first pairs that cover every node, then follow-up pairs that isolate the
   node or link behind a slow pair (`bluevela.bench.pairing`). Nodes that failed phase 2 are
   not paired (they are drained anyway, and would only make their partners look slow).
4. Drain every culprit with a `bv: nightly <date>:` reason through `bluevela.fleet.nodestate.drain_node`
   (fleet breaker applies). The healthcheck never resumes such a drain; an operator does.
5. Write the night's HDF5 record and its HTML report.

Every job goes through the launch machinery: a `BenchJobRequest` whose `materialize()` is the
script handed to `SlurmClient.submit` (sbatch). Jobs write their figures as JSON into the night's
run directory; this controller reads them back and does all the judging.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import math
import os
import re
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from bluevela.bench import allreduce as allreduce_mod
from bluevela.bench import mpi as mpi_mod
from bluevela.bench import pairing
from bluevela.bench.catalog import get
from bluevela.bench.evaluate import evaluate
from bluevela.bench.nightly_record import to_record as to_record
from bluevela.bench.result import BenchResult, Facts, Status, worst
from bluevela.bench.runner import NODE_MEASUREMENTS, PAIR_MEASUREMENTS, facts_from_document
from bluevela.bench.store import (
    NodeHistory,
    history,
    nightly_dir,
    series,
    write_night,
)
from bluevela.errors import BenchError, LaunchError, SiteConfigError, SlurmError
from bluevela.fleet.nodestate import DrainOutcome, drain_node, release_stale_slots
from bluevela.launch.bench_job import BenchJobRequest, BenchStep
from bluevela.site import NodeClass, Site
from bluevela.slurm.client import JobInfo, SlurmClient
from bluevela.slurm.states import JobState
from bluevela.util.fs import ensure_dir

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class NightlyOptions:
    """How to run one night.

    Args:
        partition: only nodes of this partition (default: all partitions).
        nodes: only these nodes (hostlist already expanded).
        night: the night's id, YYYY-MM-DD (default: today, local time).
        python: the interpreter the batch jobs run (must have bluevela and torch).
        time_limit: Slurm time limit of each benchmark job.
        poll_s: how often Slurm is asked about the jobs.
        job_timeout_s: a job still running after this long is cancelled (could not run).
        pending_timeout_s: a job still pending after this long is cancelled (its node went
            away: drained by a prolog, down).
        max_follow_up_rounds: rounds of isolating pairs after the first pairs.
        budget_s: time budget per sweep point inside the jobs.
        mpi: srun's `--mpi` plugin for the MPI step.
        drain: drain culprits (False: only report them).
        report: write `<night>.html` beside the record.
        qos: the benchmark jobs' QOS (a high priority one keeps backfill off the nodes).
        reservation: the benchmark jobs' reservation (its idle nodes, shown `reserved`, are
            measured too).
    """

    partition: str | None = None
    nodes: tuple[str, ...] | None = None
    night: str | None = None
    python: str = sys.executable
    time_limit: str = "00:30:00"
    poll_s: float = 1.0
    job_timeout_s: float = 1800.0
    pending_timeout_s: float = 120.0
    max_follow_up_rounds: int = 3
    budget_s: float = 0.5
    mpi: str = "pmix"
    drain: bool = True
    report: bool = True
    qos: str | None = None
    reservation: str | None = None

    def __post_init__(self) -> None:
        from bluevela.launch.request import _WORD

        for what, word in (("--qos", self.qos), ("--reservation", self.reservation)):
            if word is not None and not _WORD.match(word):
                raise LaunchError(f"{what} {word!r} is not a plain name")


class Events(Protocol):
    """What the nightly tells its onlooker (progress bars, plain lines, nothing)."""

    def phase(self, name: str, total: int) -> None: ...

    def grow(self, name: str, more: int) -> None: ...

    def job(self, name: str, subject: str, job_id: int, state: str) -> None: ...

    def done(self, name: str, subject: str, status: Status, message: str) -> None: ...

    def note(self, message: str) -> None: ...


class NoEvents:
    """An onlooker that ignores everything."""

    def phase(self, name: str, total: int) -> None:
        pass

    def grow(self, name: str, more: int) -> None:
        pass

    def job(self, name: str, subject: str, job_id: int, state: str) -> None:
        pass

    def done(self, name: str, subject: str, status: Status, message: str) -> None:
        pass

    def note(self, message: str) -> None:
        pass


@dataclass
class Job:
    """One submitted benchmark job and where its results land."""

    subject: str
    nodes: tuple[str, ...]
    files: dict[str, Path]
    log: Path
    round: int = 0
    job_id: int = 0
    info: JobInfo | None = None
    error: str = ""


@dataclass
class SubjectResult:
    """The judged results of one node or one pair."""

    nodes: tuple[str, ...]
    results: list[BenchResult]
    job_id: int
    round: int = 0

    @property
    def status(self) -> Status:
        return worst(r.status for r in self.results)


@dataclass
class NightlyOutcome:
    """What one night found and did."""

    night: str
    selected: list[str]
    skipped: dict[str, str]
    classes: dict[str, str]
    singles: dict[str, SubjectResult] = field(default_factory=dict)
    pairs: list[SubjectResult] = field(default_factory=list)
    culprits: dict[str, str] = field(default_factory=dict)  # node -> why
    verdict: pairing.Verdict | None = None
    drains: list[DrainOutcome] = field(default_factory=list)
    record_path: Path | None = None
    report_path: Path | None = None
    started_utc: str = ""
    finished_utc: str = ""

    @property
    def status(self) -> Status:
        statuses = [s.status for s in self.singles.values()] + [p.status for p in self.pairs]
        if self.culprits:
            statuses.append(Status.CRITICAL)
        return worst(statuses)

    def to_dict(self) -> dict[str, Any]:
        v = self.verdict
        return {
            "night": self.night,
            "status": self.status.name,
            "selected": self.selected,
            "skipped": self.skipped,
            "nodes": {n: {"class": self.classes.get(n), "status": s.status.name,
                          "job_id": s.job_id,
                          "results": [r.to_dict() for r in s.results]}
                      for n, s in self.singles.items()},
            "pairs": [{"nodes": list(p.nodes), "round": p.round, "status": p.status.name,
                       "job_id": p.job_id, "results": [r.to_dict() for r in p.results]}
                      for p in self.pairs],
            "culprits": self.culprits,
            "link_faults": [list(p) for p in v.link_faults] if v else [],
            "unresolved": [list(p) for p in v.unresolved] if v else [],
            "drains": [{"node": d.node, "drained": d.drained, "reason": d.reason,
                        "why_not": d.why_not} for d in self.drains],
            "record": str(self.record_path) if self.record_path else None,
            "report": str(self.report_path) if self.report_path else None,
            "started_utc": self.started_utc,
            "finished_utc": self.finished_utc,
        }


# -- selection ------------------------------------------------------------------------------

def select_nodes(client: SlurmClient, site: Site, partition: str | None,
                 nodes: Sequence[str] | None, *, reservation: str | None = None,
                 ) -> tuple[list[str], dict[str, str], dict[str, str]]:
    """(selected, skipped node -> why, node -> class): idle nodes in a node class (with a
    `reservation`, `reserved` ones too: idle in a reservation, which the jobs then name)."""
    free = {"IDLE", "RESERVED"} if reservation else {"IDLE"}
    known = client.nodes(list(nodes) if nodes else None)
    by_name = {n.name: n for n in known}
    skipped: dict[str, str] = {}
    classes: dict[str, str] = {}
    selected: list[str] = []
    wanted = list(nodes) if nodes else sorted(by_name, key=pairing.natural_key)
    for name in wanted:
        info = by_name.get(name)
        if info is None:
            skipped[name] = "not known to Slurm"
            continue
        if partition and partition not in info.partitions:
            if nodes:
                skipped[name] = f"not in partition {partition}"
            continue
        if info.state.upper() not in free:
            skipped[name] = f"not idle ({info.state}{': ' + info.reason if info.reason else ''})"
            continue
        try:
            classes[name] = site.class_name_for(name)
        except SiteConfigError as exc:
            skipped[name] = str(exc)
            continue
        selected.append(name)
    return selected, skipped, classes



def still_idle(client: SlurmClient, nodes: Sequence[str], *,
               reservation: str | None = None) -> set[str]:
    """The subset of `nodes` that is idle (or, with a `reservation`, RESERVED: idle in it) and
    not drained right now."""
    free = {"IDLE", "RESERVED"} if reservation else {"IDLE"}
    try:
        infos = client.nodes(sorted(set(nodes)))
    except SlurmError as exc:
        logger.warning("asking for node states: %s", exc)
        return set(nodes)
    return {n.name for n in infos if n.state.upper() in free}


# -- job requests ---------------------------------------------------------------------------

def _site_args(site: Site) -> list[str]:
    return ["--site", str(Path(site.source).resolve())] if site.source else []


def node_job(site: Site, node: str, class_name: str, workdir: Path,
             opts: NightlyOptions) -> tuple[BenchJobRequest, Job]:
    """The single-node job of `node`: every node measurement in one `bv bench run`."""
    cls = site.node_class(name=class_name)
    out = workdir / f"{node}.json"
    argv = (opts.python, "-m", "bluevela", *_site_args(site), "bench", "run",
            *NODE_MEASUREMENTS, "--class", class_name, "--budget-s", str(opts.budget_s),
            "--json", "--out", str(out))
    steps = [BenchStep(argv, whole_node=True, gpus_per_node=cls.gpus)]
    files = {"node": out}
    level = site.health.dcgm.nightly_level
    if level:  # then DCGM's own diagnostic (`bv health dcgm`), bounded by its timeout
        files["dcgm"] = workdir / f"{node}.dcgm.json"
        steps.append(BenchStep(
            (opts.python, "-m", "bluevela", *_site_args(site), "health", "dcgm", "--level",
             str(level), "--timeout-s", f"{site.health.dcgm.nightly_timeout_s:g}",
             "--class", class_name, "--out", str(files["dcgm"])),
            whole_node=True, gpus_per_node=cls.gpus))
    req = _request(site, (node,), tuple(steps), cls, workdir, opts, f"bv-bench-{node}")
    return req, Job(node, (node,), files, workdir / "bench-%j.out")


def node_verdict(results: Sequence[BenchResult], dcgm: tuple[Status, str] | None
                 ) -> tuple[Status, str | None]:
    """A node's nightly status and, when it is a culprit, why: its failed figures and a
    CRITICAL DCGM result (which names the failed test and GPU). A DCGM result that could not
    be had (UNKNOWN) or warned does not make a culprit."""
    status = worst(r.status for r in results)
    failures = [_failure_text(results)] if status is Status.CRITICAL else []
    if dcgm is not None and dcgm[0] is Status.CRITICAL:
        failures.append(dcgm[1])
        status = Status.CRITICAL
    return status, ("; ".join(failures) if failures else None)


def dcgm_verdict(path: Path | None) -> tuple[Status, str] | None:
    """The nightly DCGM step's result (`bv health dcgm --out`): (status, "dcgm: <summary>");
    None when the site runs no DCGM at night. A missing or unreadable file is UNKNOWN."""
    if path is None:
        return None
    doc = _load(path)
    if not isinstance(doc, dict) or "status_code" not in doc:
        return Status.UNKNOWN, "dcgm: no result (the step did not run or did not finish)"
    try:
        status = Status(int(doc["status_code"]))
    except (TypeError, ValueError):
        return Status.UNKNOWN, f"dcgm: unreadable result in {path}"
    return status, f"dcgm: {' '.join(str(doc.get('summary', '')).split())}"


def pair_job(site: Site, pair: pairing.Pair, class_name: str, workdir: Path,
             opts: NightlyOptions, round_no: int) -> tuple[BenchJobRequest, Job]:
    """The job of one pair: all_reduce between the two nodes, then MPI point-to-point."""
    cls = site.node_class(name=class_name)
    subject = "+".join(pair)
    ar_out = workdir / f"{subject}.r{round_no}.allreduce.json"
    mpi_out = workdir / f"{subject}.r{round_no}.mpi.json"
    ar_size = cls.bench.pair_size_bytes or (
        allreduce_mod.GPU_DEFAULT_BYTES if cls.gpus else allreduce_mod.CPU_DEFAULT_BYTES)
    mpi_size = cls.bench.mpi_size_bytes or (
        mpi_mod.GPU_NODE_DEFAULT_BYTES if cls.gpus else mpi_mod.CPU_NODE_DEFAULT_BYTES)
    worker = (opts.python, "-m", "bluevela.bench.worker")
    steps = (
        BenchStep((*worker, "allreduce", "--scope", "pair", "--size-bytes", str(ar_size),
                   "--budget-s", str(opts.budget_s), "--out", str(ar_out)),
                  nodes=2, ntasks_per_node=max(cls.gpus, 1), gpus_per_node=cls.gpus,
                  rendezvous=True),
        BenchStep((*worker, "mpi", "--size-bytes", str(mpi_size), "--budget-s",
                   str(opts.budget_s), "--out", str(mpi_out)),
                  nodes=2, ntasks_per_node=1, mpi=opts.mpi),
    )
    req = _request(site, pair, steps, cls, workdir, opts, f"bv-bench-{subject}")
    job = Job(subject, pair, {"allreduce-pair": ar_out, "mpi": mpi_out},
              workdir / "bench-%j.out", round=round_no)
    return req, job


def _request(site: Site, nodes: tuple[str, ...], steps: tuple[BenchStep, ...], cls: NodeClass,
             workdir: Path, opts: NightlyOptions, name: str) -> BenchJobRequest:
    return BenchJobRequest(
        steps=steps, nodelist=nodes, partition=opts.partition, time=opts.time_limit,
        job_name=name, comment=f"bv bench nightly {opts.night}", gpus_per_node=cls.gpus,
        output=str(workdir / "bench-%j.out"), chdir=str(workdir),
        env=tuple(site.launch.env.items()), qos=opts.qos, reservation=opts.reservation,
    )


# -- running jobs ---------------------------------------------------------------------------

def run_jobs(client: SlurmClient, batch: Sequence[tuple[BenchJobRequest, Job]], phase: str,
             events: Events, opts: NightlyOptions, *,
             sleep: Callable[[float], None] = time.sleep,
             clock: Callable[[], float] = time.monotonic) -> list[Job]:
    """Submit every request of `batch`, then poll until each job is terminal (or timed out)."""
    jobs: list[Job] = []
    for req, job in batch:
        try:
            job.job_id = client.submit(req.materialize(), cwd=req.chdir)
            job.log = Path(str(job.log).replace("%j", str(job.job_id)))
            events.job(phase, job.subject, job.job_id, "SUBMITTED")
        except SlurmError as exc:
            job.error = f"could not submit: {exc}"
            events.done(phase, job.subject, Status.UNKNOWN, job.error)
        jobs.append(job)
    pending = {j.job_id: j for j in jobs if j.job_id}
    last: dict[int, str] = {}
    start = clock()
    deadline = start + opts.job_timeout_s
    while pending:
        try:
            infos = client.jobs(list(pending))
        except SlurmError as exc:
            logger.warning("polling jobs: %s", exc)
            infos = []
        for info in infos:
            tracked = pending.get(info.job_id)
            if tracked is None:
                continue
            tracked.info = info
            if last.get(info.job_id) != info.state_name:
                last[info.job_id] = info.state_name
                events.job(phase, tracked.subject, info.job_id, info.state_name)
            if info.state.is_terminal():
                del pending[info.job_id]
            elif (info.state is JobState.PENDING
                  and clock() - start > opts.pending_timeout_s):
                why = f"still pending after {opts.pending_timeout_s:.0f} s ({info.reason})"
                logger.error("cancelling benchmark job %d: %s", info.job_id, why)
                try:
                    client.cancel([info.job_id])
                except SlurmError as exc:
                    logger.warning("cancelling %d: %s", info.job_id, exc)
                tracked.error = f"job {info.job_id} {why}; cancelled"
                del pending[info.job_id]
        if not pending:
            break
        if clock() > deadline:
            ids = sorted(pending)
            logger.error("cancelling benchmark jobs still running after %.0f s: %s",
                         opts.job_timeout_s, ids)
            try:
                client.cancel(ids)
            except SlurmError as exc:
                logger.warning("cancelling %s: %s", ids, exc)
            for job in pending.values():
                job.error = f"still running after {opts.job_timeout_s:.0f} s; cancelled"
            break
        sleep(opts.poll_s)
    return jobs


def _job_failure(job: Job) -> str:
    if job.error:
        return job.error
    state = job.info.state_name if job.info else "UNKNOWN"
    return f"job {job.job_id} {state}, no result file (see {job.log})"


def _load(path: Path) -> Any | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def collect_node(job: Job) -> list[Facts]:
    """The Facts a single-node job left behind (missing ones: "could not run")."""
    doc = _load(job.files["node"])
    found = {f.measurement: f for f in facts_from_document(doc)} if isinstance(doc, dict) else {}
    return [found.get(m) or Facts.failed(m, _job_failure(job), job.nodes)
            for m in NODE_MEASUREMENTS]


def collect_pair(job: Job) -> list[Facts]:
    """The Facts a pair job left behind (missing ones: "could not run")."""
    out = []
    for m in PAIR_MEASUREMENTS:
        doc = _load(job.files[m])
        out.append(Facts.from_dict(doc) if isinstance(doc, dict)
                   else Facts.failed(m, _job_failure(job), job.nodes))
    return out


def judge(facts: Sequence[Facts], site: Site, class_name: str, hist: NodeHistory,
          subjects: Sequence[str]) -> list[BenchResult]:
    """Evaluate each Facts against the class floors and the subjects' history."""
    cls = site.node_class(name=class_name)
    return [evaluate(get(f.measurement), f, cls.bench, series(hist, subjects, f.measurement),
                     gpus=cls.gpus) for f in facts]


# -- the night ------------------------------------------------------------------------------

def _utc_now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _failure_text(results: Sequence[BenchResult]) -> str:
    return "; ".join(v.message for r in results for v in r.failed_figures)


@dataclass
class _Night:
    """One night's phases, each filling `out`: the nodes alone, the pairs, the drains."""

    client: SlurmClient
    site: Site
    opts: NightlyOptions
    events: Events
    workdir: Path
    hist: NodeHistory
    out: NightlyOutcome

    def singles(self) -> None:
        """Every selected node measured alone; a failing one is a culprit."""
        client, site, opts, events, out = self.client, self.site, self.opts, self.events, self.out
        classes = out.classes
        events.phase("single-node", len(out.selected))
        batch = [node_job(site, n, classes[n], self.workdir, opts) for n in out.selected]
        for job in run_jobs(client, batch, "single-node", events, opts):
            node = job.subject
            results = judge(collect_node(job), site, classes[node], self.hist, [node])
            out.singles[node] = SubjectResult((node,), results, job.job_id)
            dcgm = dcgm_verdict(job.files.get("dcgm"))
            status, failed = node_verdict(results, dcgm)
            if failed is not None:
                out.culprits[node] = f"nightly {out.night}: {failed}"
            if dcgm is not None and dcgm[0] not in (Status.OK, Status.CRITICAL):
                events.note(f"{node}: {dcgm[1]}")
            events.done("single-node", node, status,
                        failed or _failure_text(results) or _short(results))

    def pairs(self) -> None:
        """The nodes that passed alone, paired within their class; follow-ups isolate a culprit."""
        opts, events, out = self.opts, self.events, self.out
        pairable: dict[str, list[str]] = {}
        for node in out.selected:
            single = out.singles.get(node)
            if node in out.culprits or single is None:
                continue
            if all(not r.facts or not r.facts.ran for r in single.results):
                continue  # its job never ran: pairing it would only time out
            pairable.setdefault(out.classes[node], []).append(node)
        observations: list[pairing.Observation] = []
        pair_failures: dict[pairing.Pair, str] = {}
        todo = [p for nodes in pairable.values() for p in pairing.initial_pairs(nodes)]
        events.phase("pairs", len(todo))
        round_no = follow = 0
        while todo:
            for group in pairing.rounds(todo):
                round_no += 1
                self._pair_round(group, round_no, observations, pair_failures)
            if follow >= opts.max_follow_up_rounds:
                break
            follow += 1
            todo = [p for nodes in pairable.values()
                    for p in pairing.follow_ups(nodes, observations)]
            if todo:
                events.grow("pairs", len(todo))
                events.note("slow pair(s): measuring " + ", ".join("+".join(p) for p in todo)
                            + " to isolate the fault")
        out.verdict = pairing.verdict(observations)
        for node, partners in out.verdict.culprits.items():
            details = [pair_failures[pairing.pair_of(node, p)] for p in partners
                       if pairing.pair_of(node, p) in pair_failures]
            out.culprits[node] = (f"nightly {out.night}: pairwise bandwidth slow with "
                                  f"{', '.join(partners)} ({details[0] if details else ''})")

    def _pair_round(self, group: list[pairing.Pair], round_no: int,
                    observations: list[pairing.Observation],
                    pair_failures: dict[pairing.Pair, str]) -> None:
        """One round of pairs (no node twice): a pair with a node no longer idle is not run."""
        client, site, opts, events, out = self.client, self.site, self.opts, self.events, self.out
        classes = out.classes
        usable = still_idle(client, [n for p in group for n in p],
                            reservation=opts.reservation)
        for p in [p for p in group if not (p[0] in usable and p[1] in usable)]:
            why = "a node is no longer idle (drained or busy since phase 1)"
            bench = site.node_class(name=classes[p[0]]).bench
            out.pairs.append(SubjectResult(p, [evaluate(get(m), Facts.failed(m, why, p), bench)
                                               for m in PAIR_MEASUREMENTS], 0, round_no))
            observations.append(pairing.Observation(p, False, ran=False))
            events.done("pairs", "+".join(p), Status.UNKNOWN, why)
        group = [p for p in group if p[0] in usable and p[1] in usable]
        batch = [pair_job(site, p, classes[p[0]], self.workdir, opts, round_no) for p in group]
        for job in run_jobs(client, batch, "pairs", events, opts):
            pair = (job.nodes[0], job.nodes[1])
            results = judge(collect_pair(job), site, classes[pair[0]], self.hist, pair)
            out.pairs.append(SubjectResult(pair, results, job.job_id, round_no))
            slow = any(r.status is Status.CRITICAL for r in results)
            ran = all(r.facts is not None and r.facts.ran for r in results)
            observations.append(pairing.Observation(pair, slow, ran or slow))
            if slow:
                pair_failures[pair] = _failure_text(results)
            events.done("pairs", job.subject, worst(r.status for r in results),
                        _failure_text(results) or _short(results))

    def drain(self) -> None:
        """Drain each culprit (unless --no-drain), first freeing the fleet breaker's stale
        slots: the nightly is one process, so it may (bluevela.fleet.nodestate)."""
        client, site, opts, events, out = self.client, self.site, self.opts, self.events, self.out
        if opts.drain and out.culprits:
            try:
                for name in release_stale_slots(client, site):
                    events.note(f"freed stale fleet breaker slot {name}")
            except SlurmError as exc:
                events.note(f"could not check the fleet breaker's slots: {exc}")
        for node, why in sorted(out.culprits.items(), key=lambda kv: pairing.natural_key(kv[0])):
            if not opts.drain:
                out.drains.append(DrainOutcome(node, False, why, "--no-drain"))
                continue
            try:
                outcome = drain_node(client, site, node, why)
            except SlurmError as exc:
                outcome = DrainOutcome(node, False, why, f"drain failed: {exc}")
            out.drains.append(outcome)
            events.note(f"{'drained' if outcome.drained else 'NOT drained'} {node}: "
                        f"{outcome.reason}" + (f" ({outcome.why_not})" if outcome.why_not else ""))


def run_nightly(client: SlurmClient, site: Site, opts: NightlyOptions,
                events: Events | None = None) -> NightlyOutcome:
    """Run one night end to end (blocking). See the module docstring for the phases.

    Raises:
        BenchError: when no node can be measured.
        ArchiveError: when the record cannot be written.
    """
    events = events or NoEvents()
    night = opts.night or dt.date.today().isoformat()
    opts = with_dcgm_time(_with_night(opts, night), site)
    root = nightly_dir(site.path("archive"))
    stamp = dt.datetime.now().strftime("%H%M%S") + f"-{os.getpid()}"
    workdir = ensure_dir(root / "runs" / night / stamp)
    selected, skipped, classes = select_nodes(client, site, opts.partition, opts.nodes,
                                              reservation=opts.reservation)
    out = NightlyOutcome(night, selected, skipped, classes, started_utc=_utc_now())
    for node, why in skipped.items():
        events.note(f"skipping {node}: {why}")
    if not selected:
        raise BenchError("no idle node to measure"
                         + (f" ({'; '.join(f'{n}: {w}' for n, w in skipped.items())})"
                            if skipped else ""))
    max_nights = max(c.bench.regression_nights for c in site.node_classes.values())
    phases = _Night(client, site, opts, events, workdir, history(root, night, max_nights), out)
    phases.singles()  # Phase 1: every node alone.
    phases.pairs()  # Phase 2: pairs within each class, then follow-ups to isolate slow ones.
    phases.drain()  # Phase 3: drain; then the record and the page.
    out.finished_utc = _utc_now()
    out.record_path = write_night(root, to_record(out, site))
    if opts.report:
        from bluevela.report.nightly_html import write_report

        out.report_path = write_report(root, night, root / f"{night}.html")
    return out


def _short(results: Sequence[BenchResult]) -> str:
    bits = []
    for r in results:
        if not r.applicable:
            continue
        for v in r.verdicts:
            if math.isfinite(v.value):
                bits.append(f"{v.name}={v.value:.4g}")
        if r.status is Status.UNKNOWN:
            bits.append(r.message)
    return " ".join(bits)


def _with_night(opts: NightlyOptions, night: str) -> NightlyOptions:
    return replace(opts, night=night)


def with_dcgm_time(opts: NightlyOptions, site: Site) -> NightlyOptions:
    """With DCGM's diagnostic in the node jobs (health.dcgm.nightly_level), their Slurm time
    limit and the watchdog grow by its bound (nightly_timeout_s): a level-3 run of up to an
    hour never meets a limit sized for the benchmarks alone."""
    dcgm = site.health.dcgm
    if not dcgm.nightly_level:
        return opts
    m = re.fullmatch(r"(?:(\d+)-)?(\d+):(\d\d):(\d\d)", opts.time_limit.strip())
    if m is None:
        return replace(opts, job_timeout_s=opts.job_timeout_s + dcgm.nightly_timeout_s)
    days, hours, mins, secs = (int(g or 0) for g in m.groups())
    total_s = ((days * 24 + hours) * 60 + mins) * 60 + secs + dcgm.nightly_timeout_s
    d, rest = divmod(int(total_s), 86400)
    limit = f"{rest // 3600}:{rest % 3600 // 60:02d}:{rest % 60:02d}"
    limit = f"{d}-{limit.zfill(8)}" if d else limit
    return replace(opts, time_limit=limit,
                   job_timeout_s=opts.job_timeout_s + dcgm.nightly_timeout_s)


def start_detached(site: Site, opts: NightlyOptions, *, site_path: str | None = None) -> tuple[
        int, Path]:
    """Start `bv bench nightly --wait` with the same options as a detached process (its own
    session, output to `<nightly>/<night>.log`); return (pid, log path).

    The nightly controller has to outlive the command that started it without `--wait`: it
    reads each round's results before it can choose the next pairs.
    """
    import subprocess

    night = opts.night or dt.date.today().isoformat()
    root = ensure_dir(nightly_dir(site.path("archive")))
    log = root / f"{night}.log"
    argv = [opts.python, "-m", "bluevela"]
    if site_path or site.source:
        argv += ["--site", str(Path(site_path or str(site.source)).resolve())]
    argv += ["bench", "nightly", "--wait", "--night", night, "--budget-s", str(opts.budget_s)]
    if opts.partition:
        argv += ["--partition", opts.partition]
    if opts.nodes:
        argv += ["--nodes", ",".join(opts.nodes)]
    if not opts.drain:
        argv.append("--no-drain")
    for flag, word in (("--qos", opts.qos), ("--reservation", opts.reservation)):
        if word:
            argv += [flag, word]
    with open(log, "ab") as fh:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=fh, stderr=fh,
                                start_new_session=True)
    return proc.pid, log
