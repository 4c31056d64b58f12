"""The measurements bluevela ships, by name: `measurements()` imports the modules that define
them (gemm, memory, allreduce, mpi; each registers into `registry` on import) and `get(name)`
looks one up. Those modules are imported on the first call, not with this module, so
importing it stays cheap; none of them imports torch or mpi4py at module level.
"""

from __future__ import annotations

from bluevela.bench.registry import Measurement, registered
from bluevela.errors import BenchError


def measurements() -> dict[str, Measurement]:
    """Every registered measurement, by name (imports the defining modules once)."""
    import bluevela.bench.allreduce
    import bluevela.bench.gemm
    import bluevela.bench.memory
    import bluevela.bench.mpi  # noqa: F401  (importing them registers them)

    return registered()


def get(name: str) -> Measurement:
    """The measurement `name`; BenchError listing the known ones otherwise."""
    known = measurements()
    try:
        return known[name]
    except KeyError:
        raise BenchError(f"no measurement {name!r} (known: {', '.join(sorted(known))})") from None
