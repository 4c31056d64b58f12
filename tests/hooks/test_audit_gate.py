"""The action gate (bluevela.util.actions, bluevela.fleet.nodestate): which setting wins, what
a node file that is not one of the three words means, and that audit asks Slurm nothing.

The end-to-end cases (a job on a failing node in audit, the kill-switch reservation on a real
slurmctld) are in tests/hooks/test_hooks_failopen.py and tests/hooks/test_hooks_failopen_cluster.py.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Literal

import pytest

from bluevela.fleet.nodestate import (
    KILL_SWITCH,
    cluster_actions,
    drain_node,
    local_actions,
)
from bluevela.site import Site, load_site
from bluevela.slurm.client import ReservationInfo
from bluevela.util.actions import Actions, node_actions

REPO = Path(__file__).resolve().parents[2]


class NoSlurm:
    """A Slurm client that must not be used: every call fails the test."""

    def __getattr__(self, name: str) -> object:
        raise AssertionError(f"Slurm was asked ({name}) although actions are not enforced")


def _site(mode: Literal["enforce", "audit", "off"]) -> Site:
    site = load_site(REPO / "site.yaml")
    return dataclasses.replace(site, health=dataclasses.replace(site.health, actions=mode))


@pytest.mark.parametrize("text, mode", [
    ("off\n", "off"), ("AUDIT", "audit"), ("  enforce  # canary\n", "enforce"),
    ("", "audit"), ("enforec\n", "audit"), ("\x00\xff", "audit"),
])
def test_node_file_words(text: str, mode: str, tmp_path: Path) -> None:
    f = tmp_path / "actions"
    f.write_bytes(text.encode("latin-1"))
    got = node_actions({"BV_ACTIONS_FILE": str(f)})
    assert got is not None and got.mode == mode


def test_node_file_absent_symlinked_or_unreadable(tmp_path: Path) -> None:
    assert node_actions({"BV_ACTIONS_FILE": str(tmp_path / "none")}) is None
    target = tmp_path / "target"
    target.write_text("enforce\n")
    (tmp_path / "link").symlink_to(target)
    got = node_actions({"BV_ACTIONS_FILE": str(tmp_path / "link")})  # never followed
    assert got == Actions("audit", f"{tmp_path / 'link'} unreadable")
    (tmp_path / "dir").mkdir()
    got = node_actions({"BV_ACTIONS_FILE": str(tmp_path / "dir")})
    assert got is not None and got.mode == "audit"


def test_node_file_overrides_site_both_ways(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "actions"
    monkeypatch.setenv("BV_ACTIONS_FILE", str(f))
    assert local_actions(_site("audit")) == Actions("audit", "site.yaml")
    f.write_text("enforce\n")  # a canary under a fleet in audit
    assert local_actions(_site("audit")) == Actions("enforce", str(f))
    f.write_text("off\n")
    assert local_actions(_site("enforce")).mode == "off"


def test_the_kill_switch_wins_over_everything() -> None:
    others = [ReservationInfo("maint", ("n1",), None), ReservationInfo("bv-drain-gpu-0", ("n2",), 0.0)]
    enforce = Actions("enforce", "/etc/bluevela/actions")
    assert cluster_actions(enforce, others) is enforce
    got = cluster_actions(enforce, [*others, ReservationInfo(KILL_SWITCH, ("n1",), None)])
    assert got == Actions("off", f"reservation {KILL_SWITCH}")


@pytest.mark.parametrize("mode", ["audit", "off"])
def test_not_enforced_drain_asks_slurm_nothing(
        mode: Literal["audit", "off"], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BV_ACTIONS_FILE", str(tmp_path / "none"))
    site = _site(mode)
    out = drain_node(NoSlurm(), site, "gpu001", "ib: mlx5_3/1 state DOWN",  # type: ignore[arg-type]
                     jitter_s=2.0, sleep=lambda s: pytest.fail("no jitter either"))
    assert not out.drained and out.gated == mode and out.rpcs == 0
    assert out.why_not == f"actions {mode} (site.yaml): would drain"
    assert out.reason == "bv: ib: mlx5_3/1 state DOWN"
