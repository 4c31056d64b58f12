"""The nightly's batch scripts: golden files, quoting of hostile values, refused values.

Regenerate the golden files after an intended change with
`BV_REGEN_GOLDEN=1 python -m pytest tests/bench/test_bench_request.py`.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from bluevela.bench.nightly import NightlyOptions, node_job, pair_job
from bluevela.errors import LaunchError
from bluevela.launch.bench_job import BenchJobRequest, BenchStep
from bluevela.site import Site, load_site
from tests.conftest import DATA, HOSTILE, REPO

GOLDEN = DATA / "bench"
WORKDIR = Path("/var/lib/bluevela/archive/nightly/runs/2026-11-20/010000-4242")


def _site() -> Site:
    # A fixed source path: the golden files must not depend on where the repo is checked out.
    site = load_site(REPO / "site.yaml")
    site.__dict__["_source"] = Path("/etc/bluevela/site.yaml")  # bookkeeping, not a field
    return site


OPTS = NightlyOptions(partition="debug", night="2026-11-20", python="/opt/bluevela/bin/python3")


def _check_golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if os.environ.get("BV_REGEN_GOLDEN"):
        path.write_text(text)
    assert text == path.read_text(), f"{name} changed; regenerate: BV_REGEN_GOLDEN=1 pytest {__file__}"


@pytest.mark.parametrize(("cls", "nodes"), [("cpu", ("node1", "node3")),
                                            ("h100", ("gpu001", "gpu002"))])
def test_golden_scripts(cls: str, nodes: tuple[str, str]) -> None:
    site = _site()
    req, job = node_job(site, nodes[0], cls, WORKDIR, OPTS)
    _check_golden(f"golden_node_job_{cls}.sh", req.materialize())
    assert job.files["node"] == WORKDIR / f"{nodes[0]}.json"
    req, job = pair_job(site, nodes, cls, WORKDIR, OPTS, round_no=2)
    _check_golden(f"golden_pair_job_{cls}.sh", req.materialize())
    assert set(job.files) == {"allreduce-pair", "mpi"}


def test_script_is_deterministic_and_sorted() -> None:
    req, _ = pair_job(_site(), ("node1", "node2"), "cpu", WORKDIR, OPTS, 1)
    text = req.materialize()
    assert text == req.materialize()
    sbatch = [line for line in text.splitlines() if line.startswith("#SBATCH")]
    assert sbatch == sorted(sbatch)
    assert "#SBATCH --exclusive" in sbatch and "#SBATCH --nodelist=node1,node2" in sbatch
    assert "--mpi=pmix" in text


def _fake_srun(tmp_path: Path) -> Path:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    fake = bindir / "srun"
    fake.write_text('#!/bin/bash\nprintf "%s\\0" "$@" >> "$BV_FAKE_SRUN_LOG"\n')
    fake.chmod(0o755)
    return bindir


def test_hostile_words_reach_the_program_verbatim(tmp_path: Path) -> None:
    """Every hostile value is one argv word after the shell read the script; nothing ran."""
    argv = ("/opt/py", "-m", "bluevela.bench.worker", *HOSTILE)
    req = BenchJobRequest(steps=(BenchStep(argv, whole_node=True),), nodelist=("node1",),
                          job_name=HOSTILE[0], comment=HOSTILE[3], chdir=str(tmp_path),
                          env=(("BV_X", HOSTILE[2]),))
    script = tmp_path / "job.sh"
    script.write_text(req.materialize())
    log = tmp_path / "srun.log"
    env = {**os.environ, "PATH": f"{_fake_srun(tmp_path)}:{os.environ['PATH']}",
           "BV_FAKE_SRUN_LOG": str(log), "SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "node1",
           "SLURM_CPUS_ON_NODE": "2"}
    for marker in ("/tmp/bv-pwned-semicolon", "/tmp/bv-pwned-subst", "/tmp/bv-pwned-backtick"):
        Path(marker).unlink(missing_ok=True)
    proc = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True,
                          timeout=30, check=False)
    assert proc.returncode == 0, proc.stderr
    words = log.read_text().split("\0")[:-1]
    assert words[-len(argv):] == list(argv)
    assert "--cpus-per-task=2" in words
    for marker in ("/tmp/bv-pwned-semicolon", "/tmp/bv-pwned-subst", "/tmp/bv-pwned-backtick"):
        assert not Path(marker).exists()


@pytest.mark.parametrize("bad", ["a\nb", "x\0y", "line\r"])
def test_control_characters_are_refused(bad: str) -> None:
    with pytest.raises(LaunchError):
        BenchJobRequest(steps=(BenchStep(("/py", bad)),), nodelist=("node1",))
    with pytest.raises(LaunchError):
        BenchJobRequest(steps=(BenchStep(("/py",)),), nodelist=("node1",), comment=bad)


@pytest.mark.parametrize("kwargs", [
    {"nodelist": ("node1", "../x")}, {"nodelist": ("node1", "node1")}, {"nodelist": ()},
    {"partition": "a b"}, {"time": "soon"}, {"env": (("1BAD", "x"),)},
])
def test_bad_values_are_refused(kwargs: dict[str, object]) -> None:
    base: dict[str, object] = {"steps": (BenchStep(("/py",)),), "nodelist": ("node1",)}
    with pytest.raises(LaunchError):
        BenchJobRequest(**{**base, **kwargs})  # type: ignore[arg-type]
    with pytest.raises(LaunchError, match="wants 2 nodes"):
        BenchJobRequest(steps=(BenchStep(("/py",), nodes=2),), nodelist=("node1",))
    with pytest.raises(LaunchError, match="plain name"):
        BenchStep(("/py",), mpi="pmix;x").validate()


# -- the pair step's rendezvous port (issue 33 §2) ------------------------------------------

SRUN_ENV = {"SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": "1", "SLURM_LOCALID": "0",
            "SLURM_STEP_NODELIST": "node[1,3]", "SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0"}


def test_an_srun_step_meets_on_the_port_its_script_drew_never_one_from_the_job_id() -> None:
    """Until issue 33 the ranks met on 29600 + (job id * 8 + step) % 2000: anyone who read the
    public job id could bind it first on the first node (rank 0 then failed and the others
    joined the squatter). Now the port comes from BV_BENCH_PORT, and a step without it is a
    measurement that could not run, said, never a derived port."""
    from bluevela.bench.dist import from_environment
    from bluevela.errors import BenchError

    env = from_environment({**SRUN_ENV, "BV_BENCH_PORT": "41017"})
    assert env is not None and (env.rank, env.world, env.master_addr, env.master_port) == (
        1, 2, "node1", 41017)
    for bad in (None, "", "0", "70000", "29600; id"):
        with pytest.raises(BenchError, match="no rendezvous port for this srun step"):
            from_environment({**SRUN_ENV, **({} if bad is None else {"BV_BENCH_PORT": bad})})


def test_the_pair_script_draws_a_fresh_port_on_the_first_node_for_the_step(
        tmp_path: Path) -> None:
    """The pair job's allreduce step, run by bash as Slurm runs the batch script, with a
    stand-in srun that records what the ranks would get: a port the kernel picked on this
    (the batch, the step's first) node, free, different for each draw; the MPI step gets none."""
    import socket
    import sys

    req, _ = pair_job(_site(), ("node1", "node3"), "cpu", WORKDIR, OPTS, 1)
    steps = [line for line in req.materialize().splitlines() if "srun " in line]
    assert [("BV_BENCH_PORT=" in s) for s in steps] == [True, False]
    srun = tmp_path / "srun"
    srun.write_text('#!/bin/sh\necho "${BV_BENCH_PORT:-none}" >> "$BV_TEST_OUT"\n')
    srun.chmod(0o755)
    script = "\n".join(s.replace("/opt/bluevela/bin/python3", sys.executable) for s in steps)
    out = tmp_path / "ports"
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}", "BV_TEST_OUT": str(out),
           "PYTHONPATH": str(REPO)}
    for _ in range(3):
        subprocess.run(["bash", "-c", "rc=0\n" + script], env=env, check=True, timeout=60)
    lines = out.read_text().split()
    drawn = lines[0::2]
    assert lines[1::2] == ["none"] * 3  # the MPI step meets through PMIx, not on a port
    assert all(p.isdigit() and 1024 <= int(p) <= 65535 for p in drawn), drawn
    assert len(set(drawn)) == 3, drawn
    assert 29600 + (4242 * 8) % 2000 not in {int(p) for p in drawn}
    with socket.socket() as probe:  # free on this node right after the draw
        probe.bind(("", int(drawn[-1])))
