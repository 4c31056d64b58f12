"""`bv bench run` on this machine (real CPU measurements, small), and the CLI's error paths."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO


def bv(*args: str, env: dict[str, str] | None = None,
       timeout: float = 180) -> subprocess.CompletedProcess[str]:
    import os

    return subprocess.run([sys.executable, "-m", "bluevela", "--site", str(REPO / "site.yaml"),
                           *args], capture_output=True, text=True, timeout=timeout, check=False,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}, cwd=REPO)


def test_run_gemm_hbm_h2d_on_a_cpu_node(tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    proc = bv("bench", "run", "gemm", "hbm", "h2d", "--class", "cpu", "--budget-s", "0.1",
              "--json", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc == json.loads(out.read_text())
    by = {r["measurement"]: r for r in doc["results"]}
    assert by["gemm"]["status"] == "OK" and by["hbm"]["status"] == "OK"
    assert by["h2d"]["applicable"] is False and by["h2d"]["status"] == "OK"
    head = [f for f in by["gemm"]["facts"]["figures"] if f["size"] == 0 and f["device"] == -1]
    assert head[0]["unit"] == "TFLOP/s" and head[0]["value"] > 0.005


def test_run_allreduce_spawns_local_gloo_ranks() -> None:
    proc = bv("bench", "run", "allreduce", "--class", "cpu", "--budget-s", "0.05", "--json")
    assert proc.returncode == 0, proc.stderr
    facts = json.loads(proc.stdout)["results"][0]["facts"]
    assert facts["note"].startswith("gloo, 2 rank(s)")
    sizes = sorted({f["size"] for f in facts["figures"]})
    assert sizes == [0, 64 << 10, 256 << 10, 1 << 20, 4 << 20]
    busbw = {f["size"]: f["value"] for f in facts["figures"] if f["name"] ==
             "allreduce_busbw_gbs"}
    algbw = {f["size"]: f["value"] for f in facts["figures"] if f["name"] ==
             "allreduce_algbw_gbs"}
    assert busbw[0] == pytest.approx(algbw[0])  # 2 ranks: factor 2(n-1)/n = 1
    assert busbw[0] > 0.01


def test_pair_measurements_alone_could_not_run() -> None:
    proc = bv("bench", "run", "mpi", "allreduce-pair", "--class", "cpu", "--json")
    assert proc.returncode == 3, proc.stderr  # UNKNOWN: never CRITICAL
    by = {r["measurement"]: r for r in json.loads(proc.stdout)["results"]}
    assert "srun -N2" in by["mpi"]["message"] and "srun -N2" in by["allreduce-pair"]["message"]


def test_errors_are_one_line() -> None:
    proc = bv("bench", "run", "nope")
    assert proc.returncode == 2 and "nope" in proc.stderr
    proc = bv("bench", "run", "gemm", "--class", "nosuch")
    assert proc.returncode != 0 and "no node class 'nosuch'" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_report_without_records(tmp_path: Path) -> None:
    proc = bv("bench", "report", "--html", str(tmp_path / "r.html"),
              env={"BV_ARCHIVE_DIR": str(tmp_path)})
    assert proc.returncode == 1 and "no nightly record yet" in proc.stderr
    proc = bv("bench", "report", "--night", "yesterday", "--html", str(tmp_path / "r.html"),
              env={"BV_ARCHIVE_DIR": str(tmp_path)})
    assert proc.returncode == 1 and "not YYYY-MM-DD" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_production_lines_use_valid_options() -> None:
    """The cron, scrontab and sbatch lines in benchmarks/nightly/ parse as `bv bench nightly`."""
    import shlex

    from bluevela.cli.cmd_bench import nightly_cmd

    found = 0
    for path in sorted((REPO / "benchmarks" / "nightly").iterdir()):
        for line in path.read_text().splitlines():
            if line.startswith("#") or "bench nightly" not in line:
                continue
            words = shlex.split(line.split(">>")[0])
            words = [w.replace("${BV_NIGHTLY_PARTITION:-gpu}", "gpu") for w in words]
            start = next(i for i, w in enumerate(words) if w.endswith("/bv"))
            args = words[start + 1:]
            assert args[:4] == ["--site", "/etc/bluevela/site.yaml", "bench", "nightly"], path
            ctx = nightly_cmd.make_context("nightly", args[4:])
            assert ctx.params["wait"] is True and ctx.params["partition"] == "gpu"
            found += 1
    assert found == 3
