"""Build hook: the files a node needs besides the Python code become package data.

`prolog_epilog/` (hook shims, systemd units, logrotate, Prometheus files) and
`slurm/hooks.conf` stay at the top of the source tree, the one copy anyone edits; the wheel
carries them as `bluevela/_data/...`, copied here at build time (never committed).
`bluevela.deploy.data` reads them from there, or from the checkout in an editable install.
Everything else about the package is in pyproject.toml.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
# Relative to the source tree; a directory is copied whole (no dot files, no caches).
DATA = ("prolog_epilog", "slurm/hooks.conf")


def data_files() -> list[Path]:
    """Every file of DATA, relative to the source tree, sorted."""
    out: list[Path] = []
    for rel in DATA:
        src = HERE / rel
        if src.is_file():
            out.append(Path(rel))
            continue
        for path in sorted(src.rglob("*")):
            parts = path.relative_to(HERE).parts
            if path.is_file() and not any(p.startswith(".") or p == "__pycache__" for p in parts):
                out.append(path.relative_to(HERE))
    return out


class BuildWithData(build_py):
    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return  # an editable install reads the checkout itself
        dest = Path(self.build_lib) / "bluevela" / "_data"
        if dest.exists():
            shutil.rmtree(dest)
        for rel in data_files():
            target = dest / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(HERE / rel, target)  # keeps the shims' executable bits


setup(cmdclass={"build_py": BuildWithData})
