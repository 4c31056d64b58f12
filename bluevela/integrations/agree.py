"""The ranks agree on a checkpoint request: one all-reduce of one number (MAX: any rank asked).

The signal reaches the ranks microseconds to milliseconds apart; every rank must stop after
the same step. Called at each step boundary by the integrations, on every rank, in step.
"""

from __future__ import annotations

from typing import Any


def any_rank(flag: bool, device: Any = None) -> bool:
    """True on every rank when `flag` is True on any; `flag` alone outside torch.distributed.

    Args:
        flag: this rank's request (`bluevela.runtime.checkpoint_requested()`).
        device: where the collective's tensor lives (the CUDA device under NCCL); None: CPU.
    """
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return flag
    if device is None and dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    value = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item() > 0)
