"""`python -I -m bluevela.hooks prolog|epilog|healthcheck` (what the prolog_epilog/ shims exec).

Started without `-I` (an old shim, by hand), it first re-executes itself isolated, from `/`,
before importing anything that could come from slurmd's working directory: with `-m` Python
puts that directory first on the import path (see `bluevela.hooks.env.isolate`). Only `os` and
`sys`, loaded with the interpreter itself, are used until then.
"""

from __future__ import annotations

import os
import sys


def _reexec_isolated() -> None:
    os.chdir("/")
    if sys.flags.isolated or not sys.executable:
        return
    orig = list(getattr(sys, "orig_argv", []))
    flags = [f for f in orig[1:orig.index("-m")] if f != "-I"] if "-m" in orig else []
    os.execv(sys.executable, [sys.executable, "-I", *flags, "-m", "bluevela.hooks",
                              *sys.argv[1:]])


if __name__ == "__main__":
    _reexec_isolated()
    from bluevela.hooks import main

    sys.exit(main())
