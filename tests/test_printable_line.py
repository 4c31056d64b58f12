"""One printable line of free text (issue 38: five copies, now one where the logic was the
same): `protocol.names.printable`, used for a job's wire reasons and Slurm's error text in the
job side's one seam to Slurm (`slurm/command.py`: jobctl's calls and the grow's causes)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bluevela.launch import grow
from bluevela.protocol.names import printable
from bluevela.slurm.jobctl import JobControl
from tests.conftest import standin_command

HOSTILE = "\x1b[31mslurm_load_jobs\x1b[0m error:\n\tInvalid job id\r\x00 ‮é\x7f"


def test_hostile_text_is_one_line_of_printable_ascii() -> None:
    out = printable(HOSTILE)
    assert out == "?[31mslurm_load_jobs?[0m error: Invalid job id ? ???"
    assert out.isascii() and out.isprintable()
    assert printable("x" * 301, 300) == "x" * 300 + "..."
    assert printable("  a \n b  ", 300) == "a b" and printable(None) == "None"


def test_the_grow_names_slurm_s_refusal_on_one_printable_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: the grow kept escapes and non-ASCII (only whitespace was folded) and cut at 300
    without saying so. Now the seam (slurm/command.py) makes the line, from a real
    `scontrol` on PATH."""
    (tmp_path / "said").write_bytes(HOSTILE.encode() + b"y" * 400)
    standin_command(tmp_path, monkeypatch, "scontrol",
                    f"#!/bin/sh\ncat '{tmp_path / 'said'}' >&2\nexit 1\n")
    why = grow.readiness(30.0)
    assert why is not None and "?[31mslurm_load_jobs?[0m error: Invalid job id ? ???" in why
    assert why.isascii() and why.isprintable() and "..." in why


def test_jobctl_names_a_refusal_on_one_printable_line() -> None:
    script = "printf '\\033[31mInvalid job id\\nnext\\n' >&2; exit 1"
    call = JobControl("1", {}, retry_for_s=0.0).run(["sh", "-c", script])
    assert not call.ok
    assert call.why == "exit 1: ?[31mInvalid job id next"
