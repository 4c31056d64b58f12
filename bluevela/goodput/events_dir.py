"""Where goodput events lie on a node: the events directory and the rules that let root's
epilog trust what the job's user wrote there (docs/resilience.md, "Where the time went:
goodput events").

The directory is ``BV_EVENTS_DIR`` (else /tmp). It is either ``shared`` (root's, sticky, like
/tmp) or ``per-user`` (root's, writable by root only, with ``<dir>/<uid>/`` made by the
prolog for each job's user); anything a user could fill or replace is refused
(`dir_layout`). The files are created O_EXCL|O_NOFOLLOW, mode 0600, named
``bv-goodput.<job>.r<restart>.u<uid>.<random>[.copy].jsonl`` (`FILE_NAME_RE`), and removed
only when they are regular files of the job's user (`unlink_own`).

Standard library only: the supervisor, its agents and the hooks import it (which directory
the hooks use, from hook.env, is `bluevela.hooks.env.site_events_dir`).
"""

from __future__ import annotations

import logging
import os
import re
import stat
from collections.abc import Mapping

logger = logging.getLogger(__name__)

EVENTS_DIR_ENV = "BV_EVENTS_DIR"
DEFAULT_DIR = "/tmp"
MAX_SCAN = 100_000  # directory entries looked at (a flooded /tmp stops there)
FILE_NAME_RE = re.compile(
    r"^bv-goodput\.([0-9]{1,12})\.r([0-9]{1,5})\.u([0-9]{1,10})\.[0-9a-f]{16}(\.copy)?"
    r"\.jsonl$")
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def node_tag(node: str) -> str:
    """The first 8 hex digits of a keeper's copy's random part: which node's agent wrote it
    (`events_copy.CopyWriter`). Where one events directory is seen by several nodes (one
    /tmp, a network file system), each node's epilog reads only the copies its own node's
    agent kept, never another keeper's (docs/resilience.md, goodput events)."""
    import hashlib

    return hashlib.sha256(node.encode("utf-8", "surrogateescape")).hexdigest()[:8]


def copy_is_from(name: str, node: str) -> bool:
    """Whether the copy file `name` (FILE_NAME_RE, ``.copy``) was kept by `node`'s agent."""
    parts = name.split(".")
    return len(parts) == 7 and parts[4].startswith(node_tag(node))


def events_dir(env: Mapping[str, str]) -> str:
    value = env.get(EVENTS_DIR_ENV, "")
    return value if value.startswith("/") and "\0" not in value else DEFAULT_DIR


class EventsDirError(OSError):
    """An events directory that another user could fill or replace (one-line reason)."""


def dir_layout(st: os.stat_result, path: str) -> str:
    """How files are laid out in an events directory with this lstat/fstat result:
    ``shared`` (root-owned with the sticky bit, like /tmp: the files lie in it, and no
    user can rename or remove another's) or ``per-user`` (root-owned, writable by root
    only: the files lie in ``<dir>/<uid>/``, which root creates for each user). Raises
    EventsDirError for anything else: a link, not a directory, owned by a user (they could
    swap files under the epilog), or writable by group/others without the sticky bit."""
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise EventsDirError(f"{path} is not a directory (a symlink is refused)")
    if st.st_uid not in (0, os.geteuid()):
        raise EventsDirError(f"{path} is owned by uid {st.st_uid}, not root: its owner can "
                             "replace any record in it")
    if st.st_mode & stat.S_ISVTX:
        return "shared"
    if st.st_mode & 0o022:
        raise EventsDirError(f"{path} is writable by group or others without the sticky "
                             f"bit (mode {stat.S_IMODE(st.st_mode):04o}): another user could "
                             "rename or remove the job's record; use mode 1777 or 0755 with "
                             "per-user directories")
    return "per-user"


def check_events_dir(path: str) -> tuple[str, str | None]:
    """(layout, problem) of the events directory at `path` for `bv site validate`: the
    problem is None when the epilog can trust it. Never raises."""
    try:
        layout = dir_layout(os.lstat(path), path)
    except EventsDirError as exc:
        return "", str(exc)
    except OSError as exc:
        return "", f"{path}: {exc.strerror or exc}"
    return layout, None


def open_user_dir(env: Mapping[str, str], uid: int) -> int:
    """A directory fd where the files of user `uid` lie (see `dir_layout`), checked; the
    caller closes it. Raises OSError (EventsDirError when the directory is refused)."""
    path = events_dir(env)
    dfd = os.open(path, _DIR_FLAGS)
    try:
        layout = dir_layout(os.fstat(dfd), path)
    except OSError:
        os.close(dfd)
        raise
    if layout == "shared":
        return dfd
    try:
        ufd = os.open(str(uid), _DIR_FLAGS, dir_fd=dfd)
    finally:
        os.close(dfd)
    st = os.fstat(ufd)
    if st.st_uid not in (uid, 0) or st.st_mode & 0o022:
        os.close(ufd)
        raise EventsDirError(f"{path}/{uid} is not the user's own directory (owner "
                             f"{st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o})")
    return ufd


def create_file(env: Mapping[str, str], name: str) -> int:
    """A new events file `name` of this process's user in its events directory: created
    O_EXCL|O_NOFOLLOW, mode 0600, opened for appending; the caller closes the fd. Raises
    OSError (EventsDirError when the directory is refused)."""
    dfd = open_user_dir(env, os.getuid())
    try:
        return os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                       | os.O_APPEND | os.O_CLOEXEC, 0o600, dir_fd=dfd)
    finally:
        os.close(dfd)


def unlink_own(dfd: int, name: str, uid: int) -> None:
    """Remove `name` in `dfd` if it is a regular file of user `uid` (never raises)."""
    try:
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        if stat.S_ISREG(st.st_mode) and st.st_uid == uid:
            os.unlink(name, dir_fd=dfd)
    except OSError:
        pass


def ensure_user_dir(env: Mapping[str, str], uid: int, gid: int) -> None:
    """The prolog's part (root) in a per-user layout: ``<dir>/<uid>`` exists, a directory
    owned by the user, mode 0700. Nothing to do in a shared layout. Never raises (logged)."""
    path = events_dir(env)
    try:
        dfd = os.open(path, _DIR_FLAGS)
    except OSError:
        return
    try:
        if dir_layout(os.fstat(dfd), path) != "per-user":
            return
        try:
            os.mkdir(str(uid), 0o700, dir_fd=dfd)
        except FileExistsError:
            return  # root made it (only root writes here); open_user_dir checks it
        fd = os.open(str(uid), _DIR_FLAGS, dir_fd=dfd)
        try:
            os.fchown(fd, uid, gid)
            os.fchmod(fd, 0o700)
        finally:
            os.close(fd)
    except OSError as exc:
        logger.warning("goodput events directory for uid %d not made in %s: %s", uid, path,
                       exc.strerror or exc)
    finally:
        os.close(dfd)


def prepare_for_prolog(env: Mapping[str, str] | None = None) -> None:
    """The prolog's part: the job user's directory in a per-user layout (`ensure_user_dir`),
    from ``SLURM_JOB_UID``/``SLURM_JOB_GID``. Never raises."""
    env = os.environ if env is None else env
    uid, gid = env.get("SLURM_JOB_UID", ""), env.get("SLURM_JOB_GID", "")
    if uid.isdigit() and len(uid) <= 10 and gid.isdigit() and len(gid) <= 10:
        ensure_user_dir(env, int(uid), int(gid))
