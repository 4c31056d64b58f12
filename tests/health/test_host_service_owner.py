"""A user's process named like a service does not stand in for it (issue 16 §4).

The node check once matched required services by the 15-character comm alone: any user could
run a process named `nv-fabricmanage` and a dead Fabric Manager went unnoticed. These tests
start real processes (prctl PR_SET_NAME), one as `nobody` through setpriv, and run the real
node check on the live /proc.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

import bluevela.health.checks  # noqa: F401 - registers the checks
from bluevela.health.checks import get_check
from bluevela.health.context import ProbeContext
from bluevela.health.result import Status
from bluevela.site import NodeClass

NOBODY = 65534
# Names itself `nv-fabricmanage` (what /proc shows for nv-fabricmanager), optionally makes
# itself non-dumpable (its /proc/<pid> then belongs to root), says so, then sleeps.
STANDIN = """
import ctypes, sys, time
libc = ctypes.CDLL(None, use_errno=True)
assert libc.prctl(15, b"nv-fabricmanage", 0, 0, 0) == 0  # PR_SET_NAME
if sys.argv[1] == "undumpable":
    assert libc.prctl(4, 0, 0, 0, 0) == 0  # PR_SET_DUMPABLE 0
print("ready", flush=True)
time.sleep(120)
"""

needs_root = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                                reason="starting a process as nobody needs root and setpriv")


def _start(as_nobody: bool, mode: str = "plain") -> subprocess.Popen[str]:
    argv = [sys.executable, "-I", "-c", STANDIN, mode]
    if as_nobody:
        argv = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"] + argv
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, cwd="/")
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    return p


@pytest.fixture
def stop() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for p in started:
        p.kill()
        p.wait()


def _node_check(owners: dict[str, str] | None = None) -> tuple[Status, str]:
    cls = NodeClass(nodes="n1")
    extra: dict[str, Any] = {"service_owners": owners} if owners is not None else {}
    node = replace(cls.node, required_services=["nv-fabricmanager"], min_free_gib={},
                   max_d_state_s=0, mount_probe_timeout_s=0, **extra)
    r = get_check("node").run_once(ProbeContext(replace(cls, node=node), "t", root=Path("/")))
    return r.status, r.summary


def _no_real_fabric_manager() -> None:
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and (d / "comm").read_text().strip() == "nv-fabricmanage":
                pytest.skip("a process named nv-fabricmanage already runs here")
        except OSError:
            continue


@needs_root
@pytest.mark.parametrize("mode", ["plain", "undumpable"])
def test_a_users_process_named_nv_fabricmanage_is_not_the_service(
        stop: list[subprocess.Popen[str]], mode: str) -> None:
    _no_real_fabric_manager()
    assert _node_check() == (Status.CRITICAL, "service nv-fabricmanager not running")
    p = _start(True, mode)
    stop.append(p)
    assert (Path(f"/proc/{p.pid}/comm").read_text().strip()) == "nv-fabricmanage"
    # undumpable: proc(5) gives its /proc/<pid> files to root (a check by the dir's owner
    # would take it for root's); the status Uid line still says nobody.
    status, summary = _node_check()
    # 6c9e5ca: OK ("... services running"): the user's process stood in.
    assert status is Status.CRITICAL, summary
    assert summary == ("service nv-fabricmanager not running as root (a process of that "
                       f"name runs as uid {NOBODY})")


@needs_root
def test_the_owners_process_counts_and_service_owners_names_another_owner(
        stop: list[subprocess.Popen[str]]) -> None:
    _no_real_fabric_manager()
    stop.append(_start(False))  # root's: the service
    stop.append(_start(True))  # nobody's beside it changes nothing
    status, summary = _node_check()
    assert status is Status.OK, summary
    # A site that runs it as another account names it; root's process then is not it.
    status, summary = _node_check({"nv-fabricmanager": "nobody"})
    assert status is Status.OK, summary  # nobody's process is there too
    stop.pop().kill()
    time.sleep(0.2)
    status, summary = _node_check({"nv-fabricmanager": "nobody"})
    assert status is Status.CRITICAL and "not running as nobody (a process of that name " \
        "runs as uid 0)" in summary, summary
    status, summary = _node_check({"nv-fabricmanager": "no-such-account"})
    assert status is Status.UNKNOWN and "'no-such-account' is not in /etc/passwd" in summary
