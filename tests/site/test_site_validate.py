"""`bv site validate --cluster` (issue 24 §2): the checks of bluevela.site_checks on recorded
Slurm output (tests/data/slurm/show-config-22.05.txt: `scontrol show config` of the dev
cluster, Slurm 22.05.8), real directories (owner, mode, mount from /proc/self/mountinfo) and
the shipped slurm/hooks.conf. The same command against the live dev cluster is in
tests/site/test_site_validate_cluster.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bluevela.health.result import Status
from bluevela.site import load_site
from bluevela.site_checks import (
    DirFacts,
    Mount,
    SiteFacts,
    check_directory,
    check_node_classes,
    dir_facts,
    evaluate,
    merged_lines,
    mount_of,
    parse_config,
    parse_hooks_conf,
)

REPO = Path(__file__).resolve().parents[2]
CONFIG = parse_config((REPO / "tests/data/slurm/show-config-22.05.txt").read_text())
HOOKS = parse_hooks_conf((REPO / "slurm/hooks.conf").read_text())
# Two lines of a real /proc/self/mountinfo (a Debian 12 NFS client), fields as the kernel
# writes them: the spool's mount is the longest mount point that prefixes the path.
MOUNTINFO = (
    "29 1 259:2 / / rw,relatime shared:1 - ext4 /dev/nvme0n1p2 rw,errors=remount-ro\n"
    "112 29 0:52 / /var/spool/bluevela rw,relatime shared:60 - nfs4 "
    "fs1:/export/bvspool rw,vers=4.2,rsize=1048576,wsize=1048576,sec=sys\n"
)


def test_hooks_conf_ships_only_additions_each_explained() -> None:
    text = (REPO / "slurm/hooks.conf").read_text()
    keys = [k for k, _ in HOOKS]
    assert keys == ["PrologFlags", "Prolog", "Epilog", "PrologEpilogTimeout",
                    "SchedulerParameters", "HealthCheckProgram", "HealthCheckInterval",
                    "HealthCheckNodeState"]
    for gone in ("JobRequeue", "ReturnToService", "MessageTimeout"):
        assert f"\n{gone}=" not in text
    # Every setting sits under a comment that explains it; the flag lines say "ADD".
    for block in text.split("\n\n"):
        settings = [ln for ln in block.splitlines() if ln and not ln.startswith("#")]
        if settings:
            assert block.startswith("#") and len(block.splitlines()) > len(settings), block
    for key in ("PrologFlags", "SchedulerParameters", "HealthCheckNodeState"):
        block = text[:text.index(f"\n{key}=")].rsplit("\n\n", 1)[-1]
        assert "ADD" in block and "existing" in block, key


def test_merged_lines_keep_the_sites_own_flags() -> None:
    site_conf = {**CONFIG, "PrologFlags": "Contain,X11",
                 "SchedulerParameters": "bf_continue,bf_window=4320",
                 "HealthCheckNodeState": "ANY", "PrologEpilogTimeout": "600",
                 "HealthCheckInterval": "300 sec"}
    got = dict(merged_lines(HOOKS, site_conf))
    assert got["PrologFlags=Contain,X11,Alloc"] is False
    assert got["SchedulerParameters=bf_continue,bf_window=4320,nohold_on_prolog_fail"] is False
    assert got["HealthCheckNodeState=ANY,IDLE,CYCLE"] is False
    assert got["PrologEpilogTimeout=600"] is True  # a larger timeout of the site's is kept
    assert got["HealthCheckInterval=300"] is True  # the interval is the site's choice
    # The dev cluster's recorded config already has the flags bv needs.
    dev = dict(merged_lines(HOOKS, CONFIG))
    assert dev["PrologFlags=Alloc"] is True
    assert dev["SchedulerParameters=nohold_on_prolog_fail,sched_interval=5,bf_interval=5,"
               "permit_job_expansion"] is True
    assert dev["Prolog=/opt/bluevela/prolog_epilog/prolog"] is False  # a checkout's path there
    # Too short a timeout is raised to bv's; no config: bv's lines, none known in place.
    assert ("PrologEpilogTimeout=300", False) in merged_lines(HOOKS, {"PrologEpilogTimeout": "60"})
    assert all(not ok for _, ok in merged_lines(HOOKS, None))


def test_every_node_in_sinfo_needs_a_class() -> None:
    site = load_site(REPO / "site.yaml")
    classes = {n: nc.hostnames for n, nc in site.node_classes.items()}
    ok = check_node_classes(SiteFacts(classes, ("node1", "node2", "gpu017")))
    assert [f.status for f in ok] == [Status.OK]
    bad = check_node_classes(SiteFacts(classes, ("node1", "login1", "weird9")))
    assert bad[0].status is Status.CRITICAL
    assert "2 of 3 nodes" in bad[0].message and "login1, weird9" in bad[0].message
    unknown = check_node_classes(SiteFacts(classes, None, sinfo_error="sinfo: error: x"))
    assert unknown[0].status is Status.WARNING and "sinfo: error: x" in unknown[0].message


def test_spool_and_archive_owner_mode_and_mount(tmp_path: Path) -> None:
    good = tmp_path / "spool"
    good.mkdir(mode=0o755)
    good.chmod(0o755)
    facts = dir_facts("spool", good, Path("/proc/self/mountinfo").read_text())
    assert facts.uid == os.geteuid() and facts.mount is not None
    found = check_directory(facts, slurm_user_uid=os.geteuid())
    assert [f.status for f in found] == [Status.OK], found
    if os.geteuid() == 0:
        assert facts.root_write_uid == 0  # root's test file was root's: no squash here
        assert not list(good.iterdir())  # and it is gone
    loose = tmp_path / "loose"
    loose.mkdir()
    loose.chmod(0o1777)
    found = check_directory(dir_facts("archive", loose, ""), slurm_user_uid=os.geteuid())
    assert [f.status for f in found] == [Status.CRITICAL]
    assert "group/other-writable (mode 1777)" in found[0].message
    if os.geteuid() == 0:
        other = tmp_path / "nobody"
        other.mkdir(mode=0o755)
        os.chown(other, 65534, 65534)
        found = check_directory(dir_facts("spool", other, ""), slurm_user_uid=64030)
        assert found[0].status is Status.CRITICAL and "owned by uid 65534" in found[0].message
    link = tmp_path / "link"
    link.symlink_to(good)
    assert "is a symlink" in check_directory(dir_facts("spool", link, ""), os.geteuid())[0].message
    missing = check_directory(dir_facts("spool", tmp_path / "none", ""))
    assert missing[0].status is Status.WARNING and "does not exist" in missing[0].message


def test_nfs_spool_root_squash() -> None:
    mount = mount_of("/var/spool/bluevela/done", MOUNTINFO)
    assert mount == Mount("/var/spool/bluevela", "nfs4", "fs1:/export/bvspool",
                          "rw,vers=4.2,rsize=1048576,wsize=1048576,sec=sys")
    assert mount_of("/var/spool/bluevelaX", MOUNTINFO) == Mount(
        "/", "ext4", "/dev/nvme0n1p2", "rw,errors=remount-ro")
    base = DirFacts("spool", "/var/spool/bluevela", True, uid=0, mode=0o40755, mount=mount)
    warn = check_directory(base)
    assert [f.status for f in warn] == [Status.WARNING]
    assert "no_root_squash" in warn[0].message and "fs1:/export/bvspool" in warn[0].message
    squashed = DirFacts("spool", "/var/spool/bluevela", True, uid=0, mode=0o40755, mount=mount,
                        root_write_uid=65534)
    crit = check_directory(squashed)
    assert crit[0].status is Status.CRITICAL and "belongs to uid 65534" in crit[0].message


def test_evaluate_is_the_worst_and_drain_timeout_against_message_timeout() -> None:
    site = load_site(REPO / "site.yaml")
    classes = {n: nc.hostnames for n, nc in site.node_classes.items()}
    facts = SiteFacts(classes, ("node1",), config={**CONFIG, "MessageTimeout": "4 sec"},
                      wanted=tuple(HOOKS))
    result = evaluate(facts, drain_timeout_s=5.0)
    timeouts = [f for f in result.findings if f.check == "timeouts"]
    assert timeouts and "not below Slurm's MessageTimeout (4 s)" in timeouts[0].message
    assert result.status is Status.WARNING
    data = result.to_dict()
    assert data["status"] == "WARNING" and {"line": "PrologFlags=Alloc", "in_place": True} in \
        data["slurm_conf"]


def test_cli_without_slurm_is_warnings_not_a_traceback(tmp_path: Path) -> None:
    """No Slurm reachable (an empty PATH for sinfo/scontrol): every cluster check says it could
    not run (WARNING, exit 1), the slurm.conf lines are still printed."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    env = {**os.environ, "PATH": str(bin_dir), "BV_CACHE_DIR": "off"}
    env.pop("SLURM_CONF", None)
    p = subprocess.run([sys.executable, "-m", "bluevela", "site", "validate", "--cluster",
                        str(REPO / "site.yaml")], capture_output=True, text=True, timeout=60,
                       env=env, cwd=tmp_path)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "Traceback" not in p.stderr
    assert "WARNING: node classes: sinfo did not answer" in p.stdout
    assert "  HealthCheckNodeState=IDLE,CYCLE    # to merge" in p.stdout


@pytest.mark.parametrize("bad", ["x", "/definitely/not/here"])
def test_cli_bad_site_path_is_one_line(bad: str, tmp_path: Path) -> None:
    p = subprocess.run([sys.executable, "-m", "bluevela", "site", "validate", "--cluster", bad],
                       capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert p.returncode != 0 and "Traceback" not in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1


def test_the_prologs_worst_case_against_prolog_epilog_timeout(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """bluevela.hooks.budget's arithmetic (293 s with the repo's site: start 5 + lock wait 65 +
    run 181 + jitter 2 + rpc 30 + one bounded spool write 10) against the running
    PrologEpilogTimeout, and the healthcheck's against slurmd's 60 s kill."""
    from bluevela.site_checks import _budget_findings

    monkeypatch.delenv("BV_HOOK_LOCK_WAIT_S", raising=False)
    site = load_site(REPO / "site.yaml")
    ok = _budget_findings(site, {"PrologEpilogTimeout": "300"})
    assert [f.status for f in ok] == [Status.OK, Status.OK, Status.OK]
    assert ok[0].message.startswith("prolog worst case 293 s = start 5 + lock_wait 65")
    assert ok[0].message.endswith("rpc 30 + spool 10 <= PrologEpilogTimeout=300")
    assert ok[2].message.startswith("healthcheck worst case 60 s = start 5 + lock_wait 0 + "
                                    "run 23")
    # 283 s fitted 290 before the spool write was counted: 293 does not.
    assert _budget_findings(site, {"PrologEpilogTimeout": "290"})[0].status is Status.CRITICAL
    # The epilog's worst case is 133 s (its one read of Slurm's job record: issue 33 s4).
    short = _budget_findings(site, {"PrologEpilogTimeout": "140"})
    assert [f.status for f in short] == [Status.CRITICAL, Status.OK, Status.OK]
    assert "> PrologEpilogTimeout=140: Slurm would kill the hook" in short[0].message
    assert _budget_findings(site, {"PrologEpilogTimeout": "130"})[1].status is Status.CRITICAL
    # A node in two partitions: the breaker takes a slot in each (3 more drain RPCs).
    two = _budget_findings(site, {"PrologEpilogTimeout": "300"}, partitions=2)
    assert two[0].status is Status.CRITICAL and "308 s" in two[0].message
    # ... and the healthcheck's drain no longer fits slurmd's 60 s (its cap assumes one).
    assert two[2].status is Status.CRITICAL
    assert two[2].message.startswith("healthcheck worst case 75 s")
    assert "kill at 60 s (a node in 2 partitions: set health.partitions_per_node: 2): " \
        "slurmd would kill it mid-drain" in two[2].message
    # No running config: the prolog and epilog are not compared; the healthcheck still is.
    unknown = _budget_findings(site, None)
    assert [f.status for f in unknown] == [Status.WARNING, Status.WARNING, Status.OK]


def test_gather_reads_sinfo_and_the_recorded_config(monkeypatch: pytest.MonkeyPatch) -> None:
    """gather() over the Slurm seam: node names and partitions from `sinfo -N -o %N|%P`, the
    config from the recorded `scontrol show config` (SlurmUser root(0))."""
    from bluevela.site_checks import gather

    monkeypatch.delenv("BV_HOOK_LOCK_WAIT_S", raising=False)
    recorded = (REPO / "tests/data/slurm/show-config-22.05.txt").read_text()
    answers = {"sinfo": "node1|debug*\nnode2|debug*\nnode2|gpu\nnode3|debug*\n",
               "scontrol": recorded}

    def run(argv: list[str] | tuple[str, ...], timeout: float
            ) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess(list(argv), 0, answers[argv[0]], "")

    site = load_site(REPO / "site.yaml")
    facts = gather(site, run=run, mountinfo="")
    assert facts.sinfo_nodes == ("node1", "node2", "node3")
    assert facts.config is not None and facts.config["PrologFlags"] == "Alloc"
    assert facts.slurm_user_uid == 0
    assert [f.message.split(" = ")[0] for f in facts.budget] == [
        "prolog worst case 308 s", "epilog worst case 148 s", "healthcheck worst case 75 s"]


def test_slurm_release_reported_with_what_bv_can_use_there() -> None:
    """The release from `scontrol show config` (recorded 22.05.8), whether bv was tested on it,
    grow's switch and the expedited requeue (25.11 and later only)."""
    from bluevela.site_checks import check_slurm_release

    [found] = check_slurm_release(CONFIG)
    assert found.status is Status.OK and found.check == "slurm release", found
    assert found.message.startswith("Slurm 22.05.8: bv is tested on 22.05; grow: on; ")
    assert "expedited requeue: not in this release (25.11 and later)" in found.message
    newer = {**CONFIG, "SLURM_VERSION": "27.05.0", "SchedulerParameters": "bf_interval=5",
             "SlurmctldParameters": "enable_expedited_requeue,idle_on_node_suspend"}
    [warn] = check_slurm_release(newer)
    assert warn.status is Status.WARNING and "bv is not tested on 27.05 (tested: 22.05" in warn.message
    assert "grow: off (this Slurm cannot grow jobs: SchedulerParameters lacks " \
        "permit_job_expansion" in warn.message
    recorded = parse_config((REPO / "tests/data/slurm/24.11/show-config.txt").read_text())
    [on_2411] = check_slurm_release(recorded)
    assert on_2411.status is Status.OK and on_2411.message.startswith(
        "Slurm 24.11.5: bv is tested on 24.11; grow: off (Slurm 24.11 does not start a grown "
        "job's steps on the added node with PrologFlags=Alloc"), on_2411.message
    assert "expedited requeue: on (enable_expedited_requeue)" in warn.message
    off = check_slurm_release({**newer, "SlurmctldParameters": "(null)"})[0].message
    assert "expedited requeue: off (SlurmctldParameters lacks" in off
    assert check_slurm_release({"SLURM_VERSION": "x"})[0].status is Status.WARNING
    assert check_slurm_release(None) == []
