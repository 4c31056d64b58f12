"""The health fixture trees of tests/data/health, stored as overlays and materialized on use.

Committed form (tests/data/README.md, "Overlay form"): the base fixture (`h100-healthy`) is a
full tree; every other fixture directory keeps its own small files (`nvml.json`, `ABOUT`,
`state/`, ...) and, instead of `root/`, only
- `root.overlay/`: the files of its root that differ from the base's root or are not in it
  (byte for byte, mode and symlinks kept),
- `root.removed`: the paths (relative to root, one a line) of the base's root that it lacks,
- `BASE`: the name of its base fixture, where that is not `h100-healthy` (the base must be a
  full tree).
A fixture whose root equals the base's has neither.

`materialized()` returns a directory equal to the full form (every fixture with a full `root/`,
the top-level files copied): built once per content under `<tmp>/bv-fixtures-<sha256>/`, in a
temporary directory renamed into place, so concurrent and repeated test runs share it.
`write_overlays()` writes the committed form from full trees (make_fixtures.py calls it).
Importable without pytest (benchmarks use it too).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import stat
import tempfile
from collections.abc import Iterable
from pathlib import Path

log = logging.getLogger(__name__)

HEALTH = Path(__file__).resolve().parent / "data" / "health"
DEFAULT_BASE = "h100-healthy"
OVERLAY, REMOVED, BASE = "root.overlay", "root.removed", "BASE"
# Bump when materializing changes, so no process reuses a tree built the old way.
FORMAT = b"bv-fixture-overlay 1\n"


class FixtureError(Exception):
    """A committed fixture set that cannot be materialized (bad root.removed line, no base)."""


# -- reading trees ------------------------------------------------------------------------------


def entries(top: Path) -> dict[str, tuple[str, int, bytes]]:
    """relative path -> (kind d/f/l/o, permission bits, content or link target) below `top`."""
    out: dict[str, tuple[str, int, bytes]] = {}
    for dirpath, dirnames, filenames in os.walk(top):
        dirnames.sort()
        for name in sorted(dirnames + filenames):
            path = Path(dirpath) / name
            rel = path.relative_to(top).as_posix()
            st = path.lstat()
            mode = stat.S_IMODE(st.st_mode)
            if stat.S_ISLNK(st.st_mode):
                out[rel] = ("l", 0, os.readlink(path).encode())
            elif stat.S_ISDIR(st.st_mode):
                out[rel] = ("d", mode, b"")
            elif stat.S_ISREG(st.st_mode):
                out[rel] = ("f", mode, path.read_bytes())
            else:  # FIFO, socket, device: only its type and mode (none is committed today)
                out[rel] = ("o", st.st_mode, b"")
    return out


def content_digest(health: Path = HEALTH) -> str:
    """sha256 over every path, type, mode and content below `health` (and FORMAT)."""
    h = hashlib.sha256(FORMAT)
    for rel, (kind, mode, data) in sorted(entries(health).items()):
        # Directory modes are left out: git keeps none, so checkouts differ by umask only.
        h.update(f"{rel}\0{kind}\0{mode if kind != 'd' else 0:o}\0{len(data)}\0".encode())
        h.update(data)
    return h.hexdigest()


# -- writing the overlay form -------------------------------------------------------------------


def diff_roots(base: Path, full: Path) -> tuple[list[str], list[str]]:
    """(paths of `full` to put in the overlay, paths of `base` to remove), both relative.

    A path whose type changed is removed and added again; a removed directory is listed alone
    (not its contents). Directory modes are not compared (git keeps none)."""
    old, new = entries(base), entries(full)
    removed: list[str] = []
    for rel in sorted(old):
        if rel in new and new[rel][0] == old[rel][0]:
            continue
        if any(rel.startswith(r + "/") for r in removed):
            continue
        removed.append(rel)
    gone = set(removed)
    overlay = []
    for rel, (kind, mode, data) in sorted(new.items()):
        was = old.get(rel)
        fresh = was is None or rel in gone or any(rel.startswith(r + "/") for r in gone)
        if kind == "d":
            if fresh:
                overlay.append(rel)
        elif fresh or was != (kind, mode, data):
            overlay.append(rel)
    return overlay, removed


def _copy_entry(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    if src.is_dir() and not src.is_symlink():
        dst.mkdir(exist_ok=True)
        shutil.copystat(src, dst)
    else:
        shutil.copy2(src, dst, follow_symlinks=False)


def write_fixture(full: Path, target: Path, base_root: Path | None, base_name: str) -> None:
    """Write fixture `full` (a full fixture dir) to `target` in the committed form, as an
    overlay on `base_root` (None: keep it a full tree)."""
    if target.exists():
        shutil.rmtree(target)
    if base_root is None:
        shutil.copytree(full, target, symlinks=True)
        return
    shutil.copytree(full, target, symlinks=True, ignore=lambda d, names: (
        ["root"] if Path(d) == full else []))
    overlay, removed = diff_roots(base_root, full / "root")
    for rel in overlay:
        _copy_entry(full / "root" / rel, target / OVERLAY / rel)
    if removed:
        (target / REMOVED).write_text("".join(r + "\n" for r in removed))
    if base_name != DEFAULT_BASE:
        (target / BASE).write_text(base_name + "\n")


def write_overlays(full: Path, out: Path, names: Iterable[str], base: str = DEFAULT_BASE,
                   bases: dict[str, str] | None = None) -> None:
    """Write fixtures `names` from full trees under `full` into `out` in the committed form:
    `base` stays full, each other one an overlay on its base (`bases`, default `base`)."""
    for name in names:
        base_name = (bases or {}).get(name, base)
        base_root = None if name == base_name else full / base_name / "root"
        write_fixture(full / name, out / name, base_root, base_name)


# -- materializing ------------------------------------------------------------------------------


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _safe_rel(fixture: Path, line: str) -> str:
    rel = line.strip()
    parts = Path(rel).parts
    if not rel or Path(rel).is_absolute() or ".." in parts or "." in parts:
        raise FixtureError(f"{fixture / REMOVED}: bad path {line!r}")
    return rel


def materialize_fixture(src: Path, dst: Path, health: Path) -> None:
    """The full form of committed fixture dir `src` at `dst`."""
    shutil.copytree(src, dst, symlinks=True, ignore=lambda d, names: (
        [n for n in names if n in (OVERLAY, REMOVED, BASE)] if Path(d) == src else []))
    if (src / "root").exists():
        return  # a full tree (a base)
    # An overlay; with neither overlay nor removed list, a root equal to the base's.
    base_name = (src / BASE).read_text().strip() if (src / BASE).exists() else DEFAULT_BASE
    base_root = health / base_name / "root"
    if not base_root.is_dir() or base_name == src.name:
        raise FixtureError(f"{src}: base {base_name!r} is not a full fixture tree")
    shutil.copytree(base_root, dst / "root", symlinks=True)
    if (src / REMOVED).exists():
        for line in (src / REMOVED).read_text().splitlines():
            _remove(dst / "root" / _safe_rel(src, line))
    overlay = src / OVERLAY
    for dirpath, dirnames, filenames in os.walk(overlay):
        dirnames.sort()
        for name in sorted(dirnames + filenames):
            s = Path(dirpath) / name
            d = dst / "root" / s.relative_to(overlay)
            if s.is_dir() and not s.is_symlink():
                if d.exists() and not (d.is_dir() and not d.is_symlink()):
                    _remove(d)
                _copy_entry(s, d)
            else:
                if d.exists() or d.is_symlink():
                    _remove(d)
                _copy_entry(s, d)


def materialize(health: Path, dst: Path) -> None:
    """The full form of the committed fixture set `health` at `dst` (which must not exist)."""
    dst.mkdir()
    for src in sorted(health.iterdir()):
        if src.is_dir() and not src.is_symlink():
            materialize_fixture(src, dst / src.name, health)
        else:
            shutil.copy2(src, dst / src.name, follow_symlinks=False)


def _usable(path: Path) -> bool:
    """An existing cache dir we may trust: ours, a real directory, not writable by others."""
    try:
        st = path.lstat()
    except FileNotFoundError:
        return False
    return (stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid()
            and not st.st_mode & 0o022)


@functools.cache
def materialized(health: Path = HEALTH) -> Path:
    """The full fixture set of `health` (default tests/data/health), built once per content."""
    digest = content_digest(health)
    tmp = Path(tempfile.gettempdir())
    final = tmp / f"bv-fixtures-{digest}"
    if _usable(final):
        return final
    build = Path(tempfile.mkdtemp(prefix=f"bv-fixtures-{digest[:12]}.", suffix=".tmp", dir=tmp))
    out = build / "health"
    materialize(health, out)
    out.chmod(0o755)
    try:
        os.rename(out, final)
    except OSError:
        # Another process got there first (fine), or something we must not trust is there.
        if not _usable(final):
            log.warning("%s is not a directory of ours closed to others; using %s", final, out)
            return out
    shutil.rmtree(build, ignore_errors=True)
    return final
