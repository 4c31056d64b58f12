"""Whether the node's Slurm still runs bv's hook shims (`--uninstall` refuses while it does:
Slurm drains a node whose prolog cannot run)."""

from __future__ import annotations

import os
from pathlib import Path

from bluevela.deploy.files import under
from bluevela.deploy.layout import PREFIX


def hooks_in_slurm_conf(root: Path) -> list[str]:
    """The slurm.conf lines (the node's own file: $SLURM_CONF, else /etc/slurm/slurm.conf,
    under `root`) that still run a shim of PREFIX: removing the shims under them would make
    every hook fail, and Slurm drains a node whose prolog cannot run."""
    conf = os.environ.get("SLURM_CONF") if str(root) == "/" else None
    path = Path(conf) if conf else under(root, "/etc/slurm/slurm.conf")
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
