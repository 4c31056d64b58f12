"""One error hierarchy. The CLI maps each to a one-line message and an exit code."""

from __future__ import annotations


class BluevelaError(Exception):
    """Base of every expected error: printed as one line, never as a traceback."""

    exit_code: int = 1


class SiteConfigError(BluevelaError):
    """site.yaml is missing or invalid. `problems` holds `PATH:LINE: message` lines."""

    def __init__(self, message: str, problems: list[str] | None = None) -> None:
        super().__init__(message)
        self.problems = problems or []


class SlurmError(BluevelaError):
    """A Slurm command failed or answered something we cannot parse."""


class SlurmUnreachable(SlurmError):
    """slurmctld could not be reached within the retry budget."""

    exit_code = 75  # EX_TEMPFAIL: worth retrying later


class LaunchError(BluevelaError):
    """A submit request is invalid (an unsafe value, an unknown option)."""

    exit_code = 2


class HealthError(BluevelaError):
    """The health runner itself could not run (not a failed check: that is a status)."""


class ArchiveError(BluevelaError):
    """The spool or the HDF5 archive is unusable."""


class BenchError(BluevelaError):
    """A benchmark could not run or its output could not be parsed."""


class UnsafeValueError(BluevelaError):
    """A value from a job's owner cannot be used as a name or path."""

    exit_code = 2
