"""The files bluevela lays out on a node, read from the installed package.

A built wheel carries them as package data under `bluevela/_data/` (setup.py copies them
there from the top-level `prolog_epilog/` and `slurm/` at build time: those stay the one
source). A source checkout or an editable install has no `_data/`: the files are read from the
checkout itself.
"""

from __future__ import annotations

from pathlib import Path

from bluevela.errors import BluevelaError

PACKAGE = Path(__file__).resolve().parent.parent
DATA = PACKAGE / "_data"
CHECKOUT = PACKAGE.parent


class DataError(BluevelaError):
    """The package data is missing (a broken install)."""


def root() -> Path:
    """The directory that holds `prolog_epilog/` and `slurm/`: the wheel's `_data`, else the
    checkout this package is imported from."""
    if (DATA / "prolog_epilog").is_dir():
        return DATA
    if (CHECKOUT / "prolog_epilog").is_dir() and (CHECKOUT / "slurm").is_dir():
        return CHECKOUT
    raise DataError(f"the package data is missing ({DATA} and {CHECKOUT / 'prolog_epilog'} "
                    "absent): reinstall bluevela from its wheel")


def path(rel: str) -> Path:
    """The file `rel` (e.g. `slurm/hooks.conf`) of the package data."""
    return root() / rel


def read_text(rel: str) -> str:
    try:
        return path(rel).read_text()
    except OSError as exc:
        raise DataError(f"package data {rel}: {exc.strerror or exc}") from exc
