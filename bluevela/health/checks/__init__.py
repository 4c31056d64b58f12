"""The built-in checks. Importing this package registers them; none of these modules imports
torch, numpy or pynvml at import time (the prolog's quick path imports all of them)."""

from __future__ import annotations

from bluevela.health.checks import dcgm, gpu, ib, nccl, node, versions

__all__ = ["dcgm", "gpu", "ib", "nccl", "node", "versions"]
