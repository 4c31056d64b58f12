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

This module runs the steps in order; each concern is a module of its own: `layout` (what is
laid out: the places, `Item`, `plan`, the venv), `trust` (`trust_problems`), `files` (one file
compared, written whole, removed), `manifest`, `fleet_account` and `slurm_conf` (whether the
node's Slurm still runs the shims).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path

from bluevela import __version__
from bluevela.deploy.files import check_dir, compare, makedirs, remove, remove_dirs, under, write
from bluevela.deploy.fleet_account import (
    FLEET_ACCOUNT,
    Account,
    fleet_account,
    remove_fleet_account,
)
from bluevela.deploy.layout import (
    CURRENT,
    GUARDED_DIRS,
    MANIFEST,
    UNIT_DIR,
    Change,
    InstallError,
    Result,
    find_venv,
    plan,
)
from bluevela.deploy.manifest import manifest_dirs, manifest_items, read_manifest, write_manifest
from bluevela.deploy.slurm_conf import hooks_in_slurm_conf
from bluevela.deploy.trust import trust_problems

logger = logging.getLogger(__name__)


def install(root: str | os.PathLike[str] = "/", *, dry_run: bool = False,
            venv: Path | None = None, account: Account = FLEET_ACCOUNT,
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
        check_dir(under(base, d))
    problems = trust_problems(venv)
    if problems and not force:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise InstallError(f"{problems[0]}{more}: the hooks run this venv as root; refused "
                           "(--force for a developer's machine)")
    result.warnings.extend(f"--force: {p}" for p in problems)
    items = plan(venv, base)
    old = read_manifest(base)
    old_entries = manifest_items(old)
    old_dirs = manifest_dirs(old)
    created: list[str] = []
    for item in items:
        real = under(base, item.path)
        state = compare(real, item)
        if state == "same":
            continue
        makedirs(base, item.path, created, dry_run)
        detail = (f"-> {item.target}" if item.target is not None else f"{item.mode:04o}")
        if not dry_run:
            write(real, item)
        result.changes.append(Change("create" if state == "absent" else "update", item.path,
                                     detail))
    wanted = {it.path for it in items}
    for path, entry in old_entries.items():
        if path not in wanted and path != MANIFEST:
            remove(base, path, entry, result)  # shipped by the version installed before
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
        makedirs(base, MANIFEST, dirs, dry_run)
        if not dry_run:
            write_manifest(base, items, dirs, venv, system)
    if any(c.path.startswith(UNIT_DIR) for c in result.changes) and str(base) == "/":
        result.notes.append("units changed: systemctl daemon-reload (they are not enabled "
                            "by bv install; docs/install.md 3)")
    return result


def uninstall(root: str | os.PathLike[str] = "/", *, dry_run: bool = False,
              force: bool = False, account: Account = FLEET_ACCOUNT) -> Result:
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
    manifest = read_manifest(base)
    result = Result(str(base), __version__, dry_run)
    if manifest is None:
        result.notes.append(f"no {MANIFEST} under {base}: nothing was installed here by bv "
                            "install")
        return result
    # The switch first: from here on the shims find no interpreter and skip (exit 0).
    entries = manifest_items(manifest)
    order = sorted(entries, key=lambda p: p != CURRENT)
    for path in order:
        remove(base, path, entries[path], result)
    remove_fleet_account(base, manifest.get("system"), result, dry_run=dry_run, account=account)
    real = under(base, MANIFEST)
    if not dry_run:
        os.unlink(real)
    result.changes.append(Change("remove", MANIFEST))
    dirs = manifest_dirs(manifest)
    for d in remove_dirs(base, dirs, result):
        result.notes.append(f"kept {d}/: not empty (files bv install did not lay out)")
    return result
