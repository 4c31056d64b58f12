"""What `bv-fleet-metrics.service` runs with, on the host that runs it (`bv install
--fleet-host`): the system user `bvfleet` (nologin, no home) and its textfile directory
`/var/lib/node_exporter/textfile`, `root:bvfleet 1775` (the sticky bit: bvfleet replaces its
own file, never the hooks' root-owned one). The manifest records whether bv created the user
and the directory (or the mode and group it changed), so `--uninstall` removes only what bv
created and gives a changed directory its old mode back.
"""

from __future__ import annotations

import grp
import os
import pwd
import shlex
import stat
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from bluevela.deploy.layout import Change, InstallError, Result

# What prolog_epilog/bv-fleet-metrics.service runs as and writes to (its User= and --out).
FLEET_USER = "bvfleet"
TEXTFILE_DIR = "/var/lib/node_exporter/textfile"
TEXTFILE_MODE = 0o1775


@dataclass(frozen=True)
class Account:
    """The fleet unit's user and textfile directory (tests name their own)."""

    user: str = FLEET_USER
    textfile: str = TEXTFILE_DIR

    def useradd(self) -> list[str]:
        return ["useradd", "--system", "--user-group", "--no-create-home", "--home-dir",
                "/nonexistent", "--shell", "/usr/sbin/nologin", self.user]

    def commands(self) -> str:
        return (f"{shlex.join(self.useradd())}; install -d -o root -g {self.user} -m 1775 "
                f"{shlex.quote(self.textfile)}")


FLEET_ACCOUNT = Account()  # the real one (the default of install and uninstall)


def _run_tool(argv: list[str]) -> None:
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False,
                           stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise InstallError(f"{argv[0]}: {exc}") from exc
    if p.returncode != 0:
        why = " ".join(p.stderr.split())[:300] or f"exit {p.returncode}"
        raise InstallError(f"{shlex.join(argv)}: {why}")


def _gid(name: str) -> int | None:
    try:
        return grp.getgrnam(name).gr_gid
    except KeyError:
        return None


def _user_exists(name: str) -> bool:
    try:
        pwd.getpwnam(name)
    except KeyError:
        return False
    return True


def _open_dir_nofollow(path: str) -> int:
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)


def fleet_account(root: Path, old: Mapping[str, object] | None, result: Result, *,
                  dry_run: bool, account: Account = Account(),
                  announce: bool = True) -> dict[str, object] | None:
    """The fleet unit's user and textfile directory (module docstring); returns the manifest's
    record of what bv created or changed (None under a staging root: only listed there, when
    `announce`: the first install into it).

    Raises:
        InstallError: useradd failed, or the directory is a symlink or not a directory.
    """
    if str(root) != "/":
        if not announce:
            return None
        result.notes.append(f"under --root, user {account.user} and its textfile directory "
                            f"are not made: on the host that runs bv-fleet-metrics run "
                            f"{account.commands()}")
        return None
    prev = old if isinstance(old, Mapping) else {}
    record: dict[str, object] = {
        "user_created": prev.get("user_created") is True,
        "textfile_created": prev.get("textfile_created") is True,
    }
    was = prev.get("textfile_was")
    if isinstance(was, Mapping):
        record["textfile_was"] = dict(was)
    if not _user_exists(account.user):
        if not dry_run:
            _run_tool(account.useradd())
        result.changes.append(Change("create", f"user {account.user}",
                                     "system, no home, nologin"))
        record["user_created"] = True
    gid = _gid(account.user)
    path = account.textfile
    want = f"root:{account.user} {TEXTFILE_MODE:04o}"
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        st = None
    if st is None:
        if not dry_run:
            _make_textfile_dir(path, gid)
        result.changes.append(Change("create", path, want))
        record["textfile_created"] = True
        return record
    if not stat.S_ISDIR(st.st_mode):
        raise InstallError(f"{path} is not a directory (a symlink is never followed): "
                           f"bv-fleet-metrics writes there; make it a directory {want}")
    if st.st_uid != 0:
        result.notes.append(f"{path} is owned by uid {st.st_uid}, not root: left alone; "
                            f"bv-fleet-metrics needs it {want}")
        return record
    if st.st_gid == gid and stat.S_IMODE(st.st_mode) == TEXTFILE_MODE:
        return record
    old_mode = f"{stat.S_IMODE(st.st_mode):04o}"
    if not record["textfile_created"] and "textfile_was" not in record:
        record["textfile_was"] = {"gid": st.st_gid, "mode": old_mode}
    if not dry_run:
        _set_dir(path, gid if gid is not None else st.st_gid, TEXTFILE_MODE)
    result.changes.append(Change("update", path, f"{want} (was gid {st.st_gid}, {old_mode})"))
    return record


def _make_textfile_dir(path: str, gid: int | None) -> None:
    """The textfile directory made (its parents 0755) and given root:`gid` and its mode,
    never wider than 0700 meanwhile."""
    os.makedirs(os.path.dirname(path), 0o755, exist_ok=True)
    os.mkdir(path, 0o700)  # opened to its final mode below, never wider meanwhile
    _set_dir(path, gid if gid is not None else 0, TEXTFILE_MODE)


def _set_dir(path: str, gid: int, mode: int) -> None:
    """The directory at `path` (never followed as a symlink) made root:`gid` `mode`."""
    fd = _open_dir_nofollow(path)
    try:
        os.fchown(fd, 0, gid)
        os.fchmod(fd, mode)
    finally:
        os.close(fd)


def remove_fleet_account(root: Path, record: object, result: Result, *, dry_run: bool,
                         account: Account = Account()) -> None:
    """Undo `fleet_account` from its manifest record: the directory removed when bv created it
    and it is empty (else its old group and mode back when bv changed them), the user removed
    only when bv created it. The names are bv's own, never read from the manifest."""
    if str(root) != "/" or not isinstance(record, Mapping):
        return
    path = account.textfile
    try:
        st: os.stat_result | None = os.lstat(path)
    except FileNotFoundError:
        st = None
    if st is not None and stat.S_ISDIR(st.st_mode) and st.st_uid == 0:
        was = record.get("textfile_was")
        if record.get("textfile_created") is True:
            if os.listdir(path):
                result.notes.append(f"kept {path}/: not empty")
                if (not dry_run and record.get("user_created") is True
                        and _gid(account.user) == st.st_gid):  # the group goes below
                    _set_dir(path, 0, 0o755)
            else:
                if not dry_run:
                    os.rmdir(path)
                result.changes.append(Change("remove", path))
        elif isinstance(was, Mapping) and isinstance(was.get("gid"), int):
            mode = int(str(was.get("mode", "0755")), 8) & 0o7777
            if not dry_run:
                _set_dir(path, int(was["gid"]), mode)
            result.changes.append(Change("update", path, f"back to gid {was['gid']}, "
                                         f"{mode:04o}"))
    if record.get("user_created") is True and _user_exists(account.user):
        if not dry_run:
            _run_tool(["userdel", account.user])
        result.changes.append(Change("remove", f"user {account.user}"))
    elif _user_exists(account.user):
        result.notes.append(f"kept user {account.user}: bv install did not create it")
