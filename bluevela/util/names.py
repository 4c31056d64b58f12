"""Ordering of node names, shared by the checks' callers, the benchmarks and the pages."""

from __future__ import annotations

import re


def natural_key(name: str) -> list[object]:
    """node2 before node10."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]
