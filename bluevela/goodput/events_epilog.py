"""The epilog's collection of the goodput events (as root, on every node of the job): the
supervisor's events file of this job attempt on the batch node, or a keeper's copy of it
(bluevela/launch/events_copy.py) on a second node, read as hostile input and folded into
one bounded record that goes into the node's epilog report under `goodput_events`
(docs/resilience.md, "Where the time went: goodput events").

Only a directory that no other user can fill or replace is read
(bluevela/goodput/events_dir.py); at most MAX_SCAN entries of it are looked at, names and
owner filtered by the job's uid before the MAX_FILES cap; a directory fd,
O_NOFOLLOW|O_NONBLOCK, a regular file owned by the job's user, at most MAX_FILE_BYTES,
every field checked (bluevela/goodput/events.py), the host must be this node (a copy may
name another node: where it lies is root's word, `copy_on`). A bad file is logged and left
out; the files read are removed once the report holding the record is spooled
(`Collected.remove`).

Standard library only: the hooks import it.
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from bluevela.goodput.events import MAX_FILE_BYTES, EventsError, merge_records, read_events_file
from bluevela.goodput.events_dir import (
    FILE_NAME_RE,
    MAX_SCAN,
    EventsDirError,
    copy_is_from,
    events_dir,
    open_user_dir,
    unlink_own,
)
from bluevela.util.fs import read_bounded

logger = logging.getLogger(__name__)

MAX_FILES = 8  # files of one attempt (owned by the job's user) the epilog reads


@dataclass
class Collected:
    """What the epilog read of one attempt: the record, and the files it came from (removed
    only once the report holding the record is spooled: `remove`)."""

    record: dict[str, Any]
    names: list[str]
    uid: int
    env: Mapping[str, str]

    def remove(self) -> None:
        """Remove the files read (never raises): call it after the spool write succeeded."""
        try:
            dfd = open_user_dir(self.env, self.uid)
        except OSError:
            return
        try:
            for name in self.names:
                unlink_own(dfd, name, self.uid)
        finally:
            os.close(dfd)


def collect(job_id: int, restart: int, node: str, uid: int | None,
            env: Mapping[str, str] | None = None, *, remove: bool = False
            ) -> dict[str, Any] | None:
    """The epilog's read (as root) of the supervisor's events of this job attempt on this
    node, or None (see `collect_files`); with `remove`, the files read are removed."""
    found = collect_files(job_id, restart, node, uid, env)
    if found is None:
        return None
    if remove:
        found.remove()
    return found.record


def collect_files(job_id: int, restart: int, node: str, uid: int | None,
                  env: Mapping[str, str] | None = None) -> Collected | None:
    """Read the events files of this job attempt on this node, as root, as hostile input.

    Only a directory that no other user can fill or replace is read (`dir_layout`); at most
    MAX_SCAN entries of it are looked at (scandir). The files are named with the job's uid
    and filtered by their owner (the job's user, from lstat) BEFORE the MAX_FILES cap, so
    another user's files, whatever their names, never push the real record out. Never
    follows a symlink, never reads more than MAX_FILE_BYTES; a file that fails a check is
    logged and left out (and kept, for a person to look at). Never raises."""
    if uid is None:
        return None
    env = os.environ if env is None else env
    try:
        dfd = open_user_dir(env, uid)
    except OSError as exc:
        if isinstance(exc, EventsDirError):
            logger.warning("goodput events not read: %s", exc)
        return None
    try:
        names = _attempt_files(dfd, job_id, restart, uid, env)
        found, read = _read_attempt(dfd, names, job_id, restart, node, uid)
    except OSError as exc:
        logger.warning("goodput events not read: %s", exc.strerror or exc)
        return None
    finally:
        os.close(dfd)
    return None if found is None else Collected(found, read, uid, env)


def _attempt_files(dfd: int, job_id: int, restart: int, uid: int,
                   env: Mapping[str, str]) -> list[str]:
    """The names of this attempt's files in `dfd` that are regular files of user `uid`, in
    name order, at most MAX_FILES (of at most MAX_SCAN entries looked at)."""
    names = []
    with os.scandir(dfd) as entries:
        for n, entry in enumerate(entries):
            if n >= MAX_SCAN:
                logger.warning("goodput events: more than %d entries in %s, the rest not "
                               "looked at (per-user directories avoid this)", MAX_SCAN,
                               events_dir(env))
                break
            m = FILE_NAME_RE.match(entry.name)
            if (m is None or int(m.group(1)) != job_id or int(m.group(2)) != restart
                    or int(m.group(3)) != uid):
                continue
            st = entry.stat(follow_symlinks=False)
            if stat.S_ISREG(st.st_mode) and st.st_uid == uid:
                names.append(entry.name)
    return sorted(names)[:MAX_FILES]


def _read_attempt(dfd: int, names: list[str], job_id: int, restart: int, node: str,
                  uid: int) -> tuple[dict[str, Any] | None, list[str]]:
    """The record of this attempt from `names` (each checked, bad ones logged and left
    out): this node's own supervisor's record with any copy of it merged, else a copy; and
    the names read."""
    by_host: dict[str, dict[str, Any]] = {}
    read: list[str] = []
    for name in names:
        # A copy (a keeper agent's, of another node's supervisor) names that node as its
        # host; where it lies is root's word.
        copy = name.endswith(".copy.jsonl")
        if copy and not copy_is_from(name, node):
            # another node's keeper wrote it, on an events directory several nodes share (one
            # /tmp, a network file system): that node's epilog reads it. Left alone.
            continue
        try:
            rec = _read_one(dfd, name, uid)
            if (rec["host"] != node and not copy) or rec["job"] != job_id \
                    or rec["restart"] != restart:
                raise EventsError(f"written for job {rec['job']}.r{rec['restart']} on "
                                  f"{rec['host']}, not this node's attempt")
        except (OSError, EventsError) as exc:
            logger.warning("goodput events %s left out: %s", name, exc)
            continue
        read.append(name)
        if copy:
            rec["copy_on"] = node
        by_host[rec["host"]] = merge_records(by_host.get(rec["host"]), rec)
    return by_host.get(node) or next(iter(by_host.values()), None), read


def _read_one(dfd: int, name: str, uid: int) -> dict[str, Any]:
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise EventsError("not a regular file")
        if st.st_uid != uid:
            raise EventsError(f"owned by uid {st.st_uid}, not the job's user {uid}")
        return read_events_file(read_bounded(fd, MAX_FILE_BYTES + 1))
    finally:
        os.close(fd)


def collect_for_epilog(job_id: int, restart: int, node: str,
                       env: Mapping[str, str] | None = None) -> Collected | None:
    """`collect_files` with the job's user from ``SLURM_JOB_UID`` (the epilog's
    environment). The caller removes the files (`Collected.remove`) once spooled."""
    env = os.environ if env is None else env
    raw = env.get("SLURM_JOB_UID", "")
    if not raw.isdigit() or len(raw) > 10:
        return None
    return collect_files(job_id, restart, node, int(raw), env)
