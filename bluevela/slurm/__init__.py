"""Talking to Slurm: one seam (`SlurmClient`), a CLI implementation and a pyslurm one."""

from __future__ import annotations

from bluevela.slurm.client import JobInfo, NodeInfo, SlurmClient
from bluevela.slurm.connect import get_client
from bluevela.slurm.states import JobState

__all__ = ["JobInfo", "JobState", "NodeInfo", "SlurmClient", "get_client"]
