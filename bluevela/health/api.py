"""What the `bv health` commands call: run checks here, the cluster view, resume.

The CLI (`bluevela/cli/cmd_health.py`) only parses options, calls one of these and prints.
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
    from bluevela.health.result import HealthReport
    from bluevela.site import Site
    from bluevela.slurm.client import SlurmClient

logger = logging.getLogger(__name__)

_SPOOL_NAME = re.compile(r"^([0-9]{1,12})\.([A-Za-z0-9_][A-Za-z0-9_.-]{0,63})\.(prolog|epilog)\.json$")


def run_local(
    site: Site,
    *,
    tier: str = "quick",
    checks: Sequence[str] | None = None,
    class_name: str | None = None,
    phase: str = "manual",
    env: Mapping[str, str] | None = None,
) -> HealthReport:
    """Run a tier (or some checks) on this node, probes reading through the `BV_*` roots.

    Args:
        site: the site model.
        tier: site.yaml tier (quick, full, ...).
        checks: run only these (a check outside the tier keeps its full-tier bounds).
        class_name: node class to judge against (default: this host's, or $BV_NODE_CLASS).
        phase: recorded in the facts (leftover GPU processes count at prolog/healthcheck).
        env: where to read BV_SYSFS_ROOT/BV_NVML_SNAPSHOT/BV_KMSG (default os.environ).

    Raises:
        SiteConfigError: unknown class. HealthError: unknown tier.
    """
    from bluevela.health.context import ProbeContext
    from bluevela.health.runner import default_state_dir, plan_tier, run_plan

    name = class_name or site.class_name_for()
    cls = site.node_class(name=name)
    plan = plan_tier(site, tier, checks)
    ctx = ProbeContext.from_env(cls, name, env=env, state_dir=default_state_dir(site), phase=phase)
    return run_plan(plan, ctx)


def record_snapshot(out: Path, *, include_kmsg: bool = True) -> dict[str, Any]:
    """Record live NVML values in the replay format to `out`; return what was written.

    Raises:
        ImportError: pynvml missing. RuntimeError: NVML could not start. OSError: write failed.
    """
    from bluevela.health.nvml import gather_live, write_snapshot

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
    }


def latest_reports(spool: Path) -> dict[str, dict[str, Any]]:
    """The newest spooled report of each node (by file time), summarized."""
    newest: dict[str, tuple[float, Path]] = {}
    entries: list[os.DirEntry[str]] = []
    # Ingest moves archived reports to <spool>/done/: the newest may be there.
    for directory in (spool, spool / "done"):
        try:
            entries.extend(os.scandir(directory))
        except OSError:
            continue
    for entry in entries:
        m = _SPOOL_NAME.match(entry.name)
        if not m or not entry.is_file(follow_symlinks=False):
            continue
        try:
            mtime = entry.stat(follow_symlinks=False).st_mtime
        except OSError:
            continue
        node = m.group(2)
        if node not in newest or mtime > newest[node][0]:
            newest[node] = (mtime, Path(entry.path))
    from bluevela.health.state import read_json

    out: dict[str, dict[str, Any]] = {}
    for node, (_, path) in newest.items():
        data = read_json(path)
        if isinstance(data, dict):
            out[node] = _summarize(path, data)
    return out


def node_overview(site: Site, client: SlurmClient) -> list[NodeHealth]:
    """Every node's Slurm state and drain reason with its last bluevela report."""
    from bluevela.health.state import LAST_RUN, read_json
    from bluevela.nodestate import is_ours

    last = latest_reports(site.path("spool"))
    # This node's own last hook run (the healthcheck spools nothing) when it is newer.
    here = socket.gethostname().split(".")[0]
    local = read_json(site.path("state") / LAST_RUN)
    if isinstance(local, dict) and local.get("node") == here:
        mine = _summarize(site.path("state") / LAST_RUN, local)
        if here not in last or (mine.get("time") or 0) > (last[here].get("time") or 0):
            last[here] = mine
    return [NodeHealth(n.name, n.state, n.reason, n.drained and is_ours(site, n.reason),
                       last.get(n.name)) for n in sorted(client.nodes(), key=lambda n: n.name)]


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
    from bluevela.nodestate import is_ours, passes_for_resume, resume_node

    here = socket.gethostname().split(".")[0]
    out: list[ResumeOutcome] = []
    for raw in nodes:
        try:
            node = safe_node_name(raw)
        except UnsafeValueError as exc:
            out.append(ResumeOutcome(raw, False, True, str(exc)))
            continue
        found = client.nodes([node])
        info = next((n for n in found if n.name == node), None)
        if info is None:
            out.append(ResumeOutcome(node, False, True, "not known to Slurm"))
            continue
        if not info.drained:
            # An operator resumed it with scontrol: give back its fleet breaker slot, if any.
            try:
                note = resume_node(client, site, node).why_not or "not drained"
            except SlurmError as exc:
                note = f"not drained; could not check its breaker slots: {exc}"
            out.append(ResumeOutcome(node, False, False, f"{note} (state {info.state})"))
            continue
        if not is_ours(site, info.reason):
            out.append(ResumeOutcome(
                node, False, True,
                f"drained by an operator (reason: {info.reason!r}); bluevela resumes only its "
                f"own '{site.health.drain_prefix}' drains - use `scontrol update NodeName={node} "
                "State=RESUME` if that is intended"))
            continue
        if recheck_local and node == here:
            report = run_local(site, tier="full", phase="healthcheck")
            ok, note = passes_for_resume(site, info.reason,
                                         {c.name: int(c.status) for c in report.checks})
            if not ok:
                out.append(ResumeOutcome(node, False, True, f"re-check failed: {note}"))
                continue
            how = f"re-checked here: {note}"
        else:
            how = "its healthcheck and its next prolog re-check it"
        try:
            result = resume_node(client, site, node)
        except SlurmError as exc:
            out.append(ResumeOutcome(node, False, True, f"scontrol failed: {exc}"))
            continue
        if result.drained:
            out.append(ResumeOutcome(node, True, False, f"resumed (was: {info.reason}); {how}"))
        else:
            out.append(ResumeOutcome(node, False, True, result.why_not or "not resumed"))
    return out
