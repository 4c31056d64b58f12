"""What the `bv health` commands call: run checks here, the cluster view, resume.

The operator's view of the whole cluster (node overview, version drift, resume with a
recheck, DCGM before resume): it uses the checks of `bluevela.health` and acts through
`bluevela.fleet.nodestate` and the Slurm client. The CLI (`bluevela/cli/cmd_health.py`) only
parses options, calls one of these and prints.
"""

from __future__ import annotations

import logging
import os
import re
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bluevela.errors import SlurmError, UnsafeValueError
from bluevela.util.fs import safe_node_name

if TYPE_CHECKING:
    from bluevela.health.dcgm_runs import Purpose
    from bluevela.health.result import CheckResult, HealthReport
    from bluevela.site import Site
    from bluevela.slurm.client import SlurmClient

logger = logging.getLogger(__name__)

# A spool report's name, a requeued attempt's `.r<k>` included (archive/spool.py).
_SPOOL_NAME = re.compile(
    r"^([0-9]{1,12})\.([A-Za-z0-9_][A-Za-z0-9_.-]{0,63})\.(prolog|epilog)(?:\.r[1-9][0-9]{0,4})?\.json$")


def run_local(
    site: Site,
    *,
    tier: str = "quick",
    checks: Sequence[str] | None = None,
    class_name: str | None = None,
    phase: str = "manual",
    env: Mapping[str, str] | None = None,
    dcgm_for: Purpose | None = None,
) -> HealthReport:
    """Run a tier (or some checks) on this node, probes reading through the `BV_*` roots.

    Args:
        site: the site model.
        tier: site.yaml tier (quick, full, ...).
        checks: run only these (a check outside the tier keeps its full-tier bounds).
        class_name: node class to judge against (default: this host's, or $BV_NODE_CLASS).
        phase: recorded in the facts (leftover GPU processes count at prolog/healthcheck).
        env: where to read BV_SYSFS_ROOT/BV_NVML_SNAPSHOT/BV_KMSG (default os.environ).
        dcgm_for: add the dcgm check at the site's level for this purpose
            (`health.dcgm.<purpose>_level`; nothing when that is 0).

    Raises:
        SiteConfigError: unknown class. HealthError: unknown tier.
    """
    from bluevela.health.context import ProbeContext
    from bluevela.health.runner import default_state_dir, plan_tier, run_plan

    name = class_name or site.class_name_for()
    cls = site.node_class(name=name)
    plan = plan_tier(site, tier, checks)
    ctx = ProbeContext.from_env(cls, name, env=env, state_dir=default_state_dir(site), phase=phase)
    if dcgm_for is not None:
        from bluevela.health.dcgm_runs import with_purpose

        plan, ctx = with_purpose(site, dcgm_for, plan, ctx)
    return run_plan(plan, ctx)


def run_dcgm(site: Site, *, level: int, timeout_s: float, class_name: str | None = None,
             env: Mapping[str, str] | None = None) -> CheckResult:
    """`dcgmi diag -r level` on this node as the dcgm check, bounded by `timeout_s` (the
    nightly's per-node step; `bv health dcgm`)."""
    from bluevela.health.context import ProbeContext
    from bluevela.health.dcgm_runs import run_diag
    from bluevela.health.runner import default_state_dir

    name = class_name or site.class_name_for()
    ctx = ProbeContext.from_env(site.node_class(name=name), name, env=env,
                                state_dir=default_state_dir(site))
    return run_diag(ctx, level, timeout_s)


def _diag_before_resume(site: Site) -> tuple[int, str]:
    from bluevela.health.dcgm_runs import timeout_for

    result = run_dcgm(site, level=site.health.dcgm.before_resume_level,
                      timeout_s=timeout_for(site, "before_resume"))
    return int(result.status), result.summary


def record_snapshot(out: Path, *, include_kmsg: bool = True) -> dict[str, Any]:
    """Record live NVML values in the replay format to `out`; return what was written.

    Raises:
        ImportError: pynvml missing. RuntimeError: NVML could not start. OSError: write failed.
    """
    from bluevela.health.nvml_live import gather_live
    from bluevela.health.nvml_snapshot import write_snapshot

    data = gather_live(include_kmsg=include_kmsg)
    write_snapshot(out, data)
    return data


# -- the cluster view ---------------------------------------------------------------------------


@dataclass(frozen=True)
class NodeHealth:
    name: str
    state: str
    reason: str
    ours: bool  # drained by bluevela
    last: dict[str, Any] | None  # the newest spooled report's summary

    def to_dict(self) -> dict[str, Any]:
        return {"node": self.name, "state": self.state, "reason": self.reason or None,
                "drained_by_bluevela": self.ours, "last_report": self.last}


def _summarize(path: Path, data: Mapping[str, Any]) -> dict[str, Any]:
    raw = data.get("health")
    health: dict[str, Any] = raw if isinstance(raw, dict) else {}
    bad = [c for c in health.get("checks", []) if isinstance(c, dict) and c.get("status") != "OK"]
    return {
        "phase": data.get("phase"), "job_id": data.get("job_id"), "time": data.get("time"),
        "status": health.get("status"), "tier": health.get("tier"),
        "problems": [f"{c.get('name')}: {c.get('status')}: {c.get('summary')}" for c in bad],
        "drained": data.get("drained"), "drain_reason": data.get("drain_reason"),
        "file": str(path),
        "versions": _versions_info(health),
    }


def _versions_info(health: Mapping[str, Any]) -> dict[str, str] | None:
    """The observed versions (the `versions` check's `info`) of a report's health object."""
    for c in health.get("checks", []):
        if isinstance(c, dict) and c.get("name") == "versions" and isinstance(c.get("info"), dict):
            return {str(k): str(v) for k, v in c["info"].items()
                    if isinstance(v, str | int | float)}
    return None


def latest_reports(spool: Path) -> dict[str, dict[str, Any]]:
    """The newest spooled report of each node (by file time), summarized."""
    newest: dict[str, tuple[float, Path]] = {}
    # Ingest moves archived reports to <spool>/done/: the newest may be there. done/ keeps a
    # week of every job's reports (~460,000 files on 4,096 nodes running 8 jobs a day): its
    # entries are looked at as scandir yields them, never held (a list of them took 435 MB).
    for directory in (spool, spool / "done"):
        try:
            it = os.scandir(directory)
        except OSError:
            continue
        with it:
            for entry in it:
                _newer(entry, newest)
    from bluevela.health.state import read_json

    out: dict[str, dict[str, Any]] = {}
    for node, (_, path) in newest.items():
        data = read_json(path)
        if isinstance(data, dict):
            out[node] = _summarize(path, data)
    return out


def _newer(entry: os.DirEntry[str], newest: dict[str, tuple[float, Path]]) -> None:
    """Keep `entry` in `newest` when it is a report newer than its node's so far."""
    m = _SPOOL_NAME.match(entry.name)
    if not m or not entry.is_file(follow_symlinks=False):
        return
    try:
        mtime = entry.stat(follow_symlinks=False).st_mtime
    except OSError:
        return
    node = m.group(2)
    if node not in newest or mtime > newest[node][0]:
        newest[node] = (mtime, Path(entry.path))


def _latest_with_local(site: Site) -> dict[str, dict[str, Any]]:
    """`latest_reports` of the spool, with this host's own last hook run when newer."""
    from bluevela.health.state import LAST_RUN, read_json

    last = latest_reports(site.path("spool"))
    # This node's own last hook run (the healthcheck spools nothing) when it is newer.
    here = socket.gethostname().split(".")[0]
    local = read_json(site.path("state") / LAST_RUN)
    if isinstance(local, dict) and local.get("node") == here:
        mine = _summarize(site.path("state") / LAST_RUN, local)
        if here not in last or (mine.get("time") or 0) > (last[here].get("time") or 0):
            last[here] = mine
    return last


def node_overview(site: Site, client: SlurmClient) -> list[NodeHealth]:
    """Every node's Slurm state and drain reason with its last bluevela report."""
    from bluevela.fleet.nodestate import is_ours

    last = _latest_with_local(site)
    return [NodeHealth(n.name, n.state, n.reason, n.drained and is_ours(site, n.reason),
                       last.get(n.name)) for n in sorted(client.nodes(), key=lambda n: n.name)]


# -- versions across the fleet ------------------------------------------------------------------


@dataclass(frozen=True)
class VersionGroup:
    """Nodes of one class that run identical versions.

    Attributes:
        class_name: their node class ("?" when in none).
        nodes: the nodes, in natural order.
        versions: field -> observed value (absent: not observed).
        drift: fields that differ from the class's pin, or, where unpinned, from the class's
            majority.
    """

    class_name: str
    nodes: tuple[str, ...]
    versions: Mapping[str, str]
    drift: tuple[str, ...]

    @property
    def hostlist(self) -> str:
        import hostlist

        return str(hostlist.collect_hostlist(list(self.nodes)))

    def to_dict(self) -> dict[str, Any]:
        return {"class": self.class_name, "nodes": self.hostlist, "count": len(self.nodes),
                "versions": dict(self.versions), "drift": list(self.drift)}


@dataclass(frozen=True)
class VersionsView:
    """The fleet's observed versions: per class the pins and the majority, nodes grouped by
    identical versions (largest group first), and the nodes with no versions reported."""

    fields: tuple[str, ...]
    pinned: Mapping[str, Mapping[str, tuple[str, ...]]]  # class -> field -> allowed
    majority: Mapping[str, Mapping[str, str]]  # class -> field -> most common value
    groups: tuple[VersionGroup, ...]
    unreported: Mapping[str, tuple[str, ...]]  # class -> nodes without versions

    @property
    def drifting(self) -> tuple[VersionGroup, ...]:
        return tuple(g for g in self.groups if g.drift)

    def to_dict(self, per_node: bool = False) -> dict[str, Any]:
        import hostlist

        out: dict[str, Any] = {
            "fields": list(self.fields),
            "classes": {c: {"pinned": {f: list(v) for f, v in self.pinned.get(c, {}).items()},
                            "majority": dict(self.majority.get(c, {}))}
                        for c in sorted(set(self.majority) | set(self.pinned))},
            "groups": [g.to_dict() for g in self.groups],
            "unreported": {c: hostlist.collect_hostlist(list(n))
                           for c, n in self.unreported.items() if n},
            "drifting_nodes": sum(len(g.nodes) for g in self.drifting),
        }
        if per_node:
            out["nodes"] = {n: {"class": g.class_name, "versions": dict(g.versions),
                                "drift": list(g.drift)}
                            for g in self.groups for n in g.nodes}
        return out


def _class_of(site: Site) -> dict[str, str]:
    return {h: name for name, cls in site.node_classes.items() for h in cls.hostnames}


def versions_view(site: Site, observed: Mapping[str, Mapping[str, str] | None],
                  nodes: Sequence[str]) -> VersionsView:
    """Group `nodes` by class and identical observed versions (pure: tests feed it directly).

    Args:
        site: for the node classes and their pins.
        observed: node -> field -> value (None or absent: nothing reported).
        nodes: the fleet (Slurm's nodes).
    """
    from collections import Counter

    from bluevela.health.checks.versions import FIELDS
    from bluevela.util.names import natural_key

    classes = _class_of(site)
    by_class: dict[str, list[str]] = {}
    for n in sorted(set(nodes), key=natural_key):
        by_class.setdefault(classes.get(n, "?"), []).append(n)
    pinned: dict[str, dict[str, tuple[str, ...]]] = {}
    majority: dict[str, dict[str, str]] = {}
    groups: list[VersionGroup] = []
    unreported: dict[str, tuple[str, ...]] = {}
    for cname, members in sorted(by_class.items()):
        cls = site.node_classes.get(cname)
        pins = {f: a for f in FIELDS
                if cls is not None and (a := cls.versions.allowed(f)) is not None}
        pinned[cname] = pins
        seen = {n: dict(observed.get(n) or {}) for n in members}
        have = {n: v for n, v in seen.items() if v}
        unreported[cname] = tuple(n for n in members if n not in have)
        maj: dict[str, str] = {}
        for f in FIELDS:
            counts = Counter(v[f] for v in have.values() if f in v)
            if counts:
                maj[f] = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[0][0]
        majority[cname] = maj
        tuples: dict[tuple[tuple[str, str], ...], list[str]] = {}
        for n, v in have.items():
            tuples.setdefault(tuple(sorted(v.items())), []).append(n)
        for key, group in tuples.items():
            vers = dict(key)
            drift = tuple(f for f in FIELDS if f in vers and (
                vers[f] not in pins[f] if f in pins else vers[f] != maj.get(f)))
            groups.append(VersionGroup(cname, tuple(group), vers, drift))
    groups.sort(key=lambda g: (g.class_name, -len(g.nodes), natural_key(g.nodes[0])))
    return VersionsView(FIELDS, pinned, majority, tuple(groups), unreported)


def versions_overview(site: Site, client: SlurmClient) -> VersionsView:
    """The versions each node last reported (its newest spooled report, or this host's own
    last hook run), grouped across the fleet."""
    last = _latest_with_local(site)
    names = [n.name for n in client.nodes()]
    return versions_view(site, {n: (last.get(n) or {}).get("versions") for n in names}, names)


# -- resume -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ResumeOutcome:
    node: str
    resumed: bool
    refused: bool  # an operator's drain, or a re-check that still fails
    message: str

    def to_dict(self) -> dict[str, Any]:
        return {"node": self.node, "resumed": self.resumed, "refused": self.refused,
                "message": self.message}


def resume_nodes(site: Site, client: SlurmClient, nodes: Sequence[str], *,
                 recheck_local: bool = True) -> list[ResumeOutcome]:
    """Resume nodes drained by bluevela; refuse operators' drains.

    A node named here that is this host is re-checked first (full tier; the check the drain
    names must pass). For another node (from a login node) the re-check is the node's own:
    its healthcheck, and the prolog before its next job, drain it again if it still fails.
    """
    here = socket.gethostname().split(".")[0]
    return [_resume_one(site, client, raw, here if recheck_local else None) for raw in nodes]


def _resume_one(site: Site, client: SlurmClient, raw: str,
                recheck_here: str | None) -> ResumeOutcome:
    """Resume one named node, or say why not: its name, Slurm's view of it, whose drain it
    is, a re-check when it is this host (`recheck_here`, None: no re-check), then scontrol.

    The order matters: nothing reaches Slurm before the name is safe, and nothing is resumed
    before the drain is known to be bluevela's and the re-check (if any) passed.
    """
    from bluevela.fleet.nodestate import is_ours

    try:
        node = safe_node_name(raw)
    except UnsafeValueError as exc:
        return ResumeOutcome(raw, False, True, str(exc))
    found = client.nodes([node])
    info = next((n for n in found if n.name == node), None)
    if info is None:
        return ResumeOutcome(node, False, True, "not known to Slurm")
    if not info.drained:
        return _not_drained(site, client, node, info.state)
    if not is_ours(site, info.reason):
        return ResumeOutcome(
            node, False, True,
            f"drained by an operator (reason: {info.reason!r}); bluevela resumes only its "
            f"own '{site.health.drain_prefix}' drains - use `scontrol update NodeName={node} "
            "State=RESUME` if that is intended")
    if node == recheck_here:
        ok, note = _recheck_here(site, info.reason)
        if not ok:
            return ResumeOutcome(node, False, True, f"re-check failed: {note}")
        how = f"re-checked here: {note}"
    else:
        how = "its healthcheck and its next prolog re-check it"
    return _resume_drained(site, client, node, info.reason, how)


def _not_drained(site: Site, client: SlurmClient, node: str, state: str) -> ResumeOutcome:
    """A node named for resume that is not drained: an operator resumed it with scontrol, so
    its fleet breaker slot, if any, is given back. Neither resumed nor refused."""
    from bluevela.fleet.nodestate import resume_node

    try:
        note = resume_node(client, site, node).why_not or "not drained"
    except SlurmError as exc:
        note = f"not drained; could not check its breaker slots: {exc}"
    return ResumeOutcome(node, False, False, f"{note} (state {state})")


def _recheck_here(site: Site, reason: str) -> tuple[bool, str]:
    """Whether this host, drained with `reason`, may be resumed, and the note saying why.

    It runs what the healthcheck runs (full tier, DCGM at its level included: a drain may
    name dcgm), and the check the drain names must pass; then the site's DCGM diagnostic
    before a resume (`health.dcgm.before_resume_level`), when it sets one.
    """
    from bluevela.fleet.nodestate import dcgm_gate, passes_for_resume

    report = run_local(site, tier="full", phase="healthcheck", dcgm_for="healthcheck")
    ok, note = passes_for_resume(site, reason, {c.name: int(c.status) for c in report.checks})
    if ok:
        ok, dcgm_note = dcgm_gate(site, lambda: _diag_before_resume(site))
        note = f"{note}; {dcgm_note}" if ok and dcgm_note else dcgm_note or note
    return ok, note


def _resume_drained(site: Site, client: SlurmClient, node: str, reason: str,
                    how: str) -> ResumeOutcome:
    """Resume a node drained by bluevela (scontrol, then its breaker slots freed); `how` says
    what re-checks it, for the message."""
    from bluevela.fleet.nodestate import resume_node

    try:
        result = resume_node(client, site, node)
    except SlurmError as exc:
        return ResumeOutcome(node, False, True, f"scontrol failed: {exc}")
    if result.drained:
        return ResumeOutcome(node, True, False, f"resumed (was: {reason}); {how}")
    return ResumeOutcome(node, False, True, result.why_not or "not resumed")
