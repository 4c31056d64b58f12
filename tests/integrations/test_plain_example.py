"""examples/plain_ddp.py, the script without bv that the recovery benchmark crashes
(BV_BENCH_SCRIPT=plain): under torchrun alone it checkpoints, and the next run resumes there
on every rank."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _torchrun(ckpt: Path, steps: int) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "BV_"))}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         str(REPO / "examples" / "plain_ddp.py"), "--ckpt-dir", str(ckpt), "--steps",
         str(steps), "--ckpt-every", "3"],
        capture_output=True, text=True, env={**env, "OMP_NUM_THREADS": "1"}, timeout=240,
        check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


@pytest.mark.timeout(300)
def test_plain_script_checkpoints_and_resumes_on_every_rank(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    first = _torchrun(ckpt, 7)
    assert sorted(re.findall(r"^rank=(\d) resumed_from_step=0 world_size=2 ", first, re.M)) \
        == ["0", "1"], first
    assert re.findall(r"^step=(\d+)$", first, re.M) == [str(s) for s in range(1, 8)]
    assert [p.name for p in ckpt.iterdir()] == ["ckpt.pt"]  # step 6's; no temporary left
    second = _torchrun(ckpt, 9)
    assert sorted(re.findall(r"^rank=(\d) resumed_from_step=6 world_size=2 ", second, re.M)) \
        == ["0", "1"], second
    assert re.findall(r"^step=(\d+)$", second, re.M) == ["7", "8", "9"]
    assert "done step=9" in second
    assert "bluevela" not in (REPO / "examples" / "plain_ddp.py").read_text().split('"""')[2]
