"""Which `SlurmClient` bv talks through: pyslurm when it imports and matches the running Slurm,
otherwise the CLI implementation (sbatch/squeue/sacct/scontrol).

Apart from the protocol (bluevela/slurm/client.py) so that the implementations can import the
protocol's data without the protocol's module importing them back.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from bluevela.slurm.client import SlurmClient

logger = logging.getLogger(__name__)


def get_client(*, retry_s: float | None = None) -> SlurmClient:
    """The best available client: pyslurm when it matches the running Slurm, else the CLI."""
    from bluevela.slurm.cli_client import CliSlurmClient

    cli = CliSlurmClient(retry_s=retry_s)
    try:
        from bluevela.slurm.pyslurm_client import PySlurmClient, pyslurm_matches

        if pyslurm_matches(cli):
            logger.debug("using pyslurm")
            return PySlurmClient(fallback=cli)
    except ImportError:
        pass
    return cli
