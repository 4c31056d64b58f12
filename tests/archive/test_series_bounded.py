"""The epilog's series side file on a hung spool (issue 24 §3): written by the spool's own
bounded writer (archive/spool.py `run_bounded`), so a spool whose server is gone costs the
epilog 10 s and one error line, never its PrologEpilogTimeout (where Slurm drains the node
outside the breaker). Tested on a genuinely hung mount (tests/fuse_hang.py) in a private mount
namespace, like tests/archive/test_spool_bounded.py does for the report."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bluevela.archive.spool import SpoolTimeoutError
from bluevela.telemetry.window import write_side_file
from tests.fuse_hang import fuse_available
from tests.telemetry.test_telemetry import _write_seg

REPO = Path(__file__).resolve().parents[2]


def _samples(tmp_path: Path, node: str, now: float) -> Path:
    samples = tmp_path / "state" / "samples"
    _write_seg(samples, node, now - 50.0, ["gpu0.util_pct"], [[float(i)] for i in range(6)])
    return samples


def test_bounded_side_file_is_the_same_file(tmp_path: Path) -> None:
    now = time.time()
    samples = _samples(tmp_path, "gpu001", now)
    a = write_side_file(tmp_path / "a", samples, 7, "gpu001", now - 40, now, 10.0)
    b = write_side_file(tmp_path / "b", samples, 7, "gpu001", now - 40, now, 10.0, timeout_s=10)
    assert a is not None and b is not None and a.name == b.name == "7.gpu001.series.bvts"
    assert a.read_bytes() == b.read_bytes() and oct(b.stat().st_mode & 0o777) == "0o644"
    assert sorted(os.listdir(tmp_path / "b")) == [b.name]


def test_bounded_side_file_reports_the_childs_error(tmp_path: Path) -> None:
    now = time.time()
    samples = _samples(tmp_path, "gpu001", now)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(OSError) as err:
        write_side_file(blocker / "spool", samples, 7, "gpu001", now - 40, now, 10.0,
                        timeout_s=10)
    assert err.value.errno in (errno.ENOTDIR, errno.EEXIST), err.value
    assert not isinstance(err.value, SpoolTimeoutError)


# The epilog's step itself (telemetry.window.spool_series with the site's paths), in a child
# of the namespace that holds the hung mount, as the epilog would call it.
STEP = r"""
import json, logging, os, sys, time
sys.path.insert(0, {repo!r})
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
from bluevela.site import load_site
from bluevela.telemetry.window import spool_series
t0 = time.monotonic()
got = spool_series(load_site({site!r}), 4243, "gpu001", {{"time": {start!r}}})
print(json.dumps({{"path": got, "took": time.monotonic() - t0}}), flush=True)
"""

HUNG = r"""
import json, os, subprocess, sys, time
sys.path.insert(0, {repo!r})
from tests.fuse_hang import mount_hung
fd = mount_hung({spool!r})
env = {{"BV_SPOOL_DIR": {spool!r}, "BV_STATE_DIR": {state!r},
       **{{k: v for k, v in os.environ.items() if k == "PYTHONPATH"}}}}
try:
    p = subprocess.run([sys.executable, "-c", {step!r}], env=env, capture_output=True,
                       text=True, timeout=40)
    out = {{"rc": p.returncode, "stdout": p.stdout[-2000:], "stderr": p.stderr[-2000:]}}
except subprocess.TimeoutExpired:
    out = {{"rc": None, "stderr": "hung"}}
print(json.dumps(out), flush=True)
os._exit(0)  # closes the FUSE fd: a writer left behind gets ENOTCONN and ends
"""


@pytest.mark.skipif(not fuse_available() or not shutil.which("unshare"),
                    reason="needs root, /dev/fuse and unshare for a real hung mount")
def test_the_epilogs_series_write_on_a_hung_spool_ends_in_seconds(tmp_path: Path) -> None:
    """The sampler's window of a job (a real segment in the state dir) spooled to a hung
    mount: the step gives up after 10 s with one error line and returns None (the epilog goes
    on to its report); before, it hung until killed (40 s here; in production until
    PrologEpilogTimeout, and Slurm drained the node)."""
    now = time.time()
    _samples(tmp_path, "gpu001", now)
    spool = tmp_path / "spool"
    step = STEP.format(repo=str(REPO), site=str(REPO / "site.yaml"), start=now - 30.0)
    script = HUNG.format(repo=str(REPO), spool=str(spool), state=str(tmp_path / "state"),
                         step=step)
    p = subprocess.run(["unshare", "-m", "--propagation", "private", sys.executable, "-c",
                        script], capture_output=True, text=True, timeout=120, check=False)
    assert p.returncode == 0, p.stderr
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["rc"] == 0, got
    [line] = [ln for ln in got["stderr"].splitlines() if "time series not spooled" in ln]
    assert "job 4243: time series not spooled: " in line, line
    assert f"spool {spool}: no answer in 10 s (a hung file system?)" in line, line
    result = json.loads(got["stdout"].strip().splitlines()[-1])
    assert result["path"] is None and 9.5 <= result["took"] < 20, result
