"""What torchrun and submitit users expect of `bv submit` (issue 35): a module launch
(`bv submit -m pkg.train`, the job named after the module; `-- -m pkg.train` used to name the
job `-m`), `--procs-per-node gpu` (torchrun's own word, refused before), a per-job `--output`
(refused before: "bv sets it"), and torchrun's per-rank console filter and log files. The
rendering is checked here; the cluster test runs a module job with all of them on the dev
cluster.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from bluevela.errors import LaunchError
from bluevela.launch.submit import build_request
from bluevela.site import load_site
from tests.conftest import REPO, DevCluster

SITE = load_site(REPO / "site.yaml")


def _exec(req: object) -> str:
    return req.materialize().splitlines()[-1]  # type: ignore[attr-defined]


def test_module_launch_and_its_name() -> None:
    req = build_request(SITE, "pkg.train", ("--steps", "5"), module=True)
    assert _exec(req).endswith("--max-restarts=0 -m pkg.train --steps 5")
    assert req.job_name == "pkg.train"
    # the old spelling names the job after the module too, not `-m`
    old = build_request(SITE, "-m", ("pkg.train", "--steps", "5"))
    assert old.job_name == "pkg.train" and _exec(old) == _exec(req)
    with pytest.raises(LaunchError, match="is not a module name"):
        build_request(SITE, "pkg/train.py", module=True)


def test_procs_per_node_gpu() -> None:
    req = build_request(SITE, "t.py", node_class="h100", procs_per_node="gpu")
    assert "--nproc-per-node=gpu " in _exec(req)
    assert build_request(SITE, "t.py", procs_per_node="4").nproc_per_node == 4
    with pytest.raises(LaunchError, match="needs GPUs"):
        build_request(SITE, "t.py", procs_per_node="gpu")
    with pytest.raises(LaunchError, match="is not a number, gpu or auto"):
        build_request(SITE, "t.py", procs_per_node="all")


def test_output_and_rank_logs() -> None:
    req = build_request(SITE, "t.py", output="logs/%x-%j.out", local_ranks_filter="0",
                        rank_log_dir="rank logs")
    assert "#SBATCH --output=logs/%x-%j.out" in req.materialize().splitlines()
    assert "--local-ranks-filter=0 '--log-dir=rank logs' --tee=3 t.py" in _exec(req)
    with pytest.raises(LaunchError, match="control character"):
        build_request(SITE, "t.py", output="x\n#SBATCH --uid=0")
    with pytest.raises(LaunchError, match="not a list of local ranks"):
        build_request(SITE, "t.py", local_ranks_filter="0;rm")


def test_an_output_directory_that_does_not_exist_is_refused(tmp_path: Path) -> None:
    """sbatch does not create it: the job would fail with no output file at all."""
    import os
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "bluevela", "submit", "--no-python-check",
                           "-o", "logs/%j.out", "t.py"], capture_output=True, text=True,
                          cwd=tmp_path, timeout=60, check=False,
                          env={**os.environ, "BV_SITE": str(REPO / "site.yaml")})
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines()[-1].startswith(
        "bv: error: --output logs/%j.out: the directory logs does not exist")


@pytest.mark.cluster
def test_a_module_job_with_output_and_rank_logs(devcluster: DevCluster, tmp_path: Path) -> None:
    """`bv submit -m pkg.train` on 2 nodes x 2 ranks: the job is named pkg.train, its output goes
    where --output says, only local rank 0 of each node reaches it, and every rank's output is
    in a file of its own under --rank-log-dir."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "train.py").write_bytes((REPO / "examples" / "train_ddp.py").read_bytes())
    (tmp_path / "out").mkdir()
    proc = devcluster.bv("submit", "--wait", "-N", "2", "--procs-per-node", "2", "-m",
                         "-o", "out/%x-%j.log", "--local-ranks-filter", "0",
                         "--rank-log-dir", str(tmp_path / "ranks"), "pkg.train", "--steps", "10",
                         cwd=tmp_path, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job = re.search(r"Job (\d+) COMPLETED", proc.stdout)
    assert job, proc.stdout
    out = (tmp_path / "out" / f"pkg.train-{job[1]}.log").read_text()
    # with --tee torchrun prefixes each console line with its rank: `[default0]:`
    shown = sorted(int(r) for r in re.findall(r"^\[default0\]:rank=(\d+) world_size=4 ", out,
                                              re.M))
    assert shown == [0, 2], out  # local rank 0 of each node: global ranks 0 and 2
    assert not re.search(r"^\[default1\]:", out, re.M)
    logs = list((tmp_path / "ranks").rglob("stdout.log"))
    assert len(logs) == 4, logs
    ranks = sorted(int(m[1]) for f in logs for m in re.finditer(r"^rank=(\d+) ", f.read_text(),
                                                                 re.M))
    assert ranks == [0, 1, 2, 3]


def test_a_site_default_class_and_the_no_gpu_note(tmp_path: Path) -> None:
    """The README's `bv submit -N 2 lightning_train.py` asked for no GPU: site.yaml
    launch.default_class gives such a job its class's GPUs; on a site where every class has
    GPUs, a job that still asks for none gets a note."""
    from bluevela.site_file import parse_site

    text = (REPO / "site.yaml").read_text()
    with_default = parse_site(text.replace("launch:\n", "launch:\n  default_class: h100\n", 1),
                              tmp_path / "a.yaml")
    req = build_request(with_default, "train.py", nodes=2)
    assert req.gpus_per_node == 8 and req.nproc_per_node == 8
    assert build_request(with_default, "train.py", gpus_per_node=0).gpus_per_node == 0
    assert build_request(with_default, "train.py", node_class="cpu").gpus_per_node == 0
    gpu_only = text[:text.index("  cpu:\n")] + text[text.index("  h100:\n"):]
    notes: list[str] = []
    build_request(parse_site(gpu_only, tmp_path / "b.yaml"), "train.py", notes=notes)
    assert notes == ["the job asks for no GPUs (one process per node): give --class or "
                     "--gpus-per-node (site.yaml launch.default_class sets a default)"]
    notes.clear()
    build_request(SITE, "train.py", notes=notes)  # the dev site has a CPU class: no note
    assert notes == []
    from bluevela.errors import SiteConfigError

    with pytest.raises(SiteConfigError, match="launch.default_class 'h200' is not a node class"):
        parse_site(text.replace("launch:\n", "launch:\n  default_class: h200\n", 1),
                   tmp_path / "c.yaml")


def test_site_declared_spank_options_pass_through(tmp_path: Path) -> None:
    """pyxis' --container-image was refused as "not an sbatch option"; a site that lists its
    SPANK plugins' options (launch.spank_options) lets them through --sbatch-arg, quoted for
    sbatch's parser; an option bv sets itself stays refused even when listed."""
    from bluevela.site_file import parse_site

    text = (REPO / "site.yaml").read_text().replace(
        "launch:\n", "launch:\n  spank_options: [container-image, container-mounts, output]\n", 1)
    site = parse_site(text, tmp_path / "site.yaml")
    req = build_request(site, "t.py", sbatch_args=(
        "--container-image=nvcr.io#nvidia/pytorch:24.01-py3",
        "--container-mounts=/shared:/shared"))
    lines = req.materialize().splitlines()
    assert "#SBATCH --container-image='nvcr.io#nvidia/pytorch:24.01-py3'" in lines
    assert "#SBATCH --container-mounts=/shared:/shared" in lines
    with pytest.raises(LaunchError, match="bv sets it"):
        build_request(site, "t.py", sbatch_args=("--output=/etc/x",))
    with pytest.raises(LaunchError, match="must be listed in site.yaml launch.spank_options"):
        build_request(SITE, "t.py", sbatch_args=("--container-image=x",))
    with pytest.raises(LaunchError, match="control character"):
        build_request(site, "t.py", sbatch_args=("--container-image=x\n#SBATCH --uid=0",))
    from bluevela.errors import SiteConfigError

    with pytest.raises(SiteConfigError, match="not a long option name"):
        parse_site(text.replace("[container-image,", "['--container-image',", 1),
                   tmp_path / "bad.yaml")
