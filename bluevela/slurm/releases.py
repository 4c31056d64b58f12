"""What bv can use on a Slurm release, from its running config (`scontrol show config`).

Measured on the dev cluster on each release (docs/install.md, "Slurm releases"): the release
table there and these rules come from the same runs. Pure functions of the config's
``KEY -> value`` mapping, and `expedite_problem_here`, which reads the running config
(`scontrol show config`) for `bv submit --requeue=expedite`.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Mapping

# The releases bv's Slurm-facing and cluster tests ran on (tests/data/slurm/<release>/ holds
# what each one printed).
TESTED = ("22.05", "24.11", "25.11", "26.05")
EXPANSION_PARAM = "permit_job_expansion"
EXPEDITE_PARAM = "enable_expedited_requeue"
EXPEDITE_SINCE = (25, 11)  # sbatch --requeue=expedite
# The last release on which a grown node runs the job's steps with PrologFlags=Alloc. Measured:
# 22.05 grows; on 24.11 the node added by expansion never gets the job's prolog launch, and its
# first step waits 20 s for it ("Waiting for JobId=N REQUEST_LAUNCH_PROLOG notification failed,
# giving up after 20 sec"), then slurmctld drains the node and requeues the job. 23.02 to 24.05
# were not tried: taken to behave as 24.11 (a failed grow costs more than a requeue).
GROWS_WITH_ALLOC_UNTIL = (22, 5)


def release(config: Mapping[str, str]) -> tuple[int, int] | None:
    """(major, minor) of SLURM_VERSION (e.g. "24.11.5" -> (24, 11)), None when unreadable."""
    parts = config.get("SLURM_VERSION", "").strip().split(".")
    if len(parts) < 2 or not parts[0].isdigit() or not parts[1].isdigit():
        return None
    return int(parts[0]), int(parts[1])


def _words(value: str) -> set[str]:
    value = value.strip()
    if value in ("", "(null)", "none", "NONE"):
        return set()
    return {w.strip().split("=", 1)[0].lower() for w in value.split(",") if w.strip()}


def expansion_problem(config: Mapping[str, str]) -> str | None:
    """Why this Slurm cannot grow a running job for bv, or None when it can (as far as the
    config and the release say: the salloc itself is the final word)."""
    if EXPANSION_PARAM not in _words(config.get("SchedulerParameters", "")):
        return (f"this Slurm cannot grow jobs: SchedulerParameters lacks {EXPANSION_PARAM} "
                "(docs/install.md, 'Growing a job')")
    rel = release(config)
    if rel is not None and rel > GROWS_WITH_ALLOC_UNTIL \
            and "alloc" in _words(config.get("PrologFlags", "")):
        return (f"Slurm {rel[0]}.{rel[1]:02d} does not start a grown job's steps on the added "
                "node with PrologFlags=Alloc (its prolog launch never comes: the node is "
                "drained and the job requeued), so bv does not grow here "
                "(docs/install.md, 'Slurm releases')")
    return None


def expedite_state(config: Mapping[str, str]) -> str:
    """One of "unavailable" (before 25.11), "on" (SlurmctldParameters has
    enable_expedited_requeue), "off"."""
    rel = release(config)
    if rel is None or rel < EXPEDITE_SINCE:
        return "unavailable"
    return "on" if EXPEDITE_PARAM in _words(config.get("SlurmctldParameters", "")) else "off"


def expedite_problem(config: Mapping[str, str]) -> str | None:
    """Why `sbatch --requeue=expedite` would not be taken on this Slurm, None when it would.
    Before 25.11 sbatch refuses a value for --requeue ("doesn't allow an argument"); 25.11 and
    later refuse the job unless SlurmctldParameters has enable_expedited_requeue (slurmctld's
    job_mgr.c: "Expedited requeue requested but not enabled", ESLURM_NOT_SUPPORTED)."""
    version = config.get("SLURM_VERSION", "").strip() or "(version unknown)"
    state = expedite_state(config)
    if state == "on":
        return None
    if state == "unavailable":
        return (f"Slurm {version} has no expedited requeue (Slurm 25.11 and later); "
                "submit with --requeue")
    return (f"Slurm {version} refuses it: slurm.conf SlurmctldParameters lacks "
            f"{EXPEDITE_PARAM} (`bv site validate --cluster` reports it)")


def expedite_problem_here(
    run: Callable[..., subprocess.CompletedProcess[str]] = subprocess.run,
    timeout_s: float = 30.0,
) -> str | None:
    """Why the Slurm this login node talks to would not take `--requeue=expedite`, from its
    running config (`scontrol show config`; `expedite_problem`), None
    when it would. An unreadable config is a problem too: bv cannot tell, and says so."""
    from bluevela.slurm.cli_client import parse_config

    try:
        proc = run(["scontrol", "show", "config"], capture_output=True, text=True,
                   timeout=timeout_s, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot read the running Slurm config (scontrol show config: {exc})"
    if proc.returncode != 0:
        err = (proc.stderr or "").strip().splitlines()
        why = err[-1] if err else f"exit status {proc.returncode}"
        return f"cannot read the running Slurm config (scontrol show config: {why})"
    return expedite_problem(parse_config(proc.stdout))
