"""A grown node's checks belong to the job it joins (issue 28 §2).

A node grown into a running job (bluevela/launch/grow.py) runs its prolog under the short-lived
helper job's id (`bv-grow-JOB`). The supervisor records the grow in the job's goodput events
(`grow`: the helper's id and the node; bluevela/launch/events_log.py), and `bv archive show JOB`
gives the helper's prolog of that node to the job, marked `grown_via_job`, when the helper's
user is the job's (bluevela/archive/query.py: `grown_prologs`). The node's time series and
epilog telemetry start where the helper's epilog handed the node over (the node's own state:
bluevela/health/state.py `take_over`), so the job's efficiency page has the grown node. The
real grow on the dev cluster: tests/launch/test_grow_cluster.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from bluevela.archive.ingest import ingest
from bluevela.archive.query import show_job
from bluevela.archive.sample import sample_report
from bluevela.archive.spool import write_report
from bluevela.goodput import events as E
from bluevela.goodput.outcome import StepEnd
from bluevela.launch import events_log
from bluevela.telemetry.format import Column, Header, SegmentWriter, read_file
from bluevela.telemetry.window import write_side_file
from tests.goodput.test_goodput_events import sticky_dir

T = 1_800_000_000.0
JOB, HELPER = 41, 42


def _events(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
            grows: list[tuple[str, list[str]]]) -> dict[str, Any]:
    """A real EventLog: a launch, a lost node, the grows, the relaunch; the folded record."""
    d = sticky_dir(tmp_path / "events")
    monkeypatch.setenv("BV_EVENTS_DIR", str(d))
    env = {"SLURM_JOB_ID": str(JOB), "SLURM_RESTART_COUNT": "0", "BV_EVENTS_DIR": str(d)}
    log = events_log.EventLog.open(env, "node1", query=False)
    now = time.monotonic()
    log.launch(1, 1, ["node1", "node2"], 0, now)
    log.step_ended(StepEnd.LOST, "node2 lost", {}, now, now, now)
    for helper, nodes in grows:
        log.grown(helper, nodes)
    log.launch(2, 2, ["node1", "node3"], 0, now)
    log.step_ended(StepEnd.OK, "exit 0", {}, None, None, now)
    log.close()
    (path,) = d.glob(f"bv-goodput.{JOB}.r0.u{os.getuid()}.*.jsonl")
    return E.read_events_file(path.read_bytes())


def test_the_supervisor_records_the_grow_and_the_record_keeps_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rec = _events(tmp_path, monkeypatch, [(str(HELPER), ["node3"]),
                                          ("0", ["node4"]), ("43", ["../x"]), ("x", ["n"])])
    (grow,) = rec["grows"]  # what is not a job id or a node name is never written
    assert grow["helper"] == HELPER and grow["nodes"] == ["node3"] and grow["t"] > T / 2
    assert E.validate(json.loads(json.dumps(rec))) == rec  # survives the archive's JSON
    # A copy (the second node's) cut before the grow, merged in either order: once.
    copy = {**rec, "grows": []}
    assert E.merge_records(copy, rec)["grows"] == rec["grows"]
    assert E.merge_records(rec, copy)["grows"] == rec["grows"]
    assert E.merge_records(rec, rec) == rec


@pytest.mark.parametrize("bad", [
    {"t": T, "helper": 0, "nodes": ["node3"]},
    {"t": T, "helper": "42", "nodes": ["node3"]},
    {"t": T, "helper": 42, "nodes": ["node3;rm"]},
    {"t": T, "helper": 42, "nodes": "node3"},
    {"t": 5.0, "helper": 42, "nodes": ["node3"]},
    "grow"])
def test_a_forged_grow_is_refused(bad: object) -> None:
    rec = {"v": 1, "host": "node1", "job": JOB, "restart": 0, "opened": T, "slurm": {},
           "requeue": None, "launches": [], "grows": [bad]}
    with pytest.raises(E.EventsError):
        E.validate(rec)


def test_the_grows_are_bounded() -> None:
    lines: list[dict[str, Any]] = [{"e": "job", "t": T, "host": "node1", "job": JOB,
                                    "restart": 0}]
    lines += [{"e": "grow", "t": T, "helper": 100 + i, "nodes": ["node3"]}
              for i in range(E.MAX_GROWS + 1)]
    with pytest.raises(E.EventsError, match="grows"):
        E.fold(lines)
    assert len(E.fold(lines[:-1])["grows"]) == E.MAX_GROWS


def _spool_job(spool: Path, grows: list[dict[str, Any]] | None) -> None:
    """Job 41 on node[1-3]: node3 grown in, so its prolog is not under 41."""
    nodes = ["node1", "node2", "node3"]
    for node in nodes:
        if node != "node3":
            write_report(spool, sample_report(JOB, node, "prolog", nodelist=nodes, time=T))
        epi = sample_report(JOB, node, "epilog", nodelist=nodes, time=T + 80)
        if node == "node1" and grows is not None:
            epi["goodput_events"] = {"v": 1, "host": "node1", "job": JOB, "restart": 0,
                                     "opened": T, "slurm": {}, "requeue": None,
                                     "launches": [], "grows": grows}
        write_report(spool, epi)


def _spool_helper(spool: Path, job: int = HELPER, user: str = "alice") -> None:
    for phase, t in (("prolog", T + 30), ("epilog", T + 31)):
        write_report(spool, sample_report(job, "node3", phase, nodelist=["node3"], time=t,
                                          user=user, status_code=1 if phase == "prolog" else 0))


def _ingest(spool: Path, archive: Path) -> None:
    ingest(spool, archive, timeout_s=0.0, prolog_only_timeout_s=0.0, now=T + 4000)


def _node3(archive: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    job = show_job(archive, JOB)
    (n3,) = [n for n in job["nodes"] if n["node"] == "node3"]
    return job, n3


@pytest.mark.parametrize("helper_first", [True, False], ids=["helper-first", "job-first"])
def test_the_archive_gives_the_helpers_prolog_to_the_job(tmp_path: Path,
                                                         helper_first: bool) -> None:
    spool, archive = tmp_path / "spool", tmp_path / "archive"
    spool.mkdir()
    archive.mkdir()
    grows = [{"t": T + 30, "helper": HELPER, "nodes": ["node3"]}]
    first, second = (_spool_helper, _spool_job) if helper_first else (_spool_job, _spool_helper)
    first(spool, *([grows] if first is _spool_job else []))
    _ingest(spool, archive)
    second(spool, *([grows] if second is _spool_job else []))
    _ingest(spool, archive)
    _ingest(spool, archive)  # idempotent
    job, n3 = _node3(archive)
    assert n3["prolog"] is not None and n3["prolog"]["grown_via_job"] == HELPER
    assert n3["prolog"]["phase"] == "prolog" and n3["prolog"]["health"]["status"] == "WARNING"
    assert n3["epilog"]["health"]["status"] == "OK"
    assert job["missing_prolog_nodes"] == []
    # The other nodes keep their own prologs, unmarked.
    assert all("grown_via_job" not in n["prolog"] for n in job["nodes"] if n["node"] != "node3")


def test_a_helper_of_another_user_lends_no_checks(tmp_path: Path) -> None:
    """Job 41's record names job 42, but 42 (named bv-grow-41 or not) is bob's: 41 keeps a
    node with no prolog. And a record that names no grow takes none."""
    spool, archive = tmp_path / "spool", tmp_path / "archive"
    spool.mkdir()
    archive.mkdir()
    _spool_job(spool, [{"t": T + 30, "helper": HELPER, "nodes": ["node3"]}])
    _spool_helper(spool, user="bob")
    _ingest(spool, archive)
    job, n3 = _node3(archive)
    assert n3["prolog"] is None and job["missing_prolog_nodes"] == ["node3"]

    spool2, archive2 = tmp_path / "spool2", tmp_path / "archive2"
    spool2.mkdir()
    archive2.mkdir()
    _spool_job(spool2, None)
    _spool_helper(spool2)
    _ingest(spool2, archive2)
    _, n3 = _node3(archive2)
    assert n3["prolog"] is None


def test_bv_archive_show_marks_the_grown_prolog(tmp_path: Path) -> None:
    spool, archive = tmp_path / "spool", tmp_path / "archive"
    spool.mkdir()
    archive.mkdir()
    _spool_job(spool, [{"t": T + 30, "helper": HELPER, "nodes": ["node3"]}])
    _spool_helper(spool)
    _ingest(spool, archive)
    env = {**os.environ, "BV_ARCHIVE_DIR": str(archive), "BV_SPOOL_DIR": str(spool),
           "BV_CACHE_DIR": "off"}
    out = subprocess.run([sys.executable, "-m", "bluevela", "archive", "show", str(JOB)],
                         capture_output=True, text=True, timeout=60, env=env, check=False)
    assert out.returncode == 0, out.stderr
    (row,) = [ln for ln in out.stdout.splitlines() if ln.startswith("node3")]
    assert row.split("\t")[1].startswith("WARNING ") and "(grown via job 42)" in row, row
    js = subprocess.run([sys.executable, "-m", "bluevela", "archive", "show", str(JOB),
                         "--json"], capture_output=True, text=True, timeout=60, env=env,
                        check=False)
    (n3,) = [n for n in json.loads(js.stdout)["nodes"] if n["node"] == "node3"]
    assert n3["prolog"]["grown_via_job"] == HELPER


# -- the grown node's time series (the node's own state: health/state.py take_over) ------------


def _segment(samples: Path, node: str, start: float, n: int, util: float) -> None:
    """A sampler segment in its real format: n records a second apart from `start`."""
    samples.mkdir(parents=True, exist_ok=True)
    cols = tuple(Column(c, c.rpartition(".")[0], u) for c, u in
                 (("gpu0.util_pct", "%"), ("node.cpu_busy_pct", "%")))
    w = SegmentWriter(samples / f"seg-{int(start)}.bvts", Header(node, 1.0, cols, start))
    for i in range(n):
        w.append(start + i, [util, 50.0])
    w.close()


def _energy(hook_env: Path, tmp: Path, kj: int) -> None:
    """The node's NVML: each GPU's energy counter `kj` kJ past the fixture's."""
    from tests.hooks.test_hooks_run import FIXTURES

    snap = json.loads((FIXTURES / "h100-healthy" / "nvml.json").read_text())
    for g in snap["gpus"]:
        g["total_energy_mj"] += kj * 1_000_000
    path = tmp / f"nvml-{kj}.json"
    path.write_text(json.dumps(snap))
    hook_env.write_text("".join(
        f"BV_NVML_SNAPSHOT={path}\n" if ln.startswith("BV_NVML_SNAPSHOT=") else ln + "\n"
        for ln in hook_env.read_text().splitlines()))


def test_take_over_is_the_same_users_later_job_once_and_nothing_else(tmp_path: Path) -> None:
    from bluevela.health.state import hand_over, take_over

    state = tmp_path / "state"
    state.mkdir()
    hand_over(state, HELPER, "alice", T, {"gpu": {"energy_j": 5.0}})
    assert json.loads((state / "handover.json").read_text())["time"] == T
    for job, user in ((JOB, "bob"), (JOB, ""), (HELPER, "alice"), (HELPER + 1, "alice")):
        assert take_over(state, job, user, now=T + 60) is None, (job, user)
    assert take_over(state, JOB, "alice", now=T - 1) is None  # a start in the future
    taken = take_over(state, JOB, "alice", now=T + 60)
    assert taken == {"time": T, "metrics": {"gpu": {"energy_j": 5.0}}, "grown_via_job": HELPER}
    assert take_over(state, JOB, "alice", now=T + 60) is None  # once
    # The hooks' own file only: a symlink, a forged or damaged one gives nothing.
    (tmp_path / "forged.json").write_text(json.dumps({"job": HELPER, "user": "alice", "time": T}))
    (state / "handover.json").symlink_to(tmp_path / "forged.json")
    assert take_over(state, JOB, "alice", now=T + 60) is None
    (state / "handover.json").unlink()
    for bad in ({"job": True, "user": "alice", "time": T}, {"job": HELPER, "user": "alice",
                                                            "time": "T"}, [HELPER], "x"):
        (state / "handover.json").write_text(json.dumps(bad))
        assert take_over(state, JOB, "alice", now=T + 60) is None, bad
    (state / "handover.json").write_text("{")
    assert take_over(state, JOB, "alice", now=T + 60) is None


def test_the_grown_nodes_series_reaches_the_jobs_efficiency_page(tmp_path: Path) -> None:
    """The real hooks on node3: the helper's prolog and epilog (Slurm ran them when it gave the
    node to the helper and then to the job), then the job's epilog, which had no prolog there:
    it spools node3's window from the helper's epilog on. Ingested with the job's node1, the
    job's efficiency page has node3's series; another user's job there later takes nothing."""
    from bluevela.report.efficiency import job_efficiency
    from bluevela.report.efficiency_html import render_html
    from tests.hooks.test_hooks_run import make_node, run_hook

    hook_env, base = make_node(tmp_path, BV_SAMPLER_INTERVAL_S="1")
    spool, state = base / "spool", base / "state"
    t0 = time.time()
    _segment(state / "samples", "node3", t0 - 20, 900, util=90.0)
    slurm = {"SLURMD_NODENAME": "node3", "SLURM_JOB_USER": "alice", "SLURM_JOB_PARTITION": "gpu"}
    helper = {**slurm, "SLURM_JOB_ID": str(HELPER), "SLURM_NODELIST": "node3",
              "SLURM_JOB_NUM_NODES": "1"}
    job = {**slurm, "SLURM_JOB_ID": str(JOB), "SLURM_NODELIST": "node[1,3]",
           "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_EXIT_CODE2": "0:0"}
    assert run_hook("prolog", hook_env, helper).returncode == 0
    _energy(hook_env, tmp_path, 1)  # each GPU used 1 kJ more by the helper's epilog: the join
    joined = time.time()
    assert run_hook("epilog", hook_env, {**helper, "SLURM_JOB_EXIT_CODE2": "0:0"}).returncode == 0
    left = time.time()
    _energy(hook_env, tmp_path, 3)  # and 2 kJ more in the job
    p = run_hook("epilog", hook_env, job)
    ended = time.time()
    assert p.returncode == 0 and "the node joined from job 42" in p.stderr, p.stderr
    window = read_file(spool / f"{JOB}.node3.series.bvts", strict=True)
    times = [t for t, _ in window.records()]
    assert window.header.job_id == JOB and window.header.node == "node3"
    # From the helper's epilog (less one interval) to the job's end on node3.
    assert joined - 1.0 <= times[0] <= left and times[-1] <= ended, (times, joined, left)
    report = json.loads((spool / f"{JOB}.node3.epilog.json").read_text())
    # The job's telemetry on node3 counts from the join: 8 GPUs x 2 kJ.
    assert report["restart"] == 0 and report["telemetry"]["gpu_energy_j"] == pytest.approx(16e3)
    assert 0 < report["telemetry"]["job_wall_s"] <= ended - joined + 1.0

    # The job's first node (its prolog, its window, the supervisor's grow) and ingest.
    nodes = ["node1", "node2"]
    write_report(spool, sample_report(JOB, "node1", "prolog", nodelist=nodes, time=t0 - 10))
    epi = sample_report(JOB, "node1", "epilog", nodelist="node[1,3]", time=ended)
    epi["goodput_events"] = {"v": 1, "host": "node1", "job": JOB, "restart": 0, "opened": t0,
                             "slurm": {}, "requeue": None, "launches": [],
                             "grows": [{"t": joined, "helper": HELPER, "nodes": ["node3"]}]}
    write_report(spool, epi)
    _segment(tmp_path / "node1" / "samples", "node1", t0 - 20, 900, util=80.0)
    write_side_file(spool, tmp_path / "node1" / "samples", JOB, "node1", t0 - 10, ended, 1.0)
    archive = tmp_path / "archive"
    archive.mkdir()
    for _ in range(2):
        ingest(spool, archive, timeout_s=0.0, prolog_only_timeout_s=0.0, now=ended + 4000)
    shown, n3 = _node3(archive)
    assert n3["prolog"]["grown_via_job"] == HELPER and n3["epilog"] is not None
    eff = job_efficiency(archive, JOB, job=shown)
    assert eff.nodes == ["node1", "node3"], eff.nodes
    (row,) = [r for r in eff.per_node if r["node"] == "node3"]
    assert row["gpu_util_pct"] == 90.0, row
    assert "node3" not in {m["node"] for m in eff.missing
                           if m["why"] == "no time series from this node"}, eff.missing
    assert "node3 (no time series" not in render_html(eff)

    # bob's job on node3 next, with no prolog there: the handover is alice's job's, not his.
    bob = {**job, "SLURM_JOB_ID": "40", "SLURM_JOB_USER": "bob"}
    assert run_hook("epilog", hook_env, bob).returncode == 0
    assert not (spool / "40.node3.series.bvts").exists()
