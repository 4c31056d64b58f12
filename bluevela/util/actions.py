"""What bluevela may do on this host: the action mode (docs/health.md, "Audit mode and the
kill switch").

A leaf (standard library only): the hook reads it on every run before it checks anything (an
`off` node checks nothing), and `bluevela.fleet.nodestate`, the one place that acts, gates every
drain, resume and breaker slot on it (adding the cluster-wide kill switch there, where the
controller is asked anyway). Importing nodestate (and the Slurm client) on every healthy prolog
for this would cost ~10-25 ms of CPU.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

ACTION_MODES = ("enforce", "audit", "off")
ACTIONS_FILE = Path("/etc/bluevela/actions")


@dataclass(frozen=True)
class Actions:
    """What bluevela may do on this host, and which setting said so."""

    mode: str  # enforce | audit | off
    source: str  # "site.yaml", the node file's path, "reservation bv-actions-off"

    @property
    def enforce(self) -> bool:
        return self.mode == "enforce"

    def why(self, what: str) -> str:
        return f"actions {self.mode} ({self.source}): would {what}"


def node_actions(environ: Mapping[str, str] | None = None) -> Actions | None:
    """The node's own setting (`$BV_ACTIONS_FILE`, else /etc/bluevela/actions), or None when
    there is none. Anything but enforce/audit/off (or an unreadable file) is audit."""
    env = os.environ if environ is None else environ
    path = env.get("BV_ACTIONS_FILE") or str(ACTIONS_FILE)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as exc:
        logger.warning("%s unreadable (%s): actions audit", path, exc.strerror or exc)
        return Actions("audit", f"{path} unreadable")
    try:
        raw = os.read(fd, 256)
    except OSError as exc:
        logger.warning("%s unreadable (%s): actions audit", path, exc.strerror or exc)
        return Actions("audit", f"{path} unreadable")
    finally:
        os.close(fd)
    words = raw.decode("ascii", "replace").split()
    word = words[0].lower() if words else ""
    if word not in ACTION_MODES:
        logger.warning("%s says %r, not one of %s: actions audit", path, word[:20],
                       "/".join(ACTION_MODES))
        return Actions("audit", f"{path} (not enforce/audit/off)")
    return Actions(word, path)


def local_actions(site_mode: str, environ: Mapping[str, str] | None = None) -> Actions:
    """This host's mode: the node file when there is one, else `site_mode` (site.yaml's
    `health.actions`)."""
    return node_actions(environ) or Actions(site_mode, "site.yaml")
