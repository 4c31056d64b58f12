"""Reading a job's output file, optionally following it until the job ends."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from bluevela.errors import SlurmError
from bluevela.slurm.client import SlurmClient


def log_path(client: SlurmClient, job_id: int) -> Path:
    info = client.job(job_id)
    if not info.stdout:
        raise SlurmError(f"Slurm reports no output file for job {job_id}")
    path = Path(info.stdout)
    if not path.is_absolute() and info.work_dir:
        path = Path(info.work_dir) / path
    return path


def stream_log(
    client: SlurmClient, job_id: int, *, follow: bool = False, poll_s: float = 0.5,
    sleep: Callable[[float], None] = time.sleep,
) -> Iterator[str]:
    """Yield the output file's text; with `follow`, keep yielding until the job is terminal."""
    path = log_path(client, job_id)
    pos = 0
    while True:
        try:
            with open(path, "rb") as f:
                f.seek(pos)
                data = f.read()
                pos = f.tell()
        except FileNotFoundError:
            data = b""
            if not follow:
                raise SlurmError(f"{path}: no such file (job not started yet?)") from None
        if data:
            yield data.decode("utf-8", errors="replace")
        if not follow:
            return
        if client.job(job_id).state.is_terminal():
            # One last read after the end: the final lines may land after the state change.
            if os.path.exists(path):
                with open(path, "rb") as f:
                    f.seek(pos)
                    rest = f.read()
                if rest:
                    yield rest.decode("utf-8", errors="replace")
            return
        sleep(poll_s)
