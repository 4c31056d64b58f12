"""Going into the background as a classic Unix daemon (for a start that must return, the way
the dev cluster starts slurmd and the node sampler; systemd needs none of it).

Standard library only.
"""

from __future__ import annotations

import os
from pathlib import Path


def daemonize(pidfile: Path | None = None, log: Path | None = None) -> None:
    """Double fork: the caller's process exits 0 at once, the grandchild goes on here.

    The grandchild is in a session of its own (no controlling terminal, never its leader, so
    it cannot get one back), stdin is /dev/null, stdout and stderr go to `log` (appended,
    mode 0640) or /dev/null, and its pid is written to `pidfile`.
    """
    if os.fork() > 0:
        os._exit(0)
    os.setsid()
    if os.fork() > 0:
        os._exit(0)
    fd = os.open(os.devnull, os.O_RDWR)
    os.dup2(fd, 0)
    out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o640) if log else fd
    os.dup2(out, 1)
    os.dup2(out, 2)
    for extra in {fd, out} - {0, 1, 2}:
        os.close(extra)
    if pidfile is not None:
        pidfile.write_text(f"{os.getpid()}\n")
