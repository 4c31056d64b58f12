"""`bv install` made a local system user (`bvfleet`) on every host it ran on, though one host
runs bv-fleet-metrics: on 1,000 nodes under LDAP, 1,000 local users with diverging uids (issue
35). Now only `--fleet-host` makes the user and its textfile directory. Checked as a dry run on
the real root (nothing written, a test user's name), and through the CLI's help."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from bluevela.deploy.fleet_account import Account
from bluevela.deploy.install import install

ACCOUNT = Account("bvtest-issue35", "/nonexistent-bvtest-35/textfile")


def _fleet_changes(fleet_host: bool) -> tuple[list[str], list[str]]:
    r = install("/", dry_run=True, venv=Path(sys.prefix), force=True, fleet_host=fleet_host,
                account=ACCOUNT)
    lines = [c.line() for c in r.changes if ACCOUNT.user in c.line() or "bvtest-35" in c.path]
    return lines, r.notes


def test_a_plain_install_makes_no_fleet_user() -> None:
    lines, notes = _fleet_changes(False)
    assert lines == []
    assert any(n.startswith(f"user {ACCOUNT.user} and {ACCOUNT.textfile} are not made on this "
                            "host") and "bv install --fleet-host" in n for n in notes), notes


def test_fleet_host_makes_them() -> None:
    lines, _ = _fleet_changes(True)
    assert any(ln.startswith(f"create  user {ACCOUNT.user}") for ln in lines), lines
    assert any(ACCOUNT.textfile in ln for ln in lines), lines


def test_the_option_is_in_the_help() -> None:
    p = subprocess.run([sys.executable, "-m", "bluevela", "install", "--help"],
                       capture_output=True, text=True, timeout=60, check=True)
    assert "--fleet-host" in p.stdout
