"""`bv submit`'s resilience and resource options: validation, rendering, goldens, refusals;
the sbatch option list against the installed sbatch; the runtime API; Slurm's per-attempt
records folded to the LAST attempt (recorded on the dev cluster); output split per attempt.

Regenerate the golden file after an intended change with:
    BV_REGEN_GOLDEN=1 python -m pytest tests/launch/test_submit_options.py -k golden
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bluevela.errors import LaunchError
from bluevela.launch.attempts import attempt_causes, split_attempts
from bluevela.launch.request import (
    SIGNAL_EARLY_S,
    SubmitRequest,
    parse_sbatch_arg,
    time_limit_seconds,
)
from bluevela.launch.sbatch_opts import CLASSIFIED_FOR, MANAGED, PASSTHROUGH, REFUSED
from bluevela.launch.submit import build_request
from bluevela.site import load_site
from bluevela.slurm.cli_client import fold_history, parse_sacct_line
from bluevela.slurm.states import JobState
from tests.conftest import DATA, HOSTILE, REPO

SITE = load_site(REPO / "site.yaml")
GOLDEN = DATA / "golden"


def _sbatch(req: SubmitRequest) -> list[str]:
    return [ln for ln in req.materialize().splitlines() if ln.startswith("#SBATCH")]


def _bv(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "bluevela", *args], capture_output=True,
                          text=True, cwd=cwd, timeout=60, check=False,
                          env={**os.environ, "BV_SITE": str(REPO / "site.yaml")})


# -- time limits and the signal margin ---------------------------------------------------------

@pytest.mark.parametrize(("text", "seconds"), [
    ("2", 120), ("90", 5400), ("2:30", 150), ("1:00:00", 3600), ("1-0", 86400),
    ("1-2", 93600), ("1-2:03", 93780), ("1-2:03:04", 93784), ("UNLIMITED", None),
])
def test_time_limit_seconds(text: str, seconds: int | None) -> None:
    assert time_limit_seconds(text) == seconds


def test_signal_header_append_and_requeue() -> None:
    """The header a resilient job needs: SIGUSR1 to the batch shell (the supervisor), output
    appended across requeues, requeue on."""
    lines = _sbatch(build_request(SITE, "t.py", time_limit="2", signal_before=60))
    assert "#SBATCH --signal=B:USR1@60" in lines
    assert "#SBATCH --open-mode=append" in lines
    assert "#SBATCH --requeue" in lines
    assert lines == sorted(lines)


def test_margin_that_leaves_no_sure_work_is_refused_with_one_line() -> None:
    """submitit's 90 s on a 2-minute limit left 3-23 s per attempt and failed; refused here."""
    proc = _bv("submit", "--dry-run", "-t", "2", "--signal-before", "90", "t.py")
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("bv: error: --signal-before 90 s leaves 30 s of a 120 s time limit")
    assert f"up to {SIGNAL_EARLY_S} s early" in lines[0] and "use at most 60 s" in lines[0]
    with pytest.raises(LaunchError, match="no work time is sure"):
        build_request(SITE, "t.py", time_limit="2:00", signal_before=120)
    with pytest.raises(LaunchError, match="no work time is sure"):
        build_request(SITE, "t.py", time_limit="1", signal_before=1)


def test_margin_that_fits_is_kept() -> None:
    assert build_request(SITE, "t.py", time_limit="2", signal_before=60).signal_before == 60
    assert build_request(SITE, "t.py", time_limit="1:00:00", signal_before=3540).signal_before


def test_site_default_margin_dropped_with_a_note_when_it_does_not_fit() -> None:
    """The site's 120 s cannot fit a 2-minute job: no signal, and a note says so (an explicit
    --signal-before that does not fit is an error instead)."""
    assert SITE.launch.signal_before_s == 120
    notes: list[str] = []
    req = build_request(SITE, "t.py", time_limit="2", notes=notes)
    assert req.signal_before == 0 and not any("signal" in ln for ln in _sbatch(req))
    assert notes and "launch.signal_before_s (120 s) does not fit --time 2" in notes[0]
    proc = _bv("submit", "--dry-run", "-t", "2", "t.py")
    assert proc.returncode == 0 and "bv: note: no checkpoint signal" in proc.stderr
    # No --time: the limit is the partition's; the site's margin is rendered.
    assert "#SBATCH --signal=B:USR1@120" in _sbatch(build_request(SITE, "t.py"))
    assert build_request(None, "t.py").signal_before == 0


def test_signal_before_zero_means_no_signal() -> None:
    assert not any("--signal" in ln for ln in _sbatch(build_request(SITE, "t.py", signal_before=0)))


@pytest.mark.parametrize(("kw", "msg"), [
    ({"signal_before": -1}, ">= 0"),
    ({"signal_before": 70000}, "65535"),
    ({"spare_nodes": -1}, "--spare-nodes"),
    ({"min_nodes": 3, "nodes": 2}, "--min-nodes"),
    ({"hang_timeout": -5.0}, "--hang-timeout"),
    ({"cpus_per_task": 0}, "--cpus-per-task"),
])
def test_out_of_range_refused(kw: dict[str, object], msg: str) -> None:
    with pytest.raises(LaunchError, match=re.escape(msg)):
        build_request(SITE, "t.py", **kw)  # type: ignore[arg-type]


# -- spares, resources ------------------------------------------------------------------------

def test_spares_enlarge_the_allocation_and_keep_it_alive() -> None:
    req = build_request(SITE, "t.py", nodes=4, spare_nodes=1)
    lines = _sbatch(req)
    assert "#SBATCH --nodes=5" in lines and "#SBATCH --no-kill" in lines
    assert req.nodes == 4  # the training size the supervisor gets
    shrink = _sbatch(build_request(SITE, "t.py", nodes=4, min_nodes=2))
    assert "#SBATCH --nodes=4" in shrink and "#SBATCH --no-kill" in shrink
    assert "#SBATCH --no-kill" not in _sbatch(build_request(SITE, "t.py", nodes=4))


def test_resource_options_rendered() -> None:
    lines = _sbatch(build_request(
        SITE, "t.py", cpus_per_task=8, mem="200G", exclusive=True, constraint="h100&[ib1|ib2]",
        exclude="gpu[001-004],gpu9", dependency="afterok:12:13+5,afterany:14"))
    for want in ("--cpus-per-task=8", "--mem=200G", "--exclusive",
                 "--constraint='h100&[ib1|ib2]'", "--exclude='gpu[001-004],gpu9'",
                 "--dependency=afterok:12:13+5,afterany:14"):
        assert f"#SBATCH {want}" in lines, (want, lines)


@pytest.mark.parametrize("value", HOSTILE)
@pytest.mark.parametrize("field", ["mem", "constraint", "exclude", "dependency"])
def test_hostile_resource_values_refused(field: str, value: str) -> None:
    with pytest.raises(LaunchError):
        build_request(SITE, "t.py", **{field: value})  # type: ignore[arg-type]


@pytest.mark.parametrize(("field", "value"), [
    ("mem", "10X"), ("mem", "1G\n#SBATCH --uid=0"), ("dependency", "afterok"),
    ("dependency", "afterok:1,afterany:2?afterok:3"), ("dependency", "after:1;id"),
    ("exclude", "n1 n2"), ("constraint", "a'b"),
])
def test_malformed_resource_values_refused(field: str, value: str) -> None:
    with pytest.raises(LaunchError):
        build_request(SITE, "t.py", **{field: value})  # type: ignore[arg-type]


# -- --sbatch-arg pass-through ----------------------------------------------------------------

def test_sbatch_arg_passthrough_rendered_and_quoted() -> None:
    lines = _sbatch(build_request(SITE, "t.py", sbatch_args=(
        "--nice=10", "--reboot", "--mail-user=a b'c@x", "--begin=now+60")))
    assert "#SBATCH --nice=10" in lines and "#SBATCH --reboot" in lines
    assert "#SBATCH --begin=now+60" in lines
    assert "#SBATCH --mail-user='a b\\'c@x'" in lines, lines


@pytest.mark.parametrize(("arg", "msg"), [
    ("--output=/etc/x", "bv sets it; use --output (default: site.yaml launch.output)"),
    ("--signal=USR2@30", "bv sets it; use --signal-before"),
    ("--open-mode=truncate", "bv sets it"),
    ("--array=0-9", "job arrays are not supported"),
    ("--wrap=id", "bv writes the batch script"),
    ("--uid=0", "other users"),
    ("--error=e.txt", "stderr must stay"),
    ("--no-such-option=1", "not an sbatch option; valid: "),
    ("nice=5", "give a long option"),
    ("-n4", "give a long option"),
    ("--", "give a long option"),
    ("--Nice=5", "not a long sbatch option name"),
    ("--nice=5\n#SBATCH --uid=0", "newline or control"),
    ("--comment=x\x1b[31m", "newline or control"),
])
def test_sbatch_arg_refusals(arg: str, msg: str) -> None:
    with pytest.raises(LaunchError, match=re.escape(msg)):
        parse_sbatch_arg(arg)


def test_sbatch_arg_refusal_is_one_cli_line() -> None:
    proc = _bv("submit", "--dry-run", "--sbatch-arg=--array=1-4", "t.py")
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "bv: error: --sbatch-arg --array: " + REFUSED["array"]]


def _run_sbatch(tmp_path: Path, flag: str) -> str:
    # sbatch needs some slurm.conf even for --help (else a DNS SRV lookup fails).
    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=x\nSlurmctldHost=localhost\nNodeName=n1\nPartitionName=p Nodes=n1\n")
    env = {**os.environ, "SLURM_CONF": str(conf)}
    return subprocess.run(["sbatch", flag], capture_output=True, text=True, env=env,
                          timeout=30, check=True).stdout


def _installed_sbatch_options(tmp_path: Path) -> set[str]:
    names: set[str] = set()
    for flag in ("--help", "--usage"):
        names |= set(re.findall(r"--([a-z][a-z0-9-]*)", _run_sbatch(tmp_path, flag)))
    return names


@pytest.mark.skipif(shutil.which("sbatch") is None, reason="sbatch not installed")
def test_shipped_option_list_matches_installed_sbatch(tmp_path: Path) -> None:
    """Every installed sbatch option is classified once; every pass-through name exists.
    On a Slurm upgrade this fails until bluevela/launch/sbatch_opts.py is brought up to date."""
    installed = _installed_sbatch_options(tmp_path)
    assert len(installed) > 60, installed
    assert not (PASSTHROUGH & set(MANAGED)) and not (PASSTHROUGH & set(REFUSED))
    assert not (set(MANAGED) & set(REFUSED))
    assert PASSTHROUGH <= installed, sorted(PASSTHROUGH - installed)
    unclassified = installed - PASSTHROUGH - set(MANAGED) - set(REFUSED)
    version = _run_sbatch(tmp_path, "--version")
    release = ".".join(re.findall(r"\d+", version)[:2])
    if release == CLASSIFIED_FOR:
        assert not unclassified, f"classify in sbatch_opts.py: {sorted(unclassified)}"
    else:
        # Another release (Debian 13 ships 24.11): its new options are refused, never passed.
        for name in sorted(unclassified)[:5]:
            with pytest.raises(LaunchError):
                build_request(SITE, "train.py", (), sbatch_args=(f"--{name}=1",))


# -- golden ------------------------------------------------------------------------------------

def test_golden_resilient() -> None:
    req = build_request(
        SITE, "/shared/proj/train.py", ("--ckpt-dir", "/shared/ckpt run"), nodes=4,
        node_class="h100", partition="gpu", time_limit="1-00:00:00", signal_before=300,
        spare_nodes=1, hang_timeout=600.0, cpus_per_task=96, mem="0", exclusive=True,
        constraint="h100", exclude="gpu[007]", dependency="afterok:41",
        sbatch_args=("--reservation=train", "--mail-type=END"))
    text = req.materialize()
    path = GOLDEN / "resilient.sbatch"
    if os.environ.get("BV_REGEN_GOLDEN"):
        path.write_text(text)
    assert text == path.read_text(), f"{path} differs; regenerate with BV_REGEN_GOLDEN=1"


def test_submit_help_lists_the_new_options() -> None:
    out = _bv("submit", "--help").stdout
    for opt in ("--signal-before", "--spare-nodes", "--hang-timeout", "--cpus-per-task",
                "--mem", "--exclusive", "--constraint", "--exclude", "--dependency",
                "--sbatch-arg", "--min-nodes"):
        assert opt in out


# -- Slurm's records of a requeued job ----------------------------------------------------------

def _records(job: int) -> list:  # type: ignore[type-arg]
    lines = (DATA / "slurm" / "sacct-requeued-22.05.txt").read_text().splitlines()
    return [r for r in map(parse_sacct_line, lines) if r.job_id == job]


@pytest.mark.parametrize(("job", "first"), [(1, "REQUEUED"), (3, "NODE_FAIL")])
def test_last_completion_record_wins(job: int, first: str) -> None:
    """The bug: once a requeued job left slurmctld, `bv status` showed the first attempt's
    record (NODE_FAIL) though the job COMPLETED. Recorded on the dev cluster."""
    info = fold_history(_records(job))
    assert info is not None
    assert info.state is JobState.COMPLETED and info.exit_code == 0
    assert info.restarts == 1
    assert [a.state_name for a in info.attempts] == [first, "COMPLETED"]
    assert [a.attempt for a in info.attempts] == [1, 2]


def test_states_that_slurm_may_still_requeue() -> None:
    for st in (JobState.NODE_FAIL, JobState.PREEMPTED, JobState.REQUEUED):
        assert st.may_requeue()
    for st in (JobState.COMPLETED, JobState.FAILED, JobState.CANCELLED, JobState.TIMEOUT):
        assert not st.may_requeue()


# -- output per attempt --------------------------------------------------------------------------

OUTPUT = (
    "prolog says hi\n"
    "==== bv attempt 1 job 7 nodes node[1-2] previous: none ====\n"
    "step=1 attempt=1\n"
    "==== bv attempt 1 ended: checkpoint signal SIGUSR1 from Slurm, requeued by bv ====\n"
    "==== bv attempt 2 job 7 nodes node[2-3] previous: checkpoint signal SIGUSR1 from Slurm, "
    "requeued by bv ====\n"
    "rank=0 attempt=2 resumed_from_step=1\n"
    "==== bv attempt 3 job 7 nodes node[1,3] previous: ended without bv end line (Slurm ended "
    "the allocation) ====\n"
    "done\n"
)


def test_split_attempts_on_banners() -> None:
    parts = split_attempts(OUTPUT)
    assert [p.attempt for p in parts] == [1, 2, 3]
    assert parts[0].text.startswith("prolog says hi\n")
    assert "step=1 attempt=1" in parts[0].text and "resumed" not in parts[0].text
    assert parts[1].text.startswith("==== bv attempt 2 ") and "resumed_from_step=1" in parts[1].text
    assert parts[2].nodes == "node[1,3]" and parts[2].text.endswith("done\n")
    assert attempt_causes(OUTPUT) == {
        1: "checkpoint signal SIGUSR1 from Slurm, requeued by bv",
        2: "ended without bv end line (Slurm ended the allocation)",
    }
    assert [p.attempt for p in split_attempts("no banner\n")] == [1]


def test_banner_lookalike_inside_a_line_is_not_a_banner() -> None:
    text = "x ==== bv attempt 9 job 7 nodes n1 previous: none ====\n"
    assert len(split_attempts(text)) == 1


# -- runtime API -----------------------------------------------------------------------------------

_RUNTIME_CHILD = r"""
import os, signal, sys, time
import bluevela.runtime as rt
assert "torch" not in sys.modules
rt.install_signal_handler()
print("ready", rt.attempt(), rt.checkpoint_requested(), flush=True)
while not rt.checkpoint_requested():
    time.sleep(0.01)
print("requested", rt.requested_by(), flush=True)
time.sleep(float(sys.argv[1]))
print("survived", flush=True)
"""


def _child(sleep_after: float, **env: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", _RUNTIME_CHILD, str(sleep_after)],
                            stdout=subprocess.PIPE, text=True,
                            env={**os.environ, **env}, cwd=REPO)
    assert proc.stdout is not None
    ready = proc.stdout.readline()
    assert ready.startswith("ready"), ready
    return proc


def test_sigusr1_sets_the_flag_and_does_not_kill() -> None:
    proc = _child(0.1, SLURM_RESTART_COUNT="2")
    proc.send_signal(signal.SIGUSR1)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0
    assert out.splitlines() == ["requested SIGUSR1", "survived"]


def test_attempt_numbers() -> None:
    proc = _child(0.0, SLURM_RESTART_COUNT="2")
    proc.send_signal(signal.SIGUSR1)
    proc.communicate(timeout=30)
    out = subprocess.run(
        [sys.executable, "-c", "import bluevela.runtime as r; print(r.attempt())"],
        capture_output=True, text=True, env={**os.environ, "SLURM_RESTART_COUNT": "2"},
        check=True).stdout
    assert out.strip() == "3"
    out = subprocess.run(
        [sys.executable, "-c", "import bluevela.runtime as r; print(r.attempt())"],
        capture_output=True, text=True,
        env={**os.environ, "SLURM_RESTART_COUNT": "2", "BV_ATTEMPT": "5"}, check=True).stdout
    assert out.strip() == "5"


def test_sigterm_requests_a_checkpoint_then_ends_after_the_grace() -> None:
    """SIGTERM (operator requeue, preemption) gives the loop time to save; a second SIGTERM
    (torchrun's agent forwarding Slurm's) is absorbed; the grace period still ends it."""
    proc = _child(30.0, BV_TERM_GRACE_S="1.5")
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    elapsed = time.monotonic() - t0
    assert out.splitlines() == ["requested SIGTERM"]
    assert proc.returncode == -signal.SIGTERM
    assert 1.2 < elapsed < 10


def test_wait_stops_on_a_held_job_and_says_how_it_runs_again() -> None:
    """An expedited requeue that ends non-zero is requeued held (docs/install.md 4.7), as is a
    job an operator `scontrol requeuehold`s: Slurm never starts it by itself, and `bv submit
    --wait` polled it for ever. Now it waits the requeue grace, then returns the held job;
    the 24.11+ state list ["PENDING", "REQUEUE_HOLD"] is read as REQUEUE_HOLD."""
    from bluevela.launch.submit import exit_status_for, follow, is_held
    from bluevela.slurm.cli_client import parse_squeue_job
    from bluevela.slurm.client import JobInfo

    raw = {"job_id": 9, "job_state": ["PENDING", "REQUEUE_HOLD"], "restart_cnt": 1,
           "requeue": True, "state_reason": "JobHeldAdmin", "nodes": ""}
    held = parse_squeue_job(raw)
    assert held.state is JobState.REQUEUE_HOLD and is_held(held)
    running = JobInfo(9, JobState.RUNNING, "RUNNING", None, None, ("n1",), requeue=True)
    pending = JobInfo(9, JobState.PENDING, "PENDING", None, None, (), reason="Priority")
    user_hold = JobInfo(9, JobState.PENDING, "PENDING", None, None, (), reason="JobHeldUser")
    assert not is_held(pending) and is_held(user_hold) and not is_held(running)

    class Client:
        def __init__(self, states: list[JobInfo]) -> None:
            self.states = states

        def job(self, job_id: int) -> JobInfo:
            return self.states.pop(0) if len(self.states) > 1 else self.states[0]

    now = [0.0]

    def sleep(s: float) -> None:
        now[0] += s

    got = follow(Client([running, held]), 9, poll_s=1.0, requeue_grace_s=5.0,  # type: ignore[arg-type]
                 timeout_s=3600.0, sleep=sleep, clock=lambda: now[0])
    assert got.state is JobState.REQUEUE_HOLD and 5.0 < now[0] < 10.0
    assert exit_status_for(got) == 1
    # released within the grace: waiting goes on, to the job's real end
    done = JobInfo(9, JobState.COMPLETED, "COMPLETED", 0, None, ("n1",))
    now[0] = 0.0
    got = follow(Client([held, held, pending, running, done]), 9, poll_s=1.0,  # type: ignore[arg-type]
                 requeue_grace_s=5.0, timeout_s=3600.0, sleep=sleep, clock=lambda: now[0])
    assert got.state is JobState.COMPLETED
