"""The install manifest (`/opt/bluevela/install-manifest.json`): what an install laid out
(each file's mode and SHA-256, each symlink's target), the directories it created and the
fleet account's record, read back by the next install and by `--uninstall`. An entry outside
the layout's places is ignored: a manifest is never a way to make root delete something else.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from bluevela import __version__
from bluevela.deploy.files import under, write
from bluevela.deploy.layout import MANIFEST, PLACES, InstallError, Item

MANIFEST_SCHEMA = 1


def read_manifest(root: Path) -> dict[str, object] | None:
    p = under(root, MANIFEST)
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


def _ours(path: str, *, parents: bool = False) -> bool:
    """A path the layout may hold: absolute, normal, under one of the places bv lays out (or,
    with `parents`, one of their parents: a staging root starts empty)."""
    if not path.startswith("/") or os.path.normpath(path) != path or path == "/":
        return False
    return any(path == top or path.startswith(top + "/") or (parents and top.startswith(path + "/"))
               for top in PLACES)


def manifest_items(manifest: dict[str, object] | None) -> dict[str, dict[str, str]]:
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


def manifest_dirs(manifest: dict[str, object] | None) -> list[str]:
    raw = (manifest or {}).get("dirs")
    if not isinstance(raw, list):
        return []
    return [d for d in raw if isinstance(d, str) and _ours(d, parents=True)]


def write_manifest(root: Path, items: list[Item], dirs: list[str], venv: Path,
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
    write(under(root, MANIFEST), Item(MANIFEST, 0o644, text.encode()))
