"""The mount write probe against planted names (issue 16 §4).

The probe once wrote `<dir>/.bv-probe.<host>.<pid>` with O_EXCL: a user of a shared scratch
directory who planted that name for the next few thousand pids made every probe fail with
EEXIST, and the node was drained. These tests plant the names for real (regular files and
symlinks to a file the probe must never touch) in a real directory and run the real forked
probe.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

import pytest

from bluevela.health.checks import host
from bluevela.health.checks.host import probe_mounts

PLANTED = 3000


def _next_pids(n: int) -> list[int]:
    """The pids the kernel hands out next (sequential from ns_last_pid, wrapping past
    pid_max to 300 as the kernel does)."""
    last = int(Path("/proc/sys/kernel/ns_last_pid").read_text())
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    out = []
    p = last
    for _ in range(n):
        p += 1
        if p > pid_max:
            p = 300
        out.append(p)
    return out


def _tree(tmp_path: Path) -> tuple[Path, Path, Path]:
    root = tmp_path / "root"
    scratch = root / "data" / "scratch"
    scratch.mkdir(parents=True)
    victim = tmp_path / "victim"
    victim.write_text("must stay as it is\n")
    return root, scratch, victim


def test_planted_pid_names_and_symlinks_neither_block_nor_redirect_the_probe(
        tmp_path: Path) -> None:
    root, scratch, victim = _tree(tmp_path)
    host_name = socket.gethostname()
    for i, pid in enumerate(_next_pids(PLANTED)):
        name = scratch / f".bv-probe.{host_name}.{pid}"
        if i % 2:
            name.symlink_to(victim)
        else:
            name.write_text("planted\n")
    before = sorted(os.listdir(scratch))
    [p] = probe_mounts(root, ["/data"], ["/data/scratch"], 10.0)
    assert p.state == "ok", p  # 6c9e5ca: "write: File exists" -> CRITICAL -> drained
    assert sorted(os.listdir(scratch)) == before  # its own file removed, nothing else touched
    assert victim.read_text() == "must stay as it is\n"
    assert all((scratch / n).is_symlink() or (scratch / n).read_text() == "planted\n"
               for n in before)


def test_a_planted_random_name_is_passed_over(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The first two names drawn are taken (a symlink and a file): the probe draws again.
    token_hex is wrapped only to make the collision happen; the open, EEXIST and retry are
    the real ones."""
    root, scratch, victim = _tree(tmp_path)
    taken = ["ab" * 16, "cd" * 16]
    (scratch / (host.PROBE_PREFIX + taken[0])).symlink_to(victim)
    (scratch / (host.PROBE_PREFIX + taken[1])).write_text("planted\n")
    real = host.secrets.token_hex
    drawn: list[str] = []

    def token_hex(n: int) -> str:
        value = taken[len(drawn)] if n == 16 and len(drawn) < len(taken) else real(n)
        if n == 16:
            drawn.append(value)
        return value

    monkeypatch.setattr(host.secrets, "token_hex", token_hex)
    [p] = probe_mounts(root, ["/data"], ["/data/scratch"], 10.0)
    assert p.state == "ok", p
    assert victim.read_text() == "must stay as it is\n"
    assert sorted(os.listdir(scratch)) == sorted(host.PROBE_PREFIX + t for t in taken)


def test_a_write_dir_that_is_a_symlink_is_not_followed(tmp_path: Path) -> None:
    root, scratch, _ = _tree(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    scratch.rmdir()
    scratch.symlink_to(elsewhere)
    [p] = probe_mounts(root, ["/data"], ["/data/scratch"], 10.0)
    assert p.state == "error" and p.detail.startswith("open dir:"), p
    assert os.listdir(elsewhere) == []


def test_probe_names_are_unpredictable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two probes from this host never use the same name, and neither names host or pid."""
    seen: set[str] = set()
    real_open = os.open

    def spy(path: str, flags: int, *args: Any, **kw: Any) -> int:
        if str(path).startswith(host.PROBE_PREFIX) and flags & os.O_CREAT:
            seen.add(str(path))
        return real_open(path, flags, *args, **kw)

    root, scratch, _ = _tree(tmp_path)
    monkeypatch.setattr(host.os, "open", spy)  # the write runs in this process: no fork here
    assert host._write_probe(scratch) == ""
    assert host._write_probe(scratch) == ""
    monkeypatch.undo()
    assert len(seen) == 2
    for name in seen:
        suffix = name[len(host.PROBE_PREFIX):]
        assert len(suffix) == 32 and int(suffix, 16) >= 0
        assert socket.gethostname() not in name and str(os.getpid()) not in name
    assert os.listdir(scratch) == []
