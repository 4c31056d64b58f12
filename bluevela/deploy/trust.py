"""What `current` names runs as root (issue 33): the venv, the directories above it, its
interpreter and site-packages (the hooks' `python3 -I` still runs their .pth files), and the
package `bv install` copies from. `trust_problems` says, one line each, what lets anyone but
root change that code.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from bluevela.deploy import data


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
