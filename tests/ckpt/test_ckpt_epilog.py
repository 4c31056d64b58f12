"""The epilog clears what a job left on the node-local checkpoint tier (bluevela/ckpt/epilog.py):
that job's directory only, for the job's user, never through a link the user planted."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bluevela.ckpt.epilog import clear_for_epilog
from bluevela.ckpt.layout import clear_job
from bluevela.errors import UnsafeValueError
from bluevela.site import load_site
from tests.conftest import REPO


def _tree(local: Path, uid: int, job: str) -> Path:
    d = local / f"bv-{uid}" / f"job-{job}" / "t" / "own" / "step-00000001"
    d.mkdir(parents=True)
    (d / "rank-00000.bvck").write_bytes(b"x" * 100)
    return d


def test_only_the_jobs_directory_goes(tmp_path: Path) -> None:
    uid = os.getuid()
    _tree(tmp_path, uid, "41")
    keep = _tree(tmp_path, uid, "42")
    assert clear_job(tmp_path, "41", uid) is True
    assert not (tmp_path / f"bv-{uid}" / "job-41").exists()
    assert (keep / "rank-00000.bvck").is_file()
    assert clear_job(tmp_path, "41", uid) is False  # nothing left: nothing to do
    assert clear_job(tmp_path, "41", uid + 1) is False


def test_a_planted_link_is_not_followed(tmp_path: Path) -> None:
    uid = os.getuid()
    victim = tmp_path / "victim"
    (victim / "job-7").mkdir(parents=True)
    (victim / "job-7" / "precious").write_text("x")
    local = tmp_path / "local"
    local.mkdir()
    (local / f"bv-{uid}").symlink_to(victim)
    with pytest.raises(UnsafeValueError):
        clear_job(local, "7", uid)
    (local / f"bv-{uid}").unlink()
    (local / f"bv-{uid}").mkdir()
    (local / f"bv-{uid}" / "job-7").symlink_to(victim / "job-7")
    assert clear_job(local, "7", uid) is True  # the link itself goes, not what it names
    assert (victim / "job-7" / "precious").is_file()


def test_epilog_uses_the_node_class_dir_and_the_jobs_uid(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    import dataclasses

    site = load_site(REPO / "site.yaml")
    name = next(iter(site.node_classes))
    cls = site.node_classes[name]
    cls = dataclasses.replace(cls, checkpoint=dataclasses.replace(cls.checkpoint, dir=tmp_path))
    site = dataclasses.replace(site, node_classes={**site.node_classes, name: cls})
    monkeypatch.setenv("BV_NODE_CLASS", name)
    uid = os.getuid()
    _tree(tmp_path, uid, "9")
    assert clear_for_epilog(site, 9, "x", {"SLURM_JOB_UID": "junk"}) is None
    assert (tmp_path / f"bv-{uid}" / "job-9").is_dir()
    line = clear_for_epilog(site, 9, "x", {"SLURM_JOB_UID": str(uid)})
    assert line is not None and "removed job 9's" in line
    assert not (tmp_path / f"bv-{uid}" / "job-9").exists()
    # `%n` in the class's dir: this node's own directory, and no other node's.
    cls = dataclasses.replace(cls, checkpoint=dataclasses.replace(
        cls.checkpoint, dir=tmp_path / "%n"))
    site = dataclasses.replace(site, node_classes={**site.node_classes, name: cls})
    for node in ("n1", "n2"):
        _tree(tmp_path / node, uid, "9")
    assert clear_for_epilog(site, 9, "n2", {"SLURM_JOB_UID": str(uid)}) is not None
    assert (tmp_path / "n1" / f"bv-{uid}" / "job-9").is_dir()
    assert not (tmp_path / "n2" / f"bv-{uid}" / "job-9").exists()
    line = clear_for_epilog(site, 9, "../n1", {"SLURM_JOB_UID": str(uid)})
    assert line is not None and "cannot name a directory" in line
    assert (tmp_path / "n1" / f"bv-{uid}" / "job-9").is_dir()


def test_the_real_epilog_clears_the_jobs_node_local_checkpoints(tmp_path: Path) -> None:
    """`python -m bluevela.hooks epilog` as slurmd runs it (tests/hooks/test_hooks_run.py): the node
    class's checkpoint.dir loses the ended job's directory, keeps another job's."""
    import yaml

    from tests.hooks.test_hooks_run import make_node, run_hook

    data = yaml.safe_load((REPO / "site.yaml").read_text())
    nvme = tmp_path / "nvme"
    data["node_classes"]["h100"]["checkpoint"] = {"dir": str(nvme)}
    site = tmp_path / "site.yaml"
    site.write_text(yaml.safe_dump(data))
    hook_env, _ = make_node(tmp_path, BV_SITE=str(site), BV_CACHE_DIR="off")
    uid = os.getuid()
    _tree(nvme, uid, "4242")
    other = _tree(nvme, uid, "4243")
    p = run_hook("epilog", hook_env, {"SLURMD_NODENAME": "gpu001", "SLURM_JOB_ID": "4242",
                                       "SLURM_JOB_USER": "alice", "SLURM_JOB_UID": str(uid)})
    assert p.returncode == 0, p.stderr
    assert not (nvme / f"bv-{uid}" / "job-4242").exists()
    assert (other / "rank-00000.bvck").is_file()
