"""`bv health resume`'s decisions, node by node (bluevela.fleet.api.resume_nodes), without a
cluster: a stand-in Slurm client answers `nodes()`, and the two actions that would reach Slurm
or the hardware (nodestate.resume_node, the local re-check) are stand-ins whose answers the
test picks. What scontrol then does is covered on the real cluster (tests/health/,
tests/fleet/test_breaker_cluster.py); here every refusal and its message, in their order."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import pytest

from bluevela.errors import SlurmError
from bluevela.fleet import api, nodestate
from bluevela.fleet.nodestate import DrainOutcome
from bluevela.health.result import CheckResult, HealthReport, Status
from bluevela.site import Site
from bluevela.slurm.client import NodeInfo

HERE = "gpu007"


class _Nodes:
    """Only what resume_nodes asks of a Slurm client: the nodes it names."""

    def __init__(self, *nodes: NodeInfo) -> None:
        self.known = {n.name: n for n in nodes}
        self.asked: list[list[str]] = []

    def nodes(self, names: Sequence[str] | None = None) -> list[NodeInfo]:
        self.asked.append(list(names or []))
        return [self.known[n] for n in names or [] if n in self.known]


def test_each_resume_outcome_and_its_message(site: Site,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    ours = f"{site.health.drain_prefix} gpu: xid 79"
    client = _Nodes(
        NodeInfo("idle1", "IDLE"), NodeInfo("idle2", "IDLE"),
        NodeInfo("op1", "IDLE+DRAIN", "maintenance"),
        NodeInfo(HERE, "IDLE+DRAIN", ours), NodeInfo("far1", "DRAIN", ours),
        NodeInfo("far2", "IDLE+DRAIN", ours), NodeInfo("far3", "IDLE+DRAIN", ours),
        NodeInfo("far4", "IDLE+DRAIN", ours))
    answers: dict[str, DrainOutcome | SlurmError] = {
        "idle1": DrainOutcome("idle1", False, "", "not drained; freed stale breaker slot(s) s1"),
        "idle2": SlurmError("slurmctld unreachable"),
        HERE: DrainOutcome(HERE, True, ours),
        "far1": DrainOutcome("far1", True, ours),
        "far2": SlurmError("scontrol: timed out"),
        "far3": DrainOutcome("far3", False, ours, "fleet breaker: 3/16 drained"),
        "far4": DrainOutcome("far4", False, ours),
    }
    resumed: list[str] = []

    def resume_node(client: Any, site_: Site, node: str) -> DrainOutcome:
        resumed.append(node)
        answer = answers[node]
        if isinstance(answer, SlurmError):
            raise answer
        return answer

    gpu_status = [Status.CRITICAL]
    runs: list[dict[str, Any]] = []

    def run_local(site_: Site, **kw: Any) -> HealthReport:
        runs.append(kw)
        return HealthReport("full", (CheckResult("gpu", gpu_status[0], "xid"),))

    monkeypatch.setattr(nodestate, "resume_node", resume_node)
    monkeypatch.setattr(api, "run_local", run_local)
    monkeypatch.setattr(api.socket, "gethostname", lambda: f"{HERE}.cluster.example")

    names = ["bad;name", "ghost", "idle1", "idle2", "op1", HERE, "far1", "far2", "far3", "far4"]
    got = {o.node: o for o in api.resume_nodes(site, client, names)}  # type: ignore[arg-type]
    assert list(got) == names
    assert (got["bad;name"].resumed, got["bad;name"].refused) == (False, True)
    assert "bad;name" in got["bad;name"].message
    assert [(o.resumed, o.refused, o.message) for o in list(got.values())[1:]] == [
        (False, True, "not known to Slurm"),
        (False, False, "not drained; freed stale breaker slot(s) s1 (state IDLE)"),
        (False, False, "not drained; could not check its breaker slots: slurmctld unreachable "
                       "(state IDLE)"),
        (False, True, "drained by an operator (reason: 'maintenance'); bluevela resumes only its "
                      f"own '{site.health.drain_prefix}' drains - use `scontrol update "
                      "NodeName=op1 State=RESUME` if that is intended"),
        (False, True, "re-check failed: still CRITICAL: gpu"),
        (True, False, f"resumed (was: {ours}); its healthcheck and its next prolog re-check it"),
        (False, True, "scontrol failed: scontrol: timed out"),
        (False, True, "fleet breaker: 3/16 drained"),
        (False, True, "not resumed"),
    ]
    # the unsafe name never reached Slurm; a failed re-check resumed nothing
    assert client.asked[0] == ["ghost"] and HERE not in resumed
    assert runs == [{"tier": "full", "phase": "healthcheck", "dcgm_for": "healthcheck"}]

    gpu_status[0] = Status.OK  # the check the drain names passes again: resumed here
    (out,) = api.resume_nodes(site, client, [HERE])  # type: ignore[arg-type]
    assert (out.resumed, out.refused) == (True, False)
    assert out.message == f"resumed (was: {ours}); re-checked here: check 'gpu' passes again"
    (out,) = api.resume_nodes(site, client, [HERE], recheck_local=False)  # type: ignore[arg-type]
    assert out.message == f"resumed (was: {ours}); its healthcheck and its next prolog re-check it"
    assert len(runs) == 2 and resumed[-2:] == [HERE, HERE]

    # the site's DCGM diagnostic before a resume, after the checks pass: its note is added
    dcgm = replace(site.health.dcgm, before_resume_level=1)
    strict = replace(site, health=replace(site.health, dcgm=dcgm))
    diag = [(0, "all passed"), (2, "memory test failed")]
    monkeypatch.setattr(api, "_diag_before_resume", lambda site_: diag.pop(0))
    (out,) = api.resume_nodes(strict, client, [HERE])  # type: ignore[arg-type]
    assert out.message == (f"resumed (was: {ours}); re-checked here: check 'gpu' passes again; "
                           "DCGM diag r1 passes")
    (out,) = api.resume_nodes(strict, client, [HERE])  # type: ignore[arg-type]
    assert (out.resumed, out.refused) == (False, True)
    assert out.message == "re-check failed: DCGM diag r1 before resume: CRITICAL: memory test failed"
    assert diag == [] and resumed.count(HERE) == 3
