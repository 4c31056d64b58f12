"""`python -m bluevela.hooks prolog|epilog|healthcheck` (what the prolog_epilog/ shims exec)."""

from __future__ import annotations

import sys

from bluevela.hooks import main

if __name__ == "__main__":
    sys.exit(main())
