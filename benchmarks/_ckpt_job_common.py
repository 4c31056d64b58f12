"""What the checkpoint benchmark's two job scripts (ckpt_job.py, ckpt_crash_job.py) share:
their common options and the atomic `torch.save` the examples do (examples/train_ddp.py).

Imported after torch: ckpt_crash_job.py installs bv's signal handler before torch is imported.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import torch


def job_parser() -> argparse.ArgumentParser:
    """The options of both jobs: the shared directory, the base of the node-local directories
    (one per host below it), the state's size per rank in MB."""
    p = argparse.ArgumentParser()
    p.add_argument("--shared", type=Path, required=True)
    p.add_argument("--local-base", type=Path, required=True)
    p.add_argument("--mb", type=float, default=64)
    return p


def fsync_save(state: Any, path: Path) -> None:
    """`torch.save` of `state` to `path`, atomically: a temporary file, fsync, rename."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
