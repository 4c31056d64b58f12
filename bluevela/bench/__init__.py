"""Nightly acceptance benchmarks: measurements, their pure evaluations, the nightly run.

Folder map:

- `result.py`: `Figure`, `Facts` (what a measurement gathered), `BenchResult`, `Status`.
- `registry.py`: the one place a measurement is registered (`@register`); `catalog.py`: the
  shipped measurements by name (`measurements()`, `get()`: imports the modules below).
- `gemm.py`, `memory.py` (hbm, h2d, d2h), `allreduce.py`, `mpi.py`: gather code (torch and
  mpi4py imported inside functions) and the checks each figure is judged by.
- `evaluate.py`: the pure `(facts, thresholds, history) -> BenchResult` evaluation.
- `dist.py`, `worker.py`: rank setup for multi-process measurements (local spawn or srun).
- `runner.py`: `bv bench run` on the local node.
- `pairing.py`: which node pairs to measure, and who is at fault when a pair is slow (pure).
- `nightly.py`: the nightly run through Slurm; `store.py`: its HDF5 record; `report.py`: HTML.

Nothing here imports torch, numpy, h5py or mpi4py at module level.
"""

from __future__ import annotations
