"""`#SBATCH` values through REAL sbatch on the dev cluster (issue 9, item 6).

sbatch's own `#SBATCH` parser is not a shell (a backslash escapes even inside single quotes),
so a value that `--dry-run` renders must also be what sbatch reads back. Every hostile value is
either refused up front by `bv submit` with one line, or accepted by `sbatch --test-only` AND
arrives byte-exact in a real (held) job as its name and comment, read back from
`squeue --json`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bluevela.errors import LaunchError
from bluevela.launch.submit import build_request
from tests.conftest import HOSTILE, DevCluster

pytestmark = [pytest.mark.cluster]

# HOSTILE plus what broke sbatch's parser (`x\`), its other escapes, and what sbatch might
# otherwise treat specially (leading dashes, `%` patterns, het-job separators, non-ASCII).
VALUES = [
    *HOSTILE,
    "x\\", "\\'", "'", '"', "a\\\\b", "\\#x", "'\"mixed\\", " lead", "trail ", "",
    "--hold", "%j %x %%", "a=b,c", "my hetjob x", "é ü 日本",
]
# Refused up front: a newline would forge an #SBATCH line, other control characters are not text.
REFUSED = ["a\nb", "nul\0", "esc\x1b[31m", "cr\r"]


def _submit_held(cluster: DevCluster, value: str, cwd: Path) -> dict[str, object] | str:
    """The job's squeue record (held, then cancelled), or the refusal line."""
    try:
        req = build_request(None, "t.py", job_name=value, comment=value, hold=True)
    except LaunchError as exc:
        return str(exc)
    script = cwd / "job.sh"
    script.write_text(req.materialize())
    test = cluster.run(["sbatch", "--test-only", str(script)], check=False, cwd=cwd)
    assert test.returncode == 0, f"sbatch --test-only refused {value!r}: {test.stderr}"
    job_id = int(cluster.run(["sbatch", "--parsable", str(script)], cwd=cwd)
                 .stdout.strip().split(";")[0])
    try:
        jobs = json.loads(cluster.run(["squeue", "--all", "--json"]).stdout)["jobs"]
    finally:
        cluster.run(["scancel", str(job_id)], check=False)
    (job,) = [j for j in jobs if j["job_id"] == job_id]
    return job  # type: ignore[no-any-return]


@pytest.mark.parametrize("value", VALUES, ids=[repr(v) for v in VALUES])
def test_value_reaches_the_job_byte_exact(devcluster: DevCluster, tmp_path: Path,
                                          value: str) -> None:
    job = _submit_held(devcluster, value, tmp_path)
    assert isinstance(job, dict), f"refused {value!r}: {job}"
    assert job["name"] == value and job["comment"] == value, (job["name"], job["comment"])


@pytest.mark.parametrize("value", REFUSED, ids=[repr(v) for v in REFUSED])
def test_unsafe_value_is_refused_with_one_line(devcluster: DevCluster, tmp_path: Path,
                                               value: str) -> None:
    refusal = _submit_held(devcluster, value, tmp_path)
    assert isinstance(refusal, str) and "\n" not in refusal and "control character" in refusal
    if "\0" in value:
        return  # no argv can carry a NUL
    proc = devcluster.bv("submit", "--hold", "-J", value, "t.py", check=False, cwd=tmp_path)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert len(proc.stderr.splitlines()) == 1, proc.stderr


def test_bv_submit_with_a_trailing_backslash(devcluster: DevCluster, tmp_path: Path) -> None:
    """The issue's case end to end: `bv submit -J 'x\\'` (old: --dry-run passed, sbatch failed
    with "Unmatched `'`")."""
    proc = devcluster.bv("submit", "--hold", "--json", "-J", "x\\", "--comment", "c\\",
                         "t.py", cwd=tmp_path)
    job_id = json.loads(proc.stdout)["job_id"]
    try:
        jobs = json.loads(devcluster.run(["squeue", "--all", "--json"]).stdout)["jobs"]
    finally:
        devcluster.run(["scancel", str(job_id)], check=False)
    (job,) = [j for j in jobs if j["job_id"] == job_id]
    assert job["name"] == "x\\" and job["comment"] == "c\\"
