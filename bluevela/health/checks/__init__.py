"""The built-in checks. Importing this package registers them (each under its name in
`checks_registry.BUILTIN_CHECKS`); none of these modules imports torch, numpy or pynvml at
import time (the prolog's quick path imports all of them)."""

from __future__ import annotations

from bluevela.checks_registry import Check, lookup, registered
from bluevela.health.checks import dcgm, gpu, ib, nccl, node, versions

__all__ = ["all_checks", "dcgm", "get_check", "gpu", "ib", "nccl", "node", "versions"]


def all_checks() -> dict[str, Check]:
    """Every registered check by name: the built-in ones and any registered since."""
    return registered()


def get_check(name: str) -> Check:
    """The registered check `name`.

    Raises:
        HealthError: no such check (the message lists the known ones).
    """
    return lookup(name)
