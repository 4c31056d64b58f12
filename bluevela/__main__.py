"""`python -m bluevela` is `bv`."""

from __future__ import annotations

from bluevela.cli import main

main()
