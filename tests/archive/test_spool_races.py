"""Spool and archive ownership: one ingest user, directories nobody else may write, and every
move/unlink in the spool relative to directory fds (a `done/` or `quarantine/` swapped for a
symlink mid-ingest sends nothing outside the spool).

The swap is deterministic: a profiler hook fires on the first `os.rename`/`os.replace` call
made from bluevela/archive/spool.py during the ingest and swaps the directory right then,
between the ingest's check of the directory and its use.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

from bluevela.archive import query
from bluevela.archive.ingest import ingest
from bluevela.archive.sample import sample_report
from bluevela.archive.spool import write_report
from bluevela.errors import ArchiveError
from bluevela.util.fs import user_name

REPO = Path(__file__).resolve().parents[2]
NOBODY = 65534

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="changing owners needs root")


def _spool_job(spool: Path, job_id: int, nodes: list[str]) -> None:
    for n in nodes:
        for phase in ("prolog", "epilog"):
            write_report(spool, sample_report(job_id, n, phase, nodelist=nodes, time=time.time()))


def _swap_on_first_move(action: Callable[[], None]) -> Callable[[FrameType, str, Any], None]:
    """A profile function: run `action` once, just before spool.py's first rename/replace."""
    fired = []

    def prof(frame: FrameType, event: str, arg: Any) -> None:
        if fired or event != "c_call" or arg not in (os.rename, os.replace):
            return
        if frame.f_code.co_filename.endswith(os.path.join("archive", "spool.py")):
            fired.append(True)
            action()

    prof.fired = fired  # type: ignore[attr-defined]
    return prof


@pytest.fixture
def profiled() -> Iterator[Callable[[Callable[[FrameType, str, Any], None]], None]]:
    def install(fn: Callable[[FrameType, str, Any], None]) -> None:
        sys.setprofile(fn)

    yield install
    sys.setprofile(None)


def _tree(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def test_done_swapped_for_a_symlink_mid_ingest_sends_nothing_outside(
        dirs: tuple[Path, Path], tmp_path: Path, profiled: Any) -> None:
    spool, archive = dirs
    outside = tmp_path / "outside"  # stands for /etc: what an attacker points done/ at
    outside.mkdir()
    _spool_job(spool, 5, ["n1", "n2"])
    (spool / "done").mkdir()

    def swap() -> None:
        (spool / "done").rename(spool / "done.real")
        (spool / "done").symlink_to(outside)

    prof = _swap_on_first_move(swap)
    profiled(prof)
    res = ingest(spool, archive, compact=False)
    profiled(None)
    assert prof.fired  # type: ignore[attr-defined]
    assert _tree(outside) == []  # nothing written, moved or linked outside the spool
    assert res.jobs_archived == [5] and res.reports_ingested == 4
    assert sorted(p.name for p in (spool / "done.real").iterdir()) == sorted(
        f"5.{n}.{ph}.json" for n in ("n1", "n2") for ph in ("prolog", "epilog"))
    assert not list(spool.glob("*.json"))


def test_quarantine_swapped_for_a_symlink_mid_ingest_sends_nothing_outside(
        dirs: tuple[Path, Path], tmp_path: Path, profiled: Any) -> None:
    spool, archive = dirs
    outside = tmp_path / "outside"
    outside.mkdir()
    _spool_job(spool, 6, ["n1"])
    (spool / "7.n1.epilog.json").write_text("{not json")  # goes to quarantine
    (spool / "quarantine").mkdir(mode=0o700)

    def swap() -> None:
        (spool / "quarantine").rename(spool / "quarantine.real")
        (spool / "quarantine").symlink_to(outside)

    prof = _swap_on_first_move(swap)
    profiled(prof)
    res = ingest(spool, archive, compact=False)
    profiled(None)
    assert prof.fired  # type: ignore[attr-defined]
    assert _tree(outside) == []
    assert [n for n, _ in res.quarantined] == ["7.n1.epilog.json"]
    assert sorted(p.name for p in (spool / "quarantine.real").iterdir()) == [
        "7.n1.epilog.json", "7.n1.epilog.json.reason"]


def test_done_already_a_symlink_is_quarantined_never_followed(dirs: tuple[Path, Path],
                                                              tmp_path: Path) -> None:
    spool, archive = dirs
    outside = tmp_path / "outside"
    outside.mkdir()
    _spool_job(spool, 8, ["n1"])
    (spool / "done").symlink_to(outside)
    p = subprocess.run([sys.executable, "-m", "bluevela", "archive", "--spool-dir", str(spool),
                        "--archive-dir", str(archive), "ingest", "--json"],
                       capture_output=True, text=True, timeout=120, check=False)
    assert p.returncode == 0, p.stderr
    assert _tree(outside) == []
    assert (spool / "quarantine" / "done").is_symlink()  # moved as a link
    assert sorted(f.name for f in (spool / "done").iterdir()) == [
        "8.n1.epilog.json", "8.n1.prolog.json"]


@root_only
def test_spool_or_archive_others_may_write_is_refused_before_anything_is_created(
        dirs: tuple[Path, Path]) -> None:
    spool, archive = dirs
    _spool_job(spool, 9, ["n1"])
    spool.chmod(0o777)
    with pytest.raises(ArchiveError, match=r"spool .* mode 0777 is group/other-writable"):
        ingest(spool, archive)
    spool.chmod(0o755)
    archive.chmod(0o775)
    with pytest.raises(ArchiveError, match=r"archive .* mode 0775 is group/other-writable"):
        ingest(spool, archive)
    assert list(archive.iterdir()) == []  # no .lock, no manifest
    archive.chmod(0o755)
    assert ingest(spool, archive).jobs_archived == [9]


@root_only
def test_done_of_another_user_is_refused(dirs: tuple[Path, Path]) -> None:
    spool, archive = dirs
    _spool_job(spool, 10, ["n1"])
    (spool / "done").mkdir()
    os.chown(spool / "done", NOBODY, NOBODY)
    with pytest.raises(ArchiveError, match=r"done is owned by .*uid 65534"):
        ingest(spool, archive)
    assert len(list(spool.glob("10.*.json"))) == 2


# -- the .lock cross-user problem -------------------------------------------------------------


def _as_user(uid: int, fn: Callable[[], object]) -> tuple[int, str]:
    """Run `fn` in a forked child as `uid` (the test's modules stay loaded: /root is private);
    return (exit status, the child's one-line error or '')."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 0
        msg = b""
        try:
            os.close(r)
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
            fn()
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            code, msg = 1, f"{type(exc).__name__}: {exc}".encode()
        os.write(w, msg)
        os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        msg = f.read().decode()
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), msg


@root_only
def test_a_root_ingest_never_locks_the_owner_out(tmp_path: Path) -> None:
    """SlurmUser (here: nobody) owns the spool and the archive and ingests from
    EpilogSlurmctld; a root timer ingest runs too. Before the fix the root ingest created
    `<archive>/.lock` (root, 0600), `segments/` and the manifest, and from then on every
    ingest of the owner failed: "cannot open lock file .../.lock: Permission denied".
    Now root's ingest is refused in one line before it creates anything."""
    base = tmp_path / "shared"
    base.mkdir()
    tmp_path.chmod(0o755)  # let nobody reach it
    for parent in tmp_path.parents:
        if parent == Path("/tmp") or parent == Path("/"):
            break
        parent.chmod(parent.stat().st_mode | 0o011)
    spool, archive = base / "spool", base / "archive"
    spool.mkdir()
    archive.mkdir()
    os.chown(spool, NOBODY, NOBODY)
    os.chown(archive, NOBODY, NOBODY)
    _spool_job(spool, 21, ["n1", "n2"])  # the hooks write as root
    # Warm every module the child needs (it cannot read /root after setuid).
    warm = tmp_path / "warm"
    warm.mkdir()
    (warm / "s").mkdir()
    (warm / "a").mkdir()
    _spool_job(warm / "s", 1, ["n1"])
    ingest(warm / "s", warm / "a", compact=True)
    query.list_jobs(warm / "a")
    user_name(NOBODY)

    with pytest.raises(ArchiveError) as err:
        ingest(spool, archive)
    msg = str(err.value)
    assert "\n" not in msg and "owned by nobody (uid 65534), not root (uid 0)" in msg, msg
    assert list(archive.iterdir()) == []  # no .lock, no manifest, no segments

    code, out = _as_user(NOBODY, lambda: ingest(spool, archive, compact=False))
    assert code == 0, out
    assert [j["job_id"] for j in query.list_jobs(archive)] == [21]
    assert (archive / ".lock").stat().st_uid == NOBODY
    _spool_job(spool, 22, ["n1"])
    code, out = _as_user(NOBODY, lambda: ingest(spool, archive, compact=False))
    assert code == 0, out  # and again: nothing of root's is in its way
    assert [j["job_id"] for j in query.list_jobs(archive)] == [21, 22]


@root_only
def test_a_leftover_root_lock_is_named_in_one_line(dirs: tuple[Path, Path]) -> None:
    """An archive that already has a root-owned .lock (left by an old root ingest): its owner's
    ingest says what is wrong instead of failing on the lock file with EACCES."""
    spool, archive = dirs
    (archive / ".lock").write_text("")
    os.chown(spool, NOBODY, NOBODY)
    os.chown(archive, NOBODY, NOBODY)
    spool.parent.chmod(0o755)
    user_name(0)
    code, out = _as_user(NOBODY, lambda: ingest(spool, archive, compact=False))
    assert code == 1
    assert "ArchiveError" in out and ".lock is owned by root (uid 0)" in out, out
    assert "run ingest as that user, or chown" in out


@root_only
def test_ownership_errors_are_one_line_at_the_cli_and_in_epilog_slurmctld(
        dirs: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    from bluevela.hooks import slurmctld

    spool, archive = dirs
    _spool_job(spool, 31, ["n1"])
    spool.chmod(0o775)
    p = subprocess.run([sys.executable, "-m", "bluevela", "archive", "--spool-dir", str(spool),
                        "--archive-dir", str(archive), "ingest"],
                       capture_output=True, text=True, timeout=120, check=False)
    assert p.returncode == 1
    assert p.stderr.count("\n") == 1 and "mode 0775 is group/other-writable" in p.stderr
    assert "Traceback" not in p.stderr
    env = {"BV_HOOK_ENV": "none", "SLURM_JOB_ID": "31", "BV_SPOOL_DIR": str(spool),
           "BV_ARCHIVE_DIR": str(archive), "BV_ARCHIVE_WAIT_S": "0"}
    assert slurmctld.main(env) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("bluevela epilog_slurmctld: error: ingest as")
    assert list(archive.iterdir()) == []
