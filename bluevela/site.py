"""The site: the model of what site.yaml describes (bluevela/site_model.py) and `load_site`,
which finds, reads and validates the file (bluevela/site_file.py: the search order, the
`PATH:LINE` errors, the cache).

Neither the model nor its reader imports this module, and the model imports no reader: the
reader builds the model, and this module hands out both (the reader only when a site is loaded).
"""

from __future__ import annotations

import os

from bluevela.site_model import (
    VERSION_FIELDS,
    AbsPath,
    BenchThresholds,
    Checkpoints,
    DcgmOptions,
    GPUThresholds,
    Health,
    IBExpect,
    IBThresholds,
    Launch,
    LocalCheckpoint,
    NCCLThresholds,
    NodeClass,
    NodeThresholds,
    Paths,
    Site,
    Telemetry,
    Tier,
    VersionField,
    VersionPins,
    to_dict,
)

__all__ = [
    "VERSION_FIELDS", "AbsPath", "BenchThresholds", "Checkpoints", "DcgmOptions",
    "GPUThresholds", "Health", "IBExpect", "IBThresholds", "Launch", "LocalCheckpoint",
    "NCCLThresholds", "NodeClass", "NodeThresholds", "Paths", "Site", "Telemetry", "Tier",
    "VersionField", "VersionPins", "load_site", "to_dict",
]


def load_site(explicit: str | os.PathLike[str] | None = None, *, cwd: bool = True,
              strict: bool = False) -> Site:
    """The site file found, read and validated (`site_file.load_site`: the search order, the
    cache, the `PATH:LINE` errors).

    Raises:
        SiteConfigError: when missing, unreadable or invalid.
    """
    from bluevela.site_file import load_site as load

    return load(explicit, cwd=cwd, strict=strict)
