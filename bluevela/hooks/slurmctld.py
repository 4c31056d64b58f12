"""`python -m bluevela.hooks.slurmctld`: ingest one finished job (what EpilogSlurmctld runs).

`prolog_epilog/epilog_slurmctld` (a POSIX sh shim) execs `python -I -m` this from `/` with
SLURM_JOB_ID in the environment. Settings come from `/etc/bluevela/hook.env` (the same
root-owned, BV_*-only file the node hooks read: BV_SITE, BV_SPOOL_DIR, BV_ARCHIVE_DIR), then
the site file ($BV_SITE or /etc/bluevela/site.yaml, never the working directory's).

It runs as SlurmUser, and ingest runs only as the owner of the spool and the archive
(docs/archive.md, "Ownership"): with SlurmUser not that owner, every run fails with one line
saying so (slurmctld logs it) and the timer ingest, run as the owner, archives the job.

The node epilogs of the job may still be running when slurmctld starts this, so it first waits
up to `BV_ARCHIVE_WAIT_S` (default 30 s) for every node's epilog report; a job still
incomplete then stays in the spool for the next run or the timer (docs/archive.md). Exit 0 when
the job was ingested or left waiting, 1 on an archive error (slurmctld only logs it).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import MutableMapping
from pathlib import Path

from bluevela.errors import BluevelaError

logger = logging.getLogger(__name__)

DEFAULT_WAIT_S = 30.0


def main(environ: MutableMapping[str, str] | None = None) -> int:
    """Ingest the job named by SLURM_JOB_ID; return the exit status."""
    import time

    from bluevela.hooks import log as hooklog
    from bluevela.hooks.env import load_hook_env
    from bluevela.util.fs import safe_job_id

    env = os.environ if environ is None else environ
    started = time.monotonic()
    logging.basicConfig(level=logging.WARNING, format="bluevela epilog_slurmctld: %(message)s")
    job_id: int | str | None = env.get("SLURM_JOB_ID")
    try:
        load_hook_env(env)
        job_id = safe_job_id(env.get("SLURM_JOB_ID", ""))
        wait_s = float(env.get("BV_ARCHIVE_WAIT_S") or DEFAULT_WAIT_S)
        spool, archive = _dirs(env)
        from bluevela.archive.ingest import ingest

        # No compaction here: a large merge would hold the lock while jobs keep ending; the
        # timer ingest compacts.
        res = ingest(spool, archive, job_id=job_id, wait_s=max(0.0, min(wait_s, 600.0)),
                     compact=False)
    except (BluevelaError, ValueError) as exc:
        print(f"bluevela epilog_slurmctld: error: {exc}", file=sys.stderr)
        hooklog.hook_line("epilog_slurmctld", {
            "job": job_id, "action": "hook-error", "time": f"{time.monotonic() - started:.2f}s",
            "exit": 1, "detail": str(exc)}, hooklog.ERR, env)
        return 1
    if res.waiting_jobs:
        logger.warning("job %d: %d report(s) wait for the job's other nodes (the timer ingest "
                       "completes it)", job_id, res.waiting_reports)
    # One syslog line per run, as the node hooks (bluevela.hooks.log).
    hooklog.hook_line("epilog_slurmctld", {
        "job": job_id, "action": "waiting" if res.waiting_jobs else "ingested",
        "time": f"{time.monotonic() - started:.2f}s", "exit": 0}, hooklog.INFO, env)
    return 0


def _dirs(env: MutableMapping[str, str]) -> tuple[Path, Path]:
    spool, archive = env.get("BV_SPOOL_DIR"), env.get("BV_ARCHIVE_DIR")
    if spool and archive:
        return Path(spool), Path(archive)
    from bluevela.site import load_site

    site = load_site(cwd=False)  # $BV_SITE (hook.env) or /etc/bluevela: never ./site.yaml
    return Path(spool) if spool else site.path("spool"), Path(archive) if archive else \
        site.path("archive")


if __name__ == "__main__":
    from bluevela.hooks.env import isolate

    isolate("bluevela.hooks.slurmctld")  # python -I, from /: see bluevela.hooks.env
    sys.exit(main())
