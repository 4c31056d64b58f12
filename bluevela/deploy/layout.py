"""What `bv install` lays out (docs/install.md 1.2): the places, one `Item` per file or
symlink taken from the installed package's data (`plan`), the venv `current` will name, and
the report types `install` and `uninstall` fill (`Change`, `Result`).
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from bluevela import __version__
from bluevela.deploy import data
from bluevela.errors import BluevelaError

PREFIX = "/opt/bluevela"
CURRENT = f"{PREFIX}/current"
PYTHON_FILE = "/etc/bluevela/python"
MANIFEST = f"{PREFIX}/install-manifest.json"
UNIT_DIR = "/etc/systemd/system"
LOGROTATE = "/etc/logrotate.d/bluevela"
UNIT_SUFFIXES = (".service", ".timer")
# Directories a hook's files live in: root's, writable by root only.
GUARDED_DIRS = (PREFIX, f"{PREFIX}/prolog_epilog", "/etc/bluevela")
# Every place the layout may hold a path in (the manifest is read only within them).
PLACES = (PREFIX, "/etc/bluevela", UNIT_DIR, "/etc/logrotate.d")


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
