"""`mpi`: point-to-point bandwidth and latency between two nodes with mpi4py, the MPI path that
does not go through NCCL (run it under `srun -N2 --ntasks-per-node=1 --mpi=pmix`).

- Latency: half the round trip of an 8-byte ping-pong, averaged over a timed loop (osu_latency).
- Bandwidth: a window of non-blocking sends of one message size, then a one-byte ack, repeated
  (osu_bw); GB/s = bytes moved / time, GB = 1e9 B.

Rank 0 measures against the last rank (with one task per node: the other node). Buffers are
bytearrays: no numpy needed. Iteration counts are decided on rank 0 and broadcast.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from bluevela.bench.registry import Check, RunParams, register
from bluevela.bench.result import Facts, Figure
from bluevela.bench.timing import iterations_for

logger = logging.getLogger(__name__)

GPU_NODE_DEFAULT_BYTES = 4 << 20
CPU_NODE_DEFAULT_BYTES = 256 << 10
WINDOW = 8
LAT_BYTES = 8


def _pingpong(MPI: Any, comm: Any, rank: int, peer: int, buf: bytearray, iters: int) -> None:
    msg = [buf, MPI.BYTE]
    for _ in range(iters):
        if rank == 0:
            comm.Send(msg, dest=peer, tag=1)
            comm.Recv(msg, source=peer, tag=1)
        elif rank == peer:
            comm.Recv(msg, source=0, tag=1)
            comm.Send(msg, dest=0, tag=1)


def _stream(MPI: Any, comm: Any, rank: int, peer: int, buf: bytearray, ack: bytearray,
            rounds: int) -> None:
    msg = [buf, MPI.BYTE]
    for _ in range(rounds):
        if rank == 0:
            MPI.Request.Waitall([comm.Isend(msg, dest=peer, tag=2) for _ in range(WINDOW)])
            comm.Recv([ack, MPI.BYTE], source=peer, tag=3)
        elif rank == peer:
            MPI.Request.Waitall([comm.Irecv(msg, source=0, tag=2) for _ in range(WINDOW)])
            comm.Send([ack, MPI.BYTE], dest=0, tag=3)


def _timed(comm: Any, fn: Any, est_iters: int, budget_s: float, min_iters: int,
           max_iters: int) -> tuple[int, float]:
    """Estimate on `est_iters`, agree on a count (rank 0 decides), time that many."""
    t0 = time.perf_counter()
    fn(est_iters)
    est = (time.perf_counter() - t0) / est_iters
    iters = comm.bcast(iterations_for(est, budget_s, min_iters=min_iters, max_iters=max_iters),
                       root=0)
    comm.Barrier()
    t0 = time.perf_counter()
    fn(iters)
    return iters, time.perf_counter() - t0


def run_mpi(size_bytes: int, budget_s: float = 0.5) -> Facts:
    """This rank's part of the MPI measurement; rank 0's Facts carry the figures."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    hosts = tuple(dict.fromkeys(str(h) for h in comm.allgather(MPI.Get_processor_name())))
    if world < 2:
        return Facts.failed("mpi", "needs 2 MPI ranks on two nodes: run it under "
                            "srun -N2 --ntasks-per-node=1 --mpi=pmix", hosts=hosts)
    peer = world - 1
    small = bytearray(LAT_BYTES)
    _pingpong(MPI, comm, rank, peer, small, 10)
    lat_iters, lat_s = _timed(comm, lambda n: _pingpong(MPI, comm, rank, peer, small, n), 10,
                              budget_s, 10, 10000)
    big, ack = bytearray(size_bytes), bytearray(1)
    _stream(MPI, comm, rank, peer, big, ack, 1)
    rounds, bw_s = _timed(comm, lambda n: _stream(MPI, comm, rank, peer, big, ack, n), 1,
                          budget_s, 2, 100)
    comm.Barrier()
    if rank != 0:
        return Facts("mpi", note=f"rank {rank}", hosts=hosts)
    lat_us = lat_s / lat_iters / 2 * 1e6
    bw = size_bytes * WINDOW * rounds / bw_s / 1e9
    figures = (
        Figure("mpi_bw_gbs", bw, "GB/s", size=size_bytes),
        Figure("mpi_bw_gbs", bw, "GB/s"),
        Figure("mpi_lat_us", lat_us, "us", size=LAT_BYTES),
        Figure("mpi_lat_us", lat_us, "us"),
    )
    # Open MPI pads its version string with NULs.
    library = MPI.Get_library_version().replace("\x00", "").splitlines()[0].strip()
    note = f"{library}; {world} ranks on {', '.join(hosts)}; window {WINDOW} x {size_bytes} B"
    if len(hosts) < 2:
        return Facts("mpi", figures, ran=False, note=f"every rank on one host ({note})",
                     hosts=hosts)
    return Facts("mpi", figures, note=note, hosts=hosts)


def default_size(params: RunParams) -> int:
    if params.thresholds.mpi_size_bytes:
        return params.thresholds.mpi_size_bytes
    return GPU_NODE_DEFAULT_BYTES if params.gpus else CPU_NODE_DEFAULT_BYTES


@register("mpi", scope="pair",
          checks=(Check("mpi_bw_gbs", "mpi_bw_gbs"),
                  Check("mpi_lat_us", "mpi_lat_us_max", ceiling=True)),
          summary="MPI point-to-point GB/s and latency between two nodes (srun --mpi=pmix)")
def gather(params: RunParams) -> Facts:
    """MPI bandwidth and latency between the first and the last rank of this MPI job."""
    try:
        return run_mpi(default_size(params), params.budget_s)
    except ImportError as exc:
        return Facts.failed("mpi", f"mpi4py does not import: {exc}")
