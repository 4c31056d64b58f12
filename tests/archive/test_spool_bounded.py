"""A hung spool costs the prolog seconds, not PrologEpilogTimeout (issue 24 §3): the hooks'
`write_report(..., timeout_s=...)` writes in a child and gives up at the deadline. Tested on a
genuinely hung mount (tests/fuse_hang.py: a FUSE file system whose daemon never answers, as an
NFS spool whose server is gone) in a private mount namespace, and on real errors."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bluevela.archive import spool as spool_mod
from bluevela.archive.sample import sample_report
from bluevela.archive.spool import write_report
from tests.fuse_hang import fuse_available
from tests.hooks.test_hooks_run import make_node

REPO = Path(__file__).resolve().parents[2]


def test_bounded_write_is_the_same_file(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    report = sample_report(7, "n1", "prolog", nodelist=["n1"], time=1.0)
    pa = write_report(a, report)
    pb = write_report(b, report, timeout_s=10)
    assert pa.name == pb.name and pa.read_bytes() == pb.read_bytes()
    assert oct(pb.stat().st_mode & 0o777) == "0o644" and sorted(os.listdir(b)) == [pb.name]


def test_bounded_write_reports_the_childs_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(OSError) as err:
        write_report(blocker / "spool", sample_report(7, "n1", "prolog", nodelist=["n1"]),
                     timeout_s=10)
    assert err.value.errno in (errno.ENOTDIR, errno.EEXIST), err.value
    assert not isinstance(err.value, spool_mod.SpoolTimeoutError)


HUNG = r"""
import json, os, subprocess, sys, time
sys.path.insert(0, {repo!r})
from tests.fuse_hang import mount_hung
fd = mount_hung({spool!r})
t0 = time.monotonic()
try:
    p = subprocess.run([sys.executable, "-m", "bluevela.hooks", "prolog"],
                       env={{"BV_HOOK_ENV": {hook_env!r}, "SLURMD_NODENAME": "gpu001",
                            "SLURM_JOB_ID": "4243", "SLURM_JOB_USER": "alice",
                            # only where the test run sets it (a worktree of an old commit)
                            **{{k: v for k, v in os.environ.items() if k == "PYTHONPATH"}}}},
                       capture_output=True, text=True, timeout=45)
    out = {{"rc": p.returncode, "stderr": p.stderr[-2000:]}}
except subprocess.TimeoutExpired:
    out = {{"rc": None, "stderr": "hung"}}
out["took"] = time.monotonic() - t0
print(json.dumps(out), flush=True)
os._exit(0)  # closes the FUSE fd: a writer left behind gets ENOTCONN and ends
"""


@pytest.mark.skipif(not fuse_available() or not shutil.which("unshare"),
                    reason="needs root, /dev/fuse and unshare for a real hung mount")
def test_the_prolog_on_a_hung_spool_ends_in_seconds(tmp_path: Path) -> None:
    """The real prolog (healthy fixture node) whose spool is a hung mount: it ends with exit 0
    and one line saying it could not spool, about 10 s later; 9058adc hung until killed (45 s
    here; in production until PrologEpilogTimeout, and Slurm drained the node)."""
    hook_env, base = make_node(tmp_path)
    spool = base / "spool"
    script = HUNG.format(repo=str(REPO), spool=str(spool), hook_env=str(hook_env))
    p = subprocess.run(["unshare", "-m", "--propagation", "private", sys.executable, "-c",
                        script], capture_output=True, text=True, timeout=120, check=False)
    assert p.returncode == 0, p.stderr
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["rc"] == 0, got
    assert "could not spool the prolog report of job 4243" in got["stderr"], got
    assert "no answer in 10 s" in got["stderr"], got
    assert got["took"] < 30, got
