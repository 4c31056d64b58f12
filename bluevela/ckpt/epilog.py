"""The epilog's part of the store: nothing a job left on the node-local tier outlives the
job's allocation on the node (a relaunch in the same allocation runs no epilog, so a spare's
step still finds the copies it needs; a requeued job resumes from shared storage, which the
store drains to at bv's checkpoint request and at the end). Standard library only."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

from bluevela.ckpt.layout import clear_job, node_dir
from bluevela.errors import BluevelaError, SiteConfigError
from bluevela.site import Site

logger = logging.getLogger(__name__)


def clear_for_epilog(site: Site, job_id: int, node: str,
                     env: Mapping[str, str] | None = None) -> str | None:
    """Remove `job_id`'s node-local checkpoint directory on this node (the node class's
    `checkpoint.dir`, `%n` in it this node's name, for the job's user `SLURM_JOB_UID`).
    Returns a line for the hook's log when something was removed or could not be, else None;
    never raises."""
    env = os.environ if env is None else env
    try:
        local = site.node_class(node).checkpoint.dir
    except SiteConfigError:
        return None
    uid = env.get("SLURM_JOB_UID", "")
    if local is None or not uid.isdigit():
        return None
    try:
        local = node_dir(local, node)
        if clear_job(local, str(job_id), int(uid)):
            return f"bv ckpt: removed job {job_id}'s node-local checkpoints under {local}"
        return None
    except (OSError, ValueError, BluevelaError) as exc:
        logger.warning("bv ckpt: job %s's node-local checkpoints: %s", job_id, exc)
        return f"bv ckpt: job {job_id}'s node-local checkpoints not removed: {exc}"
