"""Files laid out under a root (`/` or a staging directory): how one compares with its
`Item` (no symlink followed), written whole (a temporary name, fsync, rename(2): a hook starting
meanwhile runs the old shim or the new one, never half of one), removed only while it is still
what was laid out, and the directories an install created.
"""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

from bluevela.deploy.layout import Change, InstallError, Item, Result


def under(root: Path, path: str) -> Path:
    return root / path.lstrip("/")


def compare(real: Path, item: Item) -> str:
    """"same", "differs" or "absent": what is at `real` compared with `item` (no symlink is
    followed: a symlink where a file belongs differs)."""
    try:
        st = os.lstat(real)
    except FileNotFoundError:
        return "absent"
    if item.target is not None:
        if stat.S_ISLNK(st.st_mode) and os.readlink(real) == item.target:
            return "same"
        return "differs"
    if not stat.S_ISREG(st.st_mode):
        return "differs"
    if stat.S_IMODE(st.st_mode) != item.mode or st.st_size != len(item.content or b""):
        return "differs"
    if os.geteuid() == 0 and (st.st_uid, st.st_gid) != (0, 0):
        return "differs"
    return "same" if digest_file(real) == item.digest else "differs"


def digest_file(path: Path) -> str | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as fh:
        return hashlib.sha256(fh.read()).hexdigest()


def check_dir(path: Path) -> None:
    """A directory hooks run from must be writable by its owner only, root when we are."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        raise InstallError(f"{path} is not a directory")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise InstallError(f"{path} is group/other-writable (mode {stat.S_IMODE(st.st_mode):04o}):"
                           " the hooks run as root from it; chmod go-w it first")
    if os.geteuid() == 0 and st.st_uid != 0:
        raise InstallError(f"{path} is owned by uid {st.st_uid}, not root: the hooks run as "
                           "root from it; chown root it first")


def makedirs(root: Path, path: str, created: list[str], dry_run: bool) -> None:
    """Create the missing parents of `path` (0755), remembering each one created."""
    missing: list[str] = []
    parent = Path(path).parent
    while str(parent) != "/" and not under(root, str(parent)).exists():
        missing.append(str(parent))
        parent = parent.parent
    for d in reversed(missing):
        if not dry_run:
            os.mkdir(under(root, d), 0o755)
            os.chmod(under(root, d), 0o755)  # whatever the umask
        created.append(d)


def write(real: Path, item: Item) -> None:
    tmp = real.with_name(f".{real.name}.bv-install-{os.getpid()}")
    try:
        os.unlink(tmp)
    except FileNotFoundError:
        pass
    if item.target is not None:
        os.symlink(item.target, tmp)
    else:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.write(fd, item.content or b"")
            os.fchmod(fd, item.mode)
            if os.geteuid() == 0:
                os.fchown(fd, 0, 0)
            os.fsync(fd)
        finally:
            os.close(fd)
    try:
        if os.path.isdir(real) and not os.path.islink(real):
            raise InstallError(f"{real} is a directory: remove it by hand first")
        os.replace(tmp, real)  # rename(2): atomic for a file and a symlink alike
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    dfd = os.open(real.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def remove(root: Path, path: str, entry: dict[str, str], result: Result) -> None:
    """Remove one manifest entry when it is still what was laid out; keep an edited file."""
    real = under(root, path)
    item = (Item(path, target=entry["target"]) if "target" in entry else
            Item(path, int(entry.get("mode", "0o644"), 8)))
    try:
        st = os.lstat(real)
    except FileNotFoundError:
        return
    if item.target is None:
        if not stat.S_ISREG(st.st_mode) or digest_file(real) != entry.get("sha256"):
            result.changes.append(Change("keep", path, "changed since it was installed"))
            return
    elif not stat.S_ISLNK(st.st_mode):
        result.changes.append(Change("keep", path, "not the symlink that was installed"))
        return
    if not result.dry_run:
        os.unlink(real)
    result.changes.append(Change("remove", path))


def remove_dirs(root: Path, dirs: list[str], result: Result) -> list[str]:
    """Remove the directories an install created, deepest first, once nothing but what this
    run removes is in them; the ones kept."""
    gone = {c.path.rstrip("/") for c in result.changes if c.action == "remove"}
    kept: list[str] = []
    for d in sorted(set(dirs), key=lambda p: p.count("/"), reverse=True):
        real = under(root, d)
        if real.is_symlink() or not real.is_dir():
            continue
        if any(f"{d}/{child.name}" not in gone for child in real.iterdir()):
            kept.append(d)
            continue
        if not result.dry_run:
            os.rmdir(real)
        gone.add(d)
        result.changes.append(Change("remove", d + "/"))
    return kept
