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

from bluevela.archive.sample import sample_report
from bluevela.archive.spool import SpoolTimeoutError, write_report
from tests.fuse_hang import fuse_available

REPO = Path(__file__).resolve().parent.parent


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
    assert not isinstance(err.value, SpoolTimeoutError)


HUNG = r"""
import json, sys, time
sys.path.insert(0, {repo!r})
from pathlib import Path
from tests.fuse_hang import mount_hung
from bluevela.archive.sample import sample_report
from bluevela.archive.spool import SpoolTimeoutError, write_report
spool = Path({spool!r})
fd = mount_hung(str(spool))
t0 = time.monotonic()
try:
    write_report(spool / "bv", sample_report(7, "n1", "prolog", nodelist=["n1"]), timeout_s=1.0)
    out = "written"
except SpoolTimeoutError as exc:
    out = str(exc)
print(json.dumps({{"out": out, "took": time.monotonic() - t0}}), flush=True)
import os
os._exit(0)
"""


@pytest.mark.skipif(not fuse_available() or not shutil.which("unshare"),
                    reason="needs root, /dev/fuse and unshare for a real hung mount")
def test_a_hung_spool_gives_up_at_the_deadline(tmp_path: Path) -> None:
    script = HUNG.format(repo=str(REPO), spool=str(tmp_path / "spool"))
    # Without the bound this process would hang in the kernel until the test's timeout.
    p = subprocess.run(["unshare", "-m", "--propagation", "private", sys.executable, "-c",
                        script], capture_output=True, text=True, timeout=60, check=False)
    assert p.returncode == 0, p.stderr
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert "no answer in 1 s (a hung file system?)" in got["out"], got
    assert 0.9 < got["took"] < 3.0, got
