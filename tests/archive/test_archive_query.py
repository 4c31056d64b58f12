"""Query and export: ls/show/node/export/verify through the CLI and the Python API, h5dump,
and the lazy imports of `bv archive --help`."""

from __future__ import annotations

import csv
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bluevela.archive import query
from bluevela.archive.ingest import ingest
from bluevela.archive.sample import GPU_TELEMETRY, sample_report
from bluevela.archive.spool import write_report
from bluevela.errors import ArchiveError

REPO = Path(__file__).resolve().parents[2]
DAY = 86400.0
T0 = 1_750_000_000.0  # 2025-06-15T15:06:40Z


@pytest.fixture(scope="module")
def archive(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Three jobs: 1 (alice, n1-n2, day 0), 2 (bob, n2-n3, day 1, exit 3, n3 CRITICAL),
    3 (alice, n1, day 2, n1's epilog never came: archived on timeout)."""
    root = tmp_path_factory.mktemp("archive")
    spool, archive = root / "spool", root / "archive"
    spool.mkdir()
    archive.mkdir()
    for job, nodes, user, day, code in ((1, ["n1", "n2"], "alice", 0, 0),
                                        (2, ["n2", "n3"], "bob", 1, 3)):
        for n in nodes:
            for phase in ("prolog", "epilog"):
                status = 2 if (job == 2 and n == "n3" and phase == "epilog") else 0
                write_report(spool, sample_report(job, n, phase, nodelist=nodes, user=user,
                                                  time=T0 + day * DAY, exit_code=code,
                                                  status_code=status))
        ingest(spool, archive, now=T0 + day * DAY + 1)
    write_report(spool, sample_report(3, "n1", "prolog", nodelist=["n1"], time=T0 + 2 * DAY))
    ingest(spool, archive, now=T0 + 10 * DAY)
    return spool, archive


def bv(*args: str, archive: Path, spool: Path | None = None
       ) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "BV_ARCHIVE_DIR": str(archive)}
    env["BV_SPOOL_DIR"] = str(spool or archive.parent / "spool")
    return subprocess.run([sys.executable, "-m", "bluevela", "archive", *args],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=120,
                          check=False)


def test_ls_filters(archive: tuple[Path, Path]) -> None:
    _, arch = archive
    assert [j["job_id"] for j in query.list_jobs(arch)] == [1, 2, 3]
    assert [j["job_id"] for j in query.list_jobs(arch, user="alice")] == [1, 3]
    assert [j["job_id"] for j in query.list_jobs(arch, node="n3")] == [2]
    assert [j["job_id"] for j in query.list_jobs(arch, since=T0 + DAY - 1)] == [2, 3]
    assert query.list_jobs(arch, user="nobody") == []
    out = json.loads(bv("ls", "--json", "--node", "n2", archive=arch).stdout)
    assert [(j["job_id"], j["nodes"], j["exit_code"]) for j in out] == \
        [(1, "n[1-2]", 0), (2, "n[2-3]", 3)]
    assert out[0]["archive_file"].endswith(".h5") and Path(out[0]["archive_file"]).exists()
    text = bv("ls", "--since", "2025-06-16T16:00:00+00:00", archive=arch).stdout.splitlines()
    assert text[0].split("\t")[0] == "JOBID" and [t.split("\t")[0] for t in text[1:]] == ["3"]


def test_show_json_lists_nodes_health_exit_and_the_file(archive: tuple[Path, Path]) -> None:
    _, arch = archive
    proc = bv("show", "2", "--json", archive=arch)
    assert proc.returncode == 0, proc.stderr
    job = json.loads(proc.stdout)
    assert job["job_id"] == 2 and job["user"] == "bob" and job["exit_code"] == 3
    assert job["health_worst"] == "CRITICAL" and job["completion"] == "all_reported"
    assert Path(job["archive_file"]).is_file()
    assert [n["node"] for n in job["nodes"]] == ["n2", "n3"]
    for n in job["nodes"]:
        for phase in ("prolog", "epilog"):
            rep = n[phase]
            assert [c["name"] for c in rep["health"]["checks"]] == ["gpu", "ib", "node"]
        assert n["epilog"]["exit_code"] == 3
        assert set(n["epilog"]["telemetry"]) == set(GPU_TELEMETRY)
    n3 = job["nodes"][1]["epilog"]
    assert n3["health"]["status"] == "CRITICAL" and n3["health"]["checks"][0]["status"] == "CRITICAL"
    expected = sample_report(2, "n3", "epilog", exit_code=3, status_code=2)
    assert n3["telemetry"] == expected["telemetry"]
    assert n3["health"]["checks"][0]["metrics"] == expected["health"]["checks"][0]["metrics"]
    assert n3["health"]["checks"][0]["summary"] == expected["health"]["checks"][0]["summary"]
    human = bv("show", "2", archive=arch).stdout
    assert "CRITICAL" in human and "n3" in human and job["archive_file"] in human


def test_show_of_a_timed_out_job_and_of_an_unknown_one(archive: tuple[Path, Path]) -> None:
    spool, arch = archive
    job = query.show_job(arch, 3)
    assert job["completion"] == "timeout" and job["missing_nodes"] == ["n1"]
    assert job["nodes"][0]["epilog"] is None and job["nodes"][0]["prolog"] is not None
    proc = bv("show", "99", archive=arch)
    assert proc.returncode == 1
    assert proc.stderr == f"bv: error: job 99 is not in the archive {arch}\n"


def test_node_history(archive: tuple[Path, Path]) -> None:
    _, arch = archive
    hist = query.node_history(arch, "n2")
    assert [(h["job_id"], h["phase"]) for h in hist] == \
        [(1, "prolog"), (1, "epilog"), (2, "prolog"), (2, "epilog")]
    assert hist[3]["exit_code"] == 3 and hist[3]["telemetry"]["gpu_energy_j"] >= 0
    assert [h["job_id"] for h in query.node_history(arch, "n2", since=T0 + DAY)] == [2, 2]
    assert query.node_history(arch, "n9") == []
    out = json.loads(bv("node", "n1", "--json", archive=arch).stdout)
    assert [(h["job_id"], h["phase"]) for h in out] == [(1, "prolog"), (1, "epilog"),
                                                        (3, "prolog")]
    proc = bv("node", "../n1", archive=arch)
    assert proc.returncode == 2 and "unsafe node name" in proc.stderr


def test_export_csv_and_json(archive: tuple[Path, Path], tmp_path: Path) -> None:
    _, arch = archive
    out = tmp_path / "x.csv"
    assert bv("export", "--format", "csv", "--out", str(out), archive=arch).returncode == 0
    rows = list(csv.DictReader(io.StringIO(out.read_text())))
    assert len(rows) == 9
    r = next(r for r in rows if (r["job_id"], r["node"], r["phase"]) == ("2", "n3", "epilog"))
    assert r["user"] == "bob" and r["exit_code"] == "3" and r["check.gpu.status"] == "CRITICAL"
    assert float(r["telemetry.gpu_energy_j"]) == \
        sample_report(2, "n3", "epilog")["telemetry"]["gpu_energy_j"]
    data = json.loads(bv("export", "--format", "json", "--since", str(T0 + DAY),
                         archive=arch).stdout)
    assert sorted((d["job_id"], d["node"], d["phase"]) for d in data) == \
        [(2, "n2", "epilog"), (2, "n2", "prolog"), (2, "n3", "epilog"), (2, "n3", "prolog"),
         (3, "n1", "prolog")]
    recs = query.records(arch)
    assert len(recs) == 9
    assert all({"job_id", "node", "phase", "time_utc"} <= set(r) for r in recs)
    assert all("telemetry.gpu_energy_j" in r for r in recs if r["phase"] == "epilog")


def test_verify_ok(archive: tuple[Path, Path]) -> None:
    _, arch = archive
    proc = bv("verify", archive=arch)
    assert proc.returncode == 0 and proc.stdout.startswith("archive OK: ")
    res = json.loads(bv("verify", "--json", archive=arch).stdout)
    assert res["ok"] and res["reports"] == 9 and res["jobs"] == 3


def test_missing_archive_dir_is_one_line(tmp_path: Path) -> None:
    for args in (["ls"], ["show", "1"], ["node", "n1"], ["verify"], ["ingest"]):
        proc = bv(*args, archive=tmp_path / "none", spool=tmp_path)
        assert proc.returncode == 1, args
        assert proc.stderr.count("\n") == 1 and "does not exist" in proc.stderr


def test_bad_since_is_one_line(archive: tuple[Path, Path]) -> None:
    proc = bv("ls", "--since", "last tuesday", archive=archive[1])
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1 and "--since" in proc.stderr
    assert query.parse_since("2d", now=10 * DAY) == 8 * DAY
    assert query.parse_since("2025-06-15T15:06:40Z") == T0


@pytest.mark.skipif(shutil.which("h5dump") is None, reason="h5dump (apt hdf5-tools) missing")
def test_h5dump_reads_an_archive_file(archive: tuple[Path, Path]) -> None:
    _, arch = archive
    path = query.show_job(arch, 2)["archive_file"]
    proc = subprocess.run(["h5dump", "-d", "/reports", path], capture_output=True, text=True,
                          check=False, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert '"epilog"' in proc.stdout and '"n3"' in proc.stdout and "CRITICAL" in proc.stdout
    header = subprocess.run(["h5dump", "-H", path], capture_output=True, text=True, check=True)
    for name in ("jobs", "job_nodes", "reports", "checks", "check_metrics", "telemetry",
                 "nodes", "job_reports", "job_ids", "schema_version"):
        assert f'"{name}"' in header.stdout


@pytest.mark.parametrize("sub", [[], ["ingest"], ["ls"], ["show"], ["node"], ["export"],
                                 ["verify"]])
def test_help_works_and_imports_no_heavy_module(sub: list[str]) -> None:
    code = ("import sys\nfrom bluevela.cli import cli\n"
            f"try:\n    cli.main(args=['archive', *{sub!r}, '--help'], prog_name='bv')\n"
            "except SystemExit as e:\n    assert e.code == 0, e.code\n"
            "heavy = [m for m in ('h5py', 'numpy', 'torch', 'pydantic') if m in sys.modules]\n"
            "assert not heavy, heavy\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=REPO, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "Usage: bv archive" in proc.stdout


def test_query_api_raises_archive_errors(tmp_path: Path) -> None:
    with pytest.raises(ArchiveError):
        query.list_jobs(tmp_path / "nope")
    with pytest.raises(ArchiveError):
        query.verify(tmp_path / "nope")
