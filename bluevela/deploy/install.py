"""`bv install`: lay out a node from the installed package, idempotently, with an uninstall.

The layout (docs/install.md 1.2), every path relative to `root` (`/`, or a staging dir):

- `/opt/bluevela/current` -> the venv this `bv` runs from (`/opt/bluevela/<version>`): the
  one switch between versions, replaced with rename(2), written last;
- `/etc/bluevela/python`: `/opt/bluevela/current/bin/python3`, the interpreter of the shims;
- `/opt/bluevela/prolog_epilog/`: the hook shims (0755) and `prometheus/` (0644);
- `/opt/bluevela/slurm/hooks.conf`: the slurm.conf additions;
- `/etc/systemd/system/`: every `*.service` / `*.timer` of `prolog_epilog/` (not enabled);
- `/etc/logrotate.d/bluevela`;
- `/opt/bluevela/install-manifest.json`: what was laid out, for `--uninstall` and for the
  next install (a file the new version no longer ships is removed).

With `root` `/` only (a staging root lists the commands instead), what
`bv-fleet-metrics.service` runs with (`fleet_account`): the system user `bvfleet` (nologin, no
home) and its textfile directory `/var/lib/node_exporter/textfile`, `root:bvfleet 1775` (the
sticky bit: bvfleet replaces its own file, never the hooks' root-owned one). The manifest
records whether bv created the user and the directory (or the mode and group it changed), so
`--uninstall` removes only what bv created and gives a changed directory its old mode back.

Every file is written to a temporary name in its directory, fsynced, then renamed over the
old one: a hook starting meanwhile runs the old shim or the new one, never half of one.
Nothing outside the manifest is touched: site.yaml, hook.env, slurm.conf, enabled units.

Before anything is written, what `current` will name is checked (`trust_problems`): every root
hook runs its `python3 -I`, which still runs the .pth files of its site-packages, so a venv
(or a directory above it, its bin/, its site-packages, a directory a .pth adds) that anyone
but root can change, and a bluevela that is an editable or checkout install, are refused
(`--force`: installed, each said as a warning).
"""

from __future__ import annotations

import grp
import hashlib
import json
import logging
import os
import pwd
import shlex
import stat
import subprocess
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from bluevela import __version__
from bluevela.deploy import data
from bluevela.errors import BluevelaError

logger = logging.getLogger(__name__)

PREFIX = "/opt/bluevela"
CURRENT = f"{PREFIX}/current"
PYTHON_FILE = "/etc/bluevela/python"
MANIFEST = f"{PREFIX}/install-manifest.json"
UNIT_DIR = "/etc/systemd/system"
LOGROTATE = "/etc/logrotate.d/bluevela"
UNIT_SUFFIXES = (".service", ".timer")
MANIFEST_SCHEMA = 1
# Directories a hook's files live in: root's, writable by root only.
GUARDED_DIRS = (PREFIX, f"{PREFIX}/prolog_epilog", "/etc/bluevela")
# What prolog_epilog/bv-fleet-metrics.service runs as and writes to (its User= and --out).
FLEET_USER = "bvfleet"
TEXTFILE_DIR = "/var/lib/node_exporter/textfile"
TEXTFILE_MODE = 0o1775


class InstallError(BluevelaError):
    """The layout cannot be installed or removed as asked."""


@dataclass(frozen=True)
class Item:
    """One thing laid out: a file (content, mode) or a symlink (target)."""

    path: str  # absolute on the target system, e.g. /opt/bluevela/prolog_epilog/prolog
    mode: int = 0o644
    content: bytes | None = None
    target: str | None = None  # a symlink's target

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.content or b"").hexdigest()


@dataclass(frozen=True)
class Change:
    """One line of the report: create, update, remove, keep (an edited file left alone)."""

    action: str
    path: str
    detail: str = ""

    def line(self) -> str:
        return f"{self.action:<7} {self.path}" + (f"  ({self.detail})" if self.detail else "")


@dataclass
class Result:
    """What `install` or `uninstall` did (or, with dry_run, would do)."""

    root: str
    version: str
    dry_run: bool
    changes: list[Change] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # Refusals overridden with --force (trust_problems): said loudly, on stderr.
    warnings: list[str] = field(default_factory=list)

    @property
    def changed(self) -> bool:
        return any(c.action in ("create", "update", "remove") for c in self.changes)

    def to_dict(self) -> dict[str, object]:
        return {"root": self.root, "version": self.version, "dry_run": self.dry_run,
                "changed": self.changed,
                "changes": [{"action": c.action, "path": c.path, "detail": c.detail}
                            for c in self.changes],
                "notes": list(self.notes), "warnings": list(self.warnings)}


# --------------------------------------------------------------------------------------------
# What to lay out


def _walk(base: Path) -> Iterator[Path]:
    for path in sorted(base.rglob("*")):
        rel = path.relative_to(base).parts
        if path.is_file() and not any(p.startswith(".") or p == "__pycache__" for p in rel):
            yield path


def venv_link_target(venv: Path, root: Path) -> str:
    """What `current` points at: the venv's name when it sits next to `current` under the
    same root (`/opt/bluevela/0.2.0` -> `0.2.0`, so a staged tree moves as a whole), else its
    absolute path."""
    prefix = root / PREFIX.lstrip("/")
    try:
        if venv.resolve().parent == prefix.resolve():
            return venv.name
    except OSError:
        pass
    return str(venv)


def find_venv() -> Path:
    """The venv this interpreter runs in; InstallError when it is not one."""
    if sys.prefix == sys.base_prefix:
        raise InstallError(
            f"{sys.executable} is not in a venv: install bluevela into one "
            f"(python3 -m venv {PREFIX}/{__version__}; docs/install.md 1.1) and run its bv")
    venv = Path(sys.prefix)
    if not (venv / "bin" / "python3").exists():
        raise InstallError(f"the venv {venv} has no bin/python3")
    if str(venv) == PREFIX:
        raise InstallError(
            f"the venv is {PREFIX} itself: versions cannot be switched there; create "
            f"{PREFIX}/{__version__} (docs/install.md 1.1) and run its bv install")
    return venv


def plan(venv: Path, root: Path) -> list[Item]:
    """Every item of the layout, in the order it is written (the switch of `current` last)."""
    src = data.root()
    items: list[Item] = []
    pe = src / "prolog_epilog"
    for path in _walk(pe):
        rel = path.relative_to(pe)
        body = path.read_bytes()
        if len(rel.parts) == 1 and path.name.endswith(UNIT_SUFFIXES):
            items.append(Item(f"{UNIT_DIR}/{path.name}", 0o644, body))
        elif len(rel.parts) == 1 and path.name.endswith(".logrotate"):
            items.append(Item(LOGROTATE, 0o644, body))
        elif len(rel.parts) == 1:
            items.append(Item(f"{PREFIX}/prolog_epilog/{path.name}", 0o755, body))
        else:
            items.append(Item(f"{PREFIX}/prolog_epilog/{rel.as_posix()}", 0o644, body))
    items.append(Item(f"{PREFIX}/slurm/hooks.conf", 0o644,
                      (src / "slurm" / "hooks.conf").read_bytes()))
    items.append(Item(PYTHON_FILE, 0o644, f"{CURRENT}/bin/python3\n".encode()))
    items.append(Item(CURRENT, target=venv_link_target(venv, root)))
    return items


# --------------------------------------------------------------------------------------------
# Doing it


def _under(root: Path, path: str) -> Path:
    return root / path.lstrip("/")


def _read_manifest(root: Path) -> dict[str, object] | None:
    p = _under(root, MANIFEST)
    try:
        if p.is_symlink():
            raise InstallError(f"{p} is a symlink: not read")
        raw = json.loads(p.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise InstallError(f"{p}: unreadable manifest ({exc}); remove it by hand after "
                           "checking what it lists") from exc
    if not isinstance(raw, dict) or raw.get("schema") != MANIFEST_SCHEMA:
        raise InstallError(f"{p}: not a bluevela install manifest (schema {MANIFEST_SCHEMA})")
    return raw


PLACES = (PREFIX, "/etc/bluevela", UNIT_DIR, "/etc/logrotate.d")


def _ours(path: str, *, parents: bool = False) -> bool:
    """A path the layout may hold: absolute, normal, under one of the places bv lays out (or,
    with `parents`, one of their parents: a staging root starts empty)."""
    if not path.startswith("/") or os.path.normpath(path) != path or path == "/":
        return False
    return any(path == top or path.startswith(top + "/") or (parents and top.startswith(path + "/"))
               for top in PLACES)


def _entries(manifest: dict[str, object] | None) -> dict[str, dict[str, str]]:
    """The manifest's items by path; an entry outside the layout's places is ignored (a
    manifest is never a way to make root delete something else)."""
    if manifest is None:
        return {}
    items = manifest.get("items")
    out: dict[str, dict[str, str]] = {}
    if isinstance(items, list):
        for entry in items:
            if (isinstance(entry, dict) and isinstance(entry.get("path"), str)
                    and _ours(entry["path"])):
                out[entry["path"]] = {str(k): str(v) for k, v in entry.items()}
    return out


def _dirs(manifest: dict[str, object] | None) -> list[str]:
    raw = (manifest or {}).get("dirs")
    if not isinstance(raw, list):
        return []
    return [d for d in raw if isinstance(d, str) and _ours(d, parents=True)]


def _state(real: Path, item: Item) -> str:
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
    return "same" if _digest_file(real) == item.digest else "differs"


def _digest_file(path: Path) -> str | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as fh:
        return hashlib.sha256(fh.read()).hexdigest()


def _check_dir(path: Path) -> None:
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


# --------------------------------------------------------------------------------------------
# What `current` names runs as root: the venv and the package it copies from (issue 33)


def _owners() -> set[int]:
    """Who may own what root will run: root, and (a staging tree built by a user, never run
    from there) the user running bv install."""
    return {0, os.geteuid()}


def _unsafe(path: Path, what: str) -> str | None:
    """Why `path` (not followed when a symlink: its target is checked by the caller) lets
    someone other than its owner change what root runs, or None."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return f"{what} {path} does not exist"
    mode = stat.S_IMODE(st.st_mode)
    if st.st_uid not in _owners():
        return (f"{what} {path} is owned by uid {st.st_uid}, not root: whoever owns it runs "
                "code as root on every node (chown -R root it)")
    if stat.S_ISLNK(st.st_mode):
        return None
    sticky_root_dir = stat.S_ISDIR(st.st_mode) and mode & stat.S_ISVTX and st.st_uid == 0
    if mode & (stat.S_IWGRP | stat.S_IWOTH) and not sticky_root_dir:
        return (f"{what} {path} is group/other-writable (mode {mode:04o}): anyone in it runs "
                "code as root on every node (chmod -R go-w it)")
    return None


def _site_packages(venv: Path) -> list[Path]:
    return sorted(p for pattern in ("lib/python3*/site-packages", "lib64/python3*/site-packages")
                  for p in venv.glob(pattern) if p.is_dir() and not p.is_symlink())


def _package_install() -> str | None:
    """Why the running bluevela is an editable or checkout install (root would import code
    from a tree that is the developers', not the venv's), or None for a wheel's copy."""
    from importlib import metadata

    if data.root() == data.CHECKOUT:
        return (f"bluevela runs from a checkout ({data.CHECKOUT}: no package data of a wheel); "
                "install the built wheel into the venv (docs/install.md 1.1)")
    try:
        direct = metadata.distribution("bluevela").read_text("direct_url.json")
    except metadata.PackageNotFoundError:
        direct = None
    if direct:
        try:
            editable = json.loads(direct).get("dir_info", {}).get("editable") is True
        except (ValueError, AttributeError):
            editable = False
        if editable:
            return ("bluevela is an editable install (pip install -e): root would import the "
                    f"source tree {data.PACKAGE.parent}; install the built wheel instead")
    return None


def trust_problems(venv: Path) -> list[str]:
    """What lets anyone but root change the code root's hooks run through `current`: the
    venv, every directory above it, its bin/ and bin/python3 (and the interpreter it links
    to, with that one's directory), its site-packages (the hooks' `python3 -I` still runs
    their .pth files) and any directory a .pth file there adds, and a bluevela that is an
    editable or checkout install, or is not the venv's own. One line each; [] when none."""
    problems: list[str] = []
    seen: set[Path] = set()

    def check(path: Path, what: str) -> None:
        if path in seen:
            return
        seen.add(path)
        why = _unsafe(path, what)
        if why:
            problems.append(why)

    venv = Path(os.path.abspath(venv))
    for parent in reversed(venv.parents):
        check(parent, "the directory above the venv")
    check(venv, "the venv")
    check(venv / "bin", "the venv's bin/")
    python = venv / "bin" / "python3"
    check(python, "the venv's python3")
    real = Path(os.path.realpath(python))
    if real != python:
        check(real, "the interpreter the venv's python3 runs")
        check(real.parent, "the interpreter's directory")
    packages = _site_packages(venv)
    if not packages:
        problems.append(f"the venv {venv} has no lib/python3*/site-packages")
    for sp in packages:
        check(sp, "the venv's site-packages")
        for pth in sorted(sp.glob("*.pth")):
            check(pth, "the .pth file")
            try:
                lines = pth.read_text(errors="replace").splitlines()
            except OSError:
                continue
            for line in lines:
                entry = line.strip()
                if entry and not entry.startswith(("#", "import ", "import\t")):
                    added = Path(entry if os.path.isabs(entry) else sp / entry)
                    if added.is_dir():
                        check(Path(os.path.abspath(added)), f"a directory {pth.name} adds")
    why = _package_install()
    if why:
        problems.append(why)
    elif not any(_within(data.PACKAGE, sp) for sp in packages):
        problems.append(f"the bluevela this bv install copies from ({data.PACKAGE}) is not the "
                        f"venv's own ({venv}): run the bv of the venv `current` will name")
    return problems


def _within(path: Path, parent: Path) -> bool:
    try:
        return Path(os.path.realpath(path)).is_relative_to(os.path.realpath(parent))
    except OSError:
        return False


def _makedirs(root: Path, path: str, created: list[str], dry_run: bool) -> None:
    """Create the missing parents of `path` (0755), remembering each one created."""
    missing: list[str] = []
    parent = Path(path).parent
    while str(parent) != "/" and not _under(root, str(parent)).exists():
        missing.append(str(parent))
        parent = parent.parent
    for d in reversed(missing):
        if not dry_run:
            os.mkdir(_under(root, d), 0o755)
            os.chmod(_under(root, d), 0o755)  # whatever the umask
        created.append(d)


def _write(real: Path, item: Item) -> None:
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


def _remove(root: Path, path: str, entry: dict[str, str], result: Result) -> None:
    """Remove one manifest entry when it is still what was laid out; keep an edited file."""
    real = _under(root, path)
    item = (Item(path, target=entry["target"]) if "target" in entry else
            Item(path, int(entry.get("mode", "0o644"), 8)))
    try:
        st = os.lstat(real)
    except FileNotFoundError:
        return
    if item.target is None:
        if not stat.S_ISREG(st.st_mode) or _digest_file(real) != entry.get("sha256"):
            result.changes.append(Change("keep", path, "changed since it was installed"))
            return
    elif not stat.S_ISLNK(st.st_mode):
        result.changes.append(Change("keep", path, "not the symlink that was installed"))
        return
    if not result.dry_run:
        os.unlink(real)
    result.changes.append(Change("remove", path))


def _remove_dirs(root: Path, dirs: list[str], result: Result) -> list[str]:
    """Remove the directories an install created, deepest first, once nothing but what this
    run removes is in them; the ones kept."""
    gone = {c.path.rstrip("/") for c in result.changes if c.action == "remove"}
    kept: list[str] = []
    for d in sorted(set(dirs), key=lambda p: p.count("/"), reverse=True):
        real = _under(root, d)
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


def hooks_in_slurm_conf(root: Path) -> list[str]:
    """The slurm.conf lines (the node's own file: $SLURM_CONF, else /etc/slurm/slurm.conf,
    under `root`) that still run a shim of PREFIX: removing the shims under them would make
    every hook fail, and Slurm drains a node whose prolog cannot run."""
    conf = os.environ.get("SLURM_CONF") if str(root) == "/" else None
    path = Path(conf) if conf else _under(root, "/etc/slurm/slurm.conf")
    try:
        text = path.read_text(errors="replace")
    except OSError:
        text = ""
    if str(root) == "/":
        text += "\n" + _running_config()  # configless nodes have no slurm.conf of their own
    found = [line.strip() for line in text.splitlines()
             if f"{PREFIX}/prolog_epilog/" in line and not line.lstrip().startswith("#")]
    return list(dict.fromkeys(found))


def _running_config() -> str:
    """`scontrol show config` when it answers within 15 s (else nothing: the file decides)."""
    import subprocess

    try:
        p = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True,
                           timeout=15, check=False, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return p.stdout if p.returncode == 0 else ""


def _write_manifest(root: Path, items: list[Item], dirs: list[str], venv: Path,
                    system: dict[str, object] | None = None) -> None:
    entries: list[dict[str, str]] = []
    for it in items:
        if it.target is not None:
            entries.append({"path": it.path, "target": it.target})
        else:
            entries.append({"path": it.path, "mode": f"{it.mode:04o}", "sha256": it.digest})
    body: dict[str, object] = {"schema": MANIFEST_SCHEMA, "version": __version__,
                               "venv": str(venv), "items": entries, "dirs": sorted(set(dirs))}
    if system is not None:
        body["system"] = system
    text = json.dumps(body, indent=1, sort_keys=True) + "\n"
    _write(_under(root, MANIFEST), Item(MANIFEST, 0o644, text.encode()))


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
            parent = os.path.dirname(path)
            os.makedirs(parent, 0o755, exist_ok=True)
            os.mkdir(path, 0o700)  # opened to its final mode below, never wider meanwhile
            fd = _open_dir_nofollow(path)
            try:
                os.fchown(fd, 0, gid if gid is not None else 0)
                os.fchmod(fd, TEXTFILE_MODE)
            finally:
                os.close(fd)
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
        fd = _open_dir_nofollow(path)
        try:
            os.fchown(fd, 0, gid if gid is not None else st.st_gid)
            os.fchmod(fd, TEXTFILE_MODE)
        finally:
            os.close(fd)
    result.changes.append(Change("update", path, f"{want} (was gid {st.st_gid}, {old_mode})"))
    return record


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
                    fd = _open_dir_nofollow(path)
                    try:
                        os.fchown(fd, 0, 0)
                        os.fchmod(fd, 0o755)
                    finally:
                        os.close(fd)
            else:
                if not dry_run:
                    os.rmdir(path)
                result.changes.append(Change("remove", path))
        elif isinstance(was, Mapping) and isinstance(was.get("gid"), int):
            mode = int(str(was.get("mode", "0755")), 8) & 0o7777
            if not dry_run:
                fd = _open_dir_nofollow(path)
                try:
                    os.fchown(fd, 0, int(was["gid"]))
                    os.fchmod(fd, mode)
                finally:
                    os.close(fd)
            result.changes.append(Change("update", path, f"back to gid {was['gid']}, "
                                         f"{mode:04o}"))
    if record.get("user_created") is True and _user_exists(account.user):
        if not dry_run:
            _run_tool(["userdel", account.user])
        result.changes.append(Change("remove", f"user {account.user}"))
    elif _user_exists(account.user):
        result.notes.append(f"kept user {account.user}: bv install did not create it")


def install(root: str | os.PathLike[str] = "/", *, dry_run: bool = False,
            venv: Path | None = None, account: Account = Account(),
            force: bool = False, fleet_host: bool = False) -> Result:
    """Lay out the node under `root` from the installed package (see the module docstring).

    Args:
        root: `/` on a node; a staging directory for an image or a test.
        dry_run: report what would change, write nothing.
        venv: the venv `current` names (default: the one this interpreter runs in).
        force: install even when someone but root can change what the venv runs, or the
            package is an editable/checkout install (`trust_problems`): each said as a
            warning (a developer's machine; never a production node).
        fleet_host: this host runs bv-fleet-metrics: make its user and textfile directory
            (`fleet_account`). Off by default: one host of the cluster runs that unit, and a
            local system user on every node (1,000 uids diverging under LDAP) serves none.
            A host whose manifest says bv made them keeps them managed.

    Raises:
        InstallError: a refusal, or a file system error (one line: the path and why). Files
            written before it are whole (each replaced by a rename), the manifest is written
            last: run bv install again once the cause is fixed.
    """
    try:
        return _install(root, dry_run=dry_run, venv=venv, account=account, force=force,
                        fleet_host=fleet_host)
    except OSError as exc:
        where = exc.filename or root
        raise InstallError(f"{where}: {exc.strerror or exc}") from exc


def _install(root: str | os.PathLike[str], *, dry_run: bool, venv: Path | None,
             account: Account, force: bool = False, fleet_host: bool = False) -> Result:
    base = Path(root)
    if not base.is_absolute() or not base.is_dir():
        raise InstallError(f"--root {root}: not an existing absolute directory")
    venv = venv if venv is not None else find_venv()
    result = Result(str(base), __version__, dry_run)
    for d in GUARDED_DIRS:
        _check_dir(_under(base, d))
    problems = trust_problems(venv)
    if problems and not force:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise InstallError(f"{problems[0]}{more}: the hooks run this venv as root; refused "
                           "(--force for a developer's machine)")
    result.warnings.extend(f"--force: {p}" for p in problems)
    items = plan(venv, base)
    old = _read_manifest(base)
    old_entries = _entries(old)
    old_dirs = _dirs(old)
    created: list[str] = []
    for item in items:
        real = _under(base, item.path)
        state = _state(real, item)
        if state == "same":
            continue
        _makedirs(base, item.path, created, dry_run)
        detail = (f"-> {item.target}" if item.target is not None else f"{item.mode:04o}")
        if not dry_run:
            _write(real, item)
        result.changes.append(Change("create" if state == "absent" else "update", item.path,
                                     detail))
    wanted = {it.path for it in items}
    for path, entry in old_entries.items():
        if path not in wanted and path != MANIFEST:
            _remove(base, path, entry, result)  # shipped by the version installed before
    old_system = old.get("system") if old is not None else None
    made = old_system if isinstance(old_system, Mapping) else None
    if fleet_host or made is not None or str(base) != "/":  # a staging root lists the commands
        system = fleet_account(base, made,
                               result, dry_run=dry_run, account=account,
                               announce=old is None)
    else:
        system = None
        if old is None:
            result.notes.append(f"user {account.user} and {account.textfile} are not made on "
                                "this host: only the host that runs bv-fleet-metrics needs "
                                "them (bv install --fleet-host there; docs/install.md 4.5)")
    dirs = old_dirs + created
    if (result.changed or old is None or old.get("venv") != str(venv)
            or system != old_system):
        _makedirs(base, MANIFEST, dirs, dry_run)
        if not dry_run:
            _write_manifest(base, items, dirs, venv, system)
    if any(c.path.startswith(UNIT_DIR) for c in result.changes) and str(base) == "/":
        result.notes.append("units changed: systemctl daemon-reload (they are not enabled "
                            "by bv install; docs/install.md 3)")
    return result


def uninstall(root: str | os.PathLike[str] = "/", *, dry_run: bool = False,
              force: bool = False, account: Account = Account()) -> Result:
    """Remove exactly what the manifest lists (an edited file is kept and reported), then the
    directories an install created once they are empty, then the manifest.

    Refused while slurm.conf still names a shim (unless `force`): take the hooks out of
    slurm.conf first (docs/install.md 8)."""
    try:
        return _uninstall(root, dry_run=dry_run, force=force, account=account)
    except OSError as exc:
        raise InstallError(f"{exc.filename or root}: {exc.strerror or exc}") from exc


def _uninstall(root: str | os.PathLike[str], *, dry_run: bool, force: bool,
               account: Account) -> Result:
    base = Path(root)
    if not base.is_absolute() or not base.is_dir():
        raise InstallError(f"--root {root}: not an existing absolute directory")
    still = hooks_in_slurm_conf(base)
    if still and not force:
        raise InstallError(f"slurm.conf still runs the hooks ({still[0]}"
                           + (f" and {len(still) - 1} more" if len(still) > 1 else "")
                           + "): Slurm would drain every node whose hook is gone; remove those "
                           "lines and scontrol reconfigure first (docs/install.md 8), or --force")
    manifest = _read_manifest(base)
    result = Result(str(base), __version__, dry_run)
    if manifest is None:
        result.notes.append(f"no {MANIFEST} under {base}: nothing was installed here by bv "
                            "install")
        return result
    # The switch first: from here on the shims find no interpreter and skip (exit 0).
    entries = _entries(manifest)
    order = sorted(entries, key=lambda p: p != CURRENT)
    for path in order:
        _remove(base, path, entries[path], result)
    remove_fleet_account(base, manifest.get("system"), result, dry_run=dry_run, account=account)
    real = _under(base, MANIFEST)
    if not dry_run:
        os.unlink(real)
    result.changes.append(Change("remove", MANIFEST))
    dirs = _dirs(manifest)
    for d in _remove_dirs(base, dirs, result):
        result.notes.append(f"kept {d}/: not empty (files bv install did not lay out)")
    return result
