"""Recovery from a node crash on the dev cluster: bv's in-job supervisor vs bare Slurm requeue.

The job (both paths): examples/train_ddp.py on 2 nodes x 1 gloo rank, a step every 0.5 s, a
checkpoint every 5 steps, resume from the last checkpoint at start (issue 10's set-up). At
`step=10` (``BV_BENCH_CRASH_STEP=N``: at step N, the job 20 steps longer) the second node of
the step is crashed (`slurm/devcluster crash`: every process in its namespace SIGKILLed,
slurmd included). Each line of the job's output file is timestamped
as it appears (polled at 20 Hz); phases are measured from the crash.

``BV_BENCH_SCRIPT`` (bv's kinds; the bare Slurm job always runs bv's runtime script):
``runtime`` (default: examples/train_ddp.py, bv's runtime script), ``plain``
(examples/plain_ddp.py: DDP that knows nothing of bv, its own checkpoint every 5 steps) or
``lightning`` (examples/byos/lightning_ddp.py: ModelCheckpoint every 5 steps, fit(ckpt_path=
"last")); "resumed" is then that script's first rank line after its checkpoint was loaded
(``rank=R resumed_from_step=S`` / ``rank=R start_step=S``), and both sides of a before/after
run this checkout's copy of it.

- submitit (``BV_BENCH_SUBMITIT=1``, before/after runs only: one after each pair; ``pip install
  submitit``): examples/plain_ddp.py through submitit's SlurmExecutor as its docs show a
  multi-node torch job (benchmarks/_submitit_job.py), requeued by Slurm after the crash:
  crash -> job left RUNNING -> RUNNING again -> the first resumed rank line of task 0.
- bv (`bv submit --spare-nodes 1`, 3-node allocation): crash -> the supervisor's end line
  (step ended) -> the attempt-2 banner (relaunched) -> the first `rank=R attempt=2
  resumed_from_step=S` line.
- bv, silent crash (`crash --silent`: the node's link goes down first, so no FIN/RST reaches
  the peers, as in a power cut): detection then rests on the supervisor's --node-timeout.
- bv without spares (the default): the supervisor lets go of the lost node and requeues at
  once; Slurm holds the job for cred_expire, then starts it on healthy nodes.
- bv grow (issue 19: no spare, site.yaml ``launch.grow_deadline_s: 30``, the dev cluster's
  ``permit_job_expansion``): the supervisor lets go of the lost node, grows the SAME job by
  the free third node and relaunches there: no requeue, so neither cred_expire nor
  SlurmdTimeout is in its path.
- bv shrink (``--min-nodes 1``, data parallel): relaunches on the one node left.
- bare Slurm (today's launcher: `srun torchrun` in an sbatch script, `--requeue`,
  `--open-mode=append`, 2-node allocation): crash -> the job leaves RUNNING (Slurm declared the
  node dead: SlurmdTimeout) -> RUNNING again (after the requeue hold: cred_expire) -> the first
  resumed rank line.

The runs are interleaved (bv, bare, bv silent, ...) on the same cluster. A measurement that
prints, not a timed test. Dev cluster: SlurmdTimeout=30, cred_expire=20 (left as they are).

Before/after a change (issue 16: the signed control channel; issues 23/24: the happy path):
with ``BV_BENCH_OLD=<checkout of the old commit>`` only the `bv` (spare) crash is run (and,
with ``BV_BENCH_AB_GROW=1``, a grow crash by each side in every pair too; with
``BV_BENCH_AB_HANG=1`` a hang: rank 1 of tests/data/resilience/train_ckpt.py stops at the crash
step, ``--hang-timeout`` ``BV_BENCH_HANG_TIMEOUT_S`` (5 s), a spare; measured from the step line
it stopped after),
alternately by the old checkout (``PYTHONPATH`` points the submit and the job at it) and by
this one (``BV_BENCH_NEW=<checkout>`` pins the new side to a commit too), old first in even
pairs and new first in odd ones. Two figures come from each run:

- crash -> the first resumed rank line (above); ``recovery.bv_new_vs_old_ratio``;
- submit -> first rank line: from `bv submit` returning the job id to the job's first
  `rank=R attempt=1 resumed_from_step=S` line (phases: -> the attempt-1 banner, i.e. the
  allocation granted, every node's prolog done and the batch script started; -> the first rank
  line: supervisor, agents, torchrun's rendezvous, the ranks' imports and process group);
  ``recovery.submit_new_vs_old_ratio``. `bv submit`'s own wall time is printed too.

Each ratio is the median of the per-pair new/old ratios, with their range.

``BV_BENCH_CPU=1``: every process's CPU time is sampled during each run (`_procsample`), and
the CPU seconds each kind of process (supervisor, agent, torchrun, rank, srun, slurmstepd, ...)
used in the launch (job started -> first rank line) and the relaunch (crash -> resumed) are
printed per run and as medians per side. The dev cluster's three nodes share this machine's
cores, so a side that costs more CPU is slower here. ``benchmarks/ab_launch.py`` times the
first launch alone, many more pairs in the same time.

The node hooks are on the submit path (``PrologFlags=Alloc``: the job starts when every node's
prolog is done). By default (``BV_BENCH_SIDE_HOOKS=1``) each side runs its OWN hooks: the dev
cluster is brought up with ``BV_DEVCLUSTER_HOOKS`` naming a symlink that is switched to the
side's ``prolog_epilog/`` before each run, and every node's ``/etc/bluevela/python`` is
switched to a per-side venv (system site-packages plus a .pth naming the side's checkout, so
``python -I -m bluevela.hooks`` imports that checkout and not the editable install); at the
end the cluster is brought up again as it was. ``BV_BENCH_SIDE_HOOKS=0``: both sides run the
dev cluster's hooks (this checkout's shims, the installed package).
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from _common import PY, REPO, Figure, devcluster_env
from _procsample import ProcSampler

DEVCLUSTER = str(REPO / "slurm" / "devcluster")
EXAMPLE = str(REPO / "examples" / "train_ddp.py")
# BV_BENCH_CRASH_STEP (default 10: ~5 s into training, before a spare's warm parent has
# imported, issue 37): the step at which the node is crashed; the job trains 20 more.
CRASH_STEP = max(1, int(os.environ.get("BV_BENCH_CRASH_STEP", "10")))
STEPS = str(max(30, CRASH_STEP + 20))
TRAIN_ARGS = ["--steps", STEPS, "--step-s", "0.5", "--ckpt-every", "5"]


@dataclass(frozen=True)
class Script:
    """A training script the crash job runs (BV_BENCH_SCRIPT), and its lines: the crash comes
    at `crash_line`; `first` is a rank's line at its start (attempt 1's, for the launch
    figure), `resumed` a rank's after its checkpoint was loaded (group 1: the step), looked
    for after the crash only."""

    name: str
    path: str
    args: tuple[str, ...]  # after the script; {work}: the run's directory
    crash_line: str
    first: re.Pattern[str]
    resumed: re.Pattern[str]

    def argv(self, work: Path, path: str | None = None) -> list[str]:
        return [path or self.path, *(a.replace("{work}", str(work)) for a in self.args)]


SCRIPTS = {
    # bv's runtime script: it knows bv's attempt and checkpoint signal.
    "runtime": Script("runtime", EXAMPLE, ("--ckpt-dir", "{work}/ckpt", *TRAIN_ARGS),
                      f"step={CRASH_STEP} attempt=1",
                      re.compile(r"^rank=\d+ attempt=1 resumed_from_step=\d+$"),
                      re.compile(r"^rank=\d+ attempt=2 resumed_from_step=(\d+)$")),
    # A DDP script that knows nothing of bv (torchrun's environment, its own checkpoint).
    "plain": Script("plain", str(REPO / "examples" / "plain_ddp.py"),
                    ("--ckpt-dir", "{work}/ckpt", *TRAIN_ARGS), f"step={CRASH_STEP}",
                    re.compile(r"^rank=\d+ resumed_from_step=\d+ world_size="),
                    re.compile(r"^rank=\d+ resumed_from_step=(\d+) world_size=")),
    # Lightning as its docs write it (ModelCheckpoint every 5 steps, fit(ckpt_path="last")).
    "lightning": Script("lightning", str(REPO / "examples" / "byos" / "lightning_ddp.py"),
                        ("--root", "{work}/root", "--steps", STEPS, "--step-s", "0.5",
                         "--every", "5"), f"step={CRASH_STEP}",
                        re.compile(r"^rank=\d+ start_step=\d+ "),
                        re.compile(r"^rank=\d+ start_step=(\d+) ")),
    # The hang (BV_BENCH_AB_HANG=1): rank 1 sleeps for ever at the crash step of attempt 1.
    "hang": Script("hang", str(REPO / "tests" / "data" / "resilience" / "train_ckpt.py"),
                   ("--ckpt-dir", "{work}/ckpt", "--steps", STEPS, "--step-time", "0.5",
                    "--ckpt-every", "5", "--hang-rank", "1", "--hang-step", str(CRASH_STEP)),
                   f"step={CRASH_STEP}", re.compile(r"^rank=\d+ attempt=1 start_step=\d+ "),
                   re.compile(r"^rank=\d+ attempt=2 start_step=(\d+) ")),
}
SCRIPT = SCRIPTS[os.environ.get("BV_BENCH_SCRIPT") or "runtime"]
HANG_TIMEOUT_S = float(os.environ.get("BV_BENCH_HANG_TIMEOUT_S") or 5)
FIRST_RANK = SCRIPTS["runtime"].first  # benchmarks/ab_launch.py's
# The states `_job_state` gives once a job has ended (GONE: no longer known to Slurm).
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "GONE", "NODE_FAIL")
# The dev cluster's (slurm/devcluster); BV_DEVCLUSTER_* set before `up` (and kept for this
# run) give Slurm's production defaults instead: the variant that shows which paths stay flat.
SLURMD_TIMEOUT_S = int(os.environ.get("BV_DEVCLUSTER_SLURMD_TIMEOUT_S") or 30)
CRED_EXPIRE_S = int(os.environ.get("BV_DEVCLUSTER_CRED_EXPIRE_S") or 20)
PROD_SLURMD_TIMEOUT_S, PROD_CRED_EXPIRE_S = 300, 120  # Slurm's defaults


@dataclass
class Run:
    kind: str
    crash_at: float = 0.0
    phases: dict[str, float] = field(default_factory=dict)  # name -> seconds after the crash
    # name -> seconds after `bv submit` returned ("submit" itself: the command's wall time)
    start: dict[str, float] = field(default_factory=dict)
    resumed_step: int | None = None
    error: str | None = None
    job: str = ""
    # BV_BENCH_CPU=1: window ("launch", "relaunch") -> role -> CPU seconds (_procsample)
    cpu: dict[str, dict[str, float]] = field(default_factory=dict)

    @property
    def total(self) -> float:
        return self.phases.get("resumed", float("nan"))


class Tail:
    """Lines of a growing file with the time each was first seen."""

    def __init__(self, path: Path) -> None:
        self.path, self.pos, self.buf = path, 0, b""
        self.lines: list[tuple[float, str]] = []

    def poll(self) -> None:
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self.pos)
                data = fh.read()
        except FileNotFoundError:
            return
        now = time.monotonic()
        if not data and self.path.exists() and self.path.stat().st_size < self.pos:
            self.pos, self.buf = 0, b""  # truncated (an attempt's output opened anew)
            return
        self.pos += len(data)
        self.buf += data
        while b"\n" in self.buf:
            line, self.buf = self.buf.split(b"\n", 1)
            self.lines.append((now, line.decode(errors="replace")))

    def wait(self, pred: object, timeout: float, start: int = 0) -> tuple[float, str] | None:
        deadline = time.monotonic() + timeout
        i = start
        while time.monotonic() < deadline:
            self.poll()
            while i < len(self.lines):
                t, line = self.lines[i]
                i += 1
                if pred(line):  # type: ignore[operator]
                    return t, line
            time.sleep(0.05)
        return None


def _sh(env: dict[str, str], *argv: str, check: bool = True) -> str:
    proc = subprocess.run(list(argv), capture_output=True, text=True, env=env, timeout=120,
                          check=False)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{argv}: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc.stdout


def _job_state(env: dict[str, str], job: str) -> tuple[str, int]:
    out = _sh(env, "scontrol", "show", "job", "-o", job, check=False)
    state = re.search(r"JobState=(\S+)", out)
    restarts = re.search(r"Restarts=(\d+)", out)
    return (state.group(1) if state else "GONE"), int(restarts.group(1)) if restarts else 0


def _settle(env: dict[str, str], job: str, crashed: str) -> None:
    """Wait for the job to end, bring the crashed node back, all nodes idle."""
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        state, _ = _job_state(env, job)
        if state in ENDED:
            break
        time.sleep(0.5)
    else:
        _sh(env, "scancel", job, check=False)
    if crashed:
        _sh(env, PY, DEVCLUSTER, "revive", crashed, check=False)
    for n in ("node1", "node2", "node3"):
        _sh(env, "scontrol", "update", f"NodeName={n}", "State=RESUME", check=False)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        out = _sh(env, "sinfo", "-h", "-N", "-o", "%N %T", check=False)
        if all(line.split()[1] == "idle" for line in out.splitlines() if line.strip()):
            return
        time.sleep(0.5)


def _grow_site(work: Path, base: Path = REPO) -> Path:
    import yaml

    data = yaml.safe_load((base / "site.yaml").read_text())
    data.setdefault("launch", {})["grow_deadline_s"] = 30
    path = work / "site-grow.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def run_bv(env: dict[str, str], work: Path, silent: bool, spare: bool = True,
           checkout: Path | None = None, grow: bool = False, shrink: bool = False,
           example: str | None = None, script: Script = SCRIPT, hang: bool = False) -> Run:
    """One crash (`hang`: rank 1 stops at the crash step instead, and the watchdog's
    --hang-timeout ends the step; times are then from the step line it stopped after)."""
    run = Run("bv silent" if silent else "bv grow" if grow else "bv shrink" if shrink
              else "bv hang" if hang else "bv" if spare else "bv no spare")
    if hang:
        script, example = SCRIPTS["hang"], None
    if grow:
        env = {**env, "BV_SITE": str(_grow_site(work, checkout or REPO))}
    if checkout is not None:  # the submit and the job (sbatch exports it) import that checkout
        env = {**env, "PYTHONPATH": str(checkout)}
        if "BV_SITE" in env and not grow:  # an older site model rejects keys added since
            env["BV_SITE"] = str(checkout / "site.yaml")
    else:
        env = {k: v for k, v in env.items() if k != "PYTHONPATH"}
    t0 = time.monotonic()
    out = subprocess.run(
        [PY, "-m", "bluevela", "submit", "-N", "2", "--spare-nodes", "1" if spare else "0",
         *(["--min-nodes", "1"] if shrink else []), "--procs-per-node", "1",
         *(["--hang-timeout", f"{HANG_TIMEOUT_S:g}"] if hang else []),
         *script.argv(work, example)],
        capture_output=True, text=True, env=env, cwd=work, check=True).stdout
    submitted = time.monotonic()
    run.start["submit"] = submitted - t0
    job = re.search(r"job (\d+)", out)
    assert job, out
    run.job = job.group(1)
    tail = Tail(work / f"bv-{job.group(1)}.out")
    crashed = "node2"
    # BV_BENCH_CPU=1: from here on (the windows it reports begin at the attempt-1 banner)
    sampler = ProcSampler() if os.environ.get("BV_BENCH_CPU") == "1" else None
    try:
        if sampler is not None:
            sampler.start()
        reached = tail.wait(lambda s: s.strip() == script.crash_line, 180)
        if reached is None:
            run.error = f"never reached {script.crash_line}"
            return run
        for name, pred in (("job started", lambda s: s.startswith("==== bv attempt 1 job")),
                           ("first rank line", lambda s: script.first.match(s) is not None)):
            seen = next((t for t, line in tail.lines if pred(line)), None)
            if seen is not None:
                run.start[name] = seen - submitted
        banner = next(line for _, line in tail.lines if line.startswith("==== bv attempt 1 job"))
        nodes = _sh(env, "scontrol", "show", "hostnames", banner.split()[7]).split()
        if hang:  # stopped when its last step's line came; no node is lost
            run.crash_at, crashed = reached[0], ""
            n = next(i for i, (t, _) in enumerate(tail.lines) if t >= reached[0])
        else:
            crashed = nodes[1]
            run.crash_at = time.monotonic()
            _sh(env, PY, DEVCLUSTER, "crash", crashed, *(["--silent"] if silent else []))
            n = len(tail.lines)
        for name, pred in (("step ended", lambda s: s.startswith("==== bv attempt 1 ended:")),
                           ("relaunched", lambda s: s.startswith("==== bv attempt 2 job")),
                           ("resumed", lambda s: script.resumed.match(s) is not None)):
            hit = tail.wait(pred, 180, n)
            if hit is None:
                run.error = f"no '{name}'"
                return run
            run.phases[name] = hit[0] - run.crash_at
            if name == "resumed":
                m = script.resumed.match(hit[1])
                run.resumed_step = int(m.group(1)) if m else None
        tail.poll()
        _trace(run, tail, checkout)
        return run
    finally:
        if sampler is not None:
            sampler.stop()
            _cpu_windows(run, sampler, submitted)
        _settle(env, job.group(1), crashed)


def _cpu_windows(run: Run, sampler: ProcSampler, submitted: float) -> None:
    """BV_BENCH_CPU=1: CPU seconds by role in the launch (job started -> first rank line) and
    the relaunch (crash -> resumed); "busy": all cores' non-idle seconds."""
    windows = {}
    if "job started" in run.start and "first rank line" in run.start:
        windows["launch"] = (submitted + run.start["job started"],
                             submitted + run.start["first rank line"])
    if "resumed" in run.phases:
        windows["relaunch"] = (run.crash_at, run.crash_at + run.phases["resumed"])
    for name, (a, b) in windows.items():
        run.cpu[name] = {**sampler.cpu_by_role(a, b), "busy": sampler.busy(a, b)}


def _trace(run: Run, tail: Tail, checkout: Path | None) -> None:
    """With BV_BENCH_TRACE=DIR: the job's output lines up to the resumed one, each with its
    time after the crash (LOGLEVEL=INFO in the environment adds torchrun's phases)."""
    where = os.environ.get("BV_BENCH_TRACE")
    if not where:
        return
    side = checkout.name if checkout is not None else "this"
    with open(Path(where) / f"{run.job}-{side}.txt", "w") as fh:
        for t, line in tail.lines:
            fh.write(f"{t - run.crash_at:8.3f} {line}\n")


BARE = """#!/bin/bash
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output={out}
set -euo pipefail
head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
exec srun --ntasks-per-node=1 --kill-on-bad-exit=1 --export=ALL torchrun --nnodes=2 \\
  --nproc-per-node=1 --rdzv-backend=c10d --rdzv-endpoint="$head:29500" \\
  --rdzv-id="$SLURM_JOB_ID" --max-restarts=0 {script} --ckpt-dir {ckpt} {args}
"""


def _submitit(env: dict[str, str], work: Path) -> tuple[str, Path]:
    """examples/plain_ddp.py through submitit (benchmarks/_submitit_job.py): its job id and
    task 0's output file."""
    plain = SCRIPTS["plain"]
    folder = work / "submitit"
    job = subprocess.run([PY, str(Path(__file__).with_name("_submitit_job.py")), str(folder),
                          *plain.argv(work)], capture_output=True, text=True, env=env,
                         cwd=work, check=True, timeout=120).stdout.split()[-1]
    return job, folder / f"{job}_0_log.out"


def run_bare(env: dict[str, str], work: Path, submitit: bool = False) -> Run:
    """Slurm's requeue after the crash: an sbatch script's `srun torchrun` of bv's runtime
    script ("bare"), or the plain script through submitit ("submitit")."""
    run = Run("submitit" if submitit else "bare")
    script = SCRIPTS["plain" if submitit else "runtime"]
    if submitit:
        job, out = _submitit(env, work)
    else:
        out = work / "bare.out"
        text = BARE.format(out=shlex.quote(str(out)), script=shlex.quote(EXAMPLE),
                           ckpt=shlex.quote(str(work / "ckpt")), args=" ".join(TRAIN_ARGS))
        job = subprocess.run(["sbatch", "--parsable"], input=text, capture_output=True,
                             text=True, env=env, cwd=work,
                             check=True).stdout.strip().split(";")[0]
    run.job = job
    tail = Tail(out)
    crashed = "node2"
    # BV_BENCH_CPU=1: from here on (the windows it reports begin at the attempt-1 banner)
    sampler = ProcSampler() if os.environ.get("BV_BENCH_CPU") == "1" else None
    try:
        if sampler is not None:
            sampler.start()
        if tail.wait(lambda s: s.strip() == script.crash_line, 180) is None:
            run.error = f"never reached {script.crash_line}"
            return run
        nodelist = re.search(r"\sNodeList=(\S+)", _sh(env, "scontrol", "show", "job", "-o", job))
        crashed = _sh(env, "scontrol", "show", "hostnames", nodelist.group(1)).split()[1] \
            if nodelist else "node2"
        run.crash_at = time.monotonic()
        _sh(env, PY, DEVCLUSTER, "crash", crashed)
        n = len(tail.lines)
        deadline = time.monotonic() + 240
        left = again = None
        while time.monotonic() < deadline and again is None:
            state, restarts = _job_state(env, job)
            now = time.monotonic()
            if left is None and (state != "RUNNING" or restarts > 0):
                left = now
            if left is not None and state == "RUNNING" and restarts > 0:
                again = now
            time.sleep(0.1)
        if left is None or again is None:
            run.error = "not requeued"
            return run
        run.phases["job ended"] = left - run.crash_at
        run.phases["running again"] = again - run.crash_at
        hit = tail.wait(lambda s: script.resumed.match(s) is not None, 180, n)
        if hit is None:
            run.error = "no resumed line"
            return run
        run.phases["resumed"] = hit[0] - run.crash_at
        m = script.resumed.match(hit[1])
        run.resumed_step = int(m.group(1)) if m else None
        return run
    finally:
        _settle(env, job, crashed)


def _phases(runs: list[Run]) -> str:
    names = list(runs[0].phases) if runs else []
    return ", ".join(f"{k} {statistics.median(r.phases[k] for r in runs):.1f}" for k in names)


class SideHooks:
    """Each side's own node hooks on the dev cluster (BV_BENCH_SIDE_HOOKS, module docstring)."""

    def __init__(self, sides: dict[str, Path]) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="bv-bench-hooks-"))  # root's, 0700
        self.link = self.dir / "hooks"
        self.sides = sides
        self.python: dict[str, str] = {}
        for which, checkout in sides.items():
            venv = self.dir / f"venv-{which}"
            subprocess.run([PY, "-m", "venv", "--system-site-packages", "--without-pip",
                            str(venv)], check=True, capture_output=True)
            py = venv / "bin" / "python3"
            site = subprocess.run([str(py), "-I", "-c", "import sysconfig; "
                                   "print(sysconfig.get_paths()['purelib'])"],
                                  check=True, capture_output=True, text=True).stdout.strip()
            (Path(site) / "bv-bench-side.pth").write_text(f"{checkout.resolve()}\n")
            got = subprocess.run([str(py), "-I", "-c", "import bluevela.hooks, bluevela; "
                                  "print(bluevela.__file__)"], cwd="/", check=True,
                                 capture_output=True, text=True).stdout.strip()
            if not got.startswith(str(checkout.resolve()) + "/"):
                raise RuntimeError(f"the {which} hooks' python imports {got}, not {checkout}")
            self.python[which] = str(py)
        self.switch(next(iter(sides)))

    def switch(self, which: str) -> None:
        tmp = self.dir / "hooks.new"
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(self.sides[which].resolve() / "prolog_epilog")
        os.replace(tmp, self.link)
        nodes = Path(os.environ.get("BV_DEVCLUSTER_DIR", "")) / "nodes"
        for etc in sorted(nodes.glob("*/etc-bluevela")):
            new = etc / "python.new"
            new.write_text(self.python[which] + "\n")
            os.replace(new, etc / "python")

    def close(self) -> None:
        import shutil

        shutil.rmtree(self.dir, ignore_errors=True)


def _before_after(env: dict[str, str], old: Path, pairs: int,
                  hooks: SideHooks | None) -> Iterator[Figure]:
    """`bv` (spare) crash -> resumed and submit -> first rank line, old checkout and this one
    alternately (or the checkout ``BV_BENCH_NEW`` names: a commit, unaffected by edits in
    progress in this tree)."""
    new_dir = os.environ.get("BV_BENCH_NEW")
    new = Path(new_dir) if new_dir else None
    # One training script for both sides: the old checkout's (the new runtime keeps its API;
    # the new script may use calls the old runtime lacks).
    example = str(old / "examples" / "train_ddp.py") if SCRIPT.name == "runtime" else None
    runs: dict[str, list[Run]] = {"old": [], "new": []}
    grows: dict[str, list[Run]] = {"old": [], "new": []}  # BV_BENCH_AB_GROW=1
    gratios: list[float] = []
    hangs: dict[str, list[Run]] = {"old": [], "new": []}  # BV_BENCH_AB_HANG=1
    hratios: list[float] = []
    ratios: list[float] = []
    sratios: list[float] = []
    lratios: list[float] = []  # job started -> first rank line: bv's launch, no Slurm scheduling
    subs: list[Run] = []  # BV_BENCH_SUBMITIT=1: the plain script through submitit, each pair

    def launch(r: Run) -> float:
        return r.start["first rank line"] - r.start.get("job started", float("nan"))

    for i in range(pairs):
        pair = {w: r for w, r in _pair(env, old, new, example, hooks, i, grow=False).items()
                if "first rank line" in r.start}
        for which, run in pair.items():
            runs[which].append(run)
        if os.environ.get("BV_BENCH_AB_GROW") == "1":
            gpair = _pair(env, old, new, example, hooks, i, grow=True)
            for which, run in gpair.items():
                grows[which].append(run)
            if len(gpair) == 2:
                gratios.append(gpair["new"].total / gpair["old"].total)
        if os.environ.get("BV_BENCH_AB_HANG") == "1":
            hpair = _pair(env, old, new, example, hooks, i, grow=False, hang=True)
            for which, run in hpair.items():
                hangs[which].append(run)
            if len(hpair) == 2:
                hratios.append(hpair["new"].total / hpair["old"].total)
        if os.environ.get("BV_BENCH_SUBMITIT") == "1":  # after the pair, on the same cluster
            with tempfile.TemporaryDirectory(prefix="bv-bench-recovery-") as tmp:
                try:
                    srun_ = run_bare(env, Path(tmp), submitit=True)
                except (RuntimeError, subprocess.SubprocessError, OSError, ValueError) as exc:
                    srun_ = Run("submitit", error=f"{type(exc).__name__}: {exc}")
            print("recovery: submitit: " + ", ".join(f"{k} {v:.1f} s"
                                                      for k, v in srun_.phases.items())
                  + (f" (ERROR {srun_.error})" if srun_.error else ""), flush=True)
            if not srun_.error:
                subs.append(srun_)
        if len(pair) == 2:
            ratios.append(pair["new"].total / pair["old"].total)
            sratios.append(pair["new"].start["first rank line"]
                           / pair["old"].start["first rank line"])
            lratios.append(launch(pair["new"]) / launch(pair["old"]))
            print(f"recovery: pair {i + 1} new/old: crash -> resumed {ratios[-1]:.2f}, "
                  f"submit -> first rank line {sratios[-1]:.2f} (job started -> first rank "
                  f"line {launch(pair['old']):.2f} -> {launch(pair['new']):.2f} s: "
                  f"{lratios[-1]:.2f})", flush=True)

    def med(which: str, key: str) -> float:
        vals = [r.start[key] if key in r.start else r.phases.get(key, float("nan"))
                for r in runs[which]]
        return statistics.median(vals) if vals else float("nan")

    def spread(rs: list[float]) -> str:
        return (f"{len(rs)} interleaved pairs; per-pair range {min(rs):.2f}-{max(rs):.2f}"
                if rs else "no complete pair")

    for window in ("launch", "relaunch"):
        for which in ("old", "new"):
            got = [r.cpu[window] for r in runs[which] if window in r.cpu]
            if got:
                roles = sorted({k for g in got for k in g})
                print(f"recovery: {which} CPU s in the {window} (median of {len(got)}): "
                      + ", ".join(f"{k} {statistics.median(g.get(k, 0.0) for g in got):.2f}"
                                  for k in roles), flush=True)

    where = {"old": str(old), "new": str(new or "this checkout")}
    hooks_note = "each side's own hooks" if hooks is not None else "the cluster's hooks"
    for which in ("old", "new"):
        rs = runs[which]
        yield Figure(f"recovery.bv_crash_to_resumed_{which}_s", med(which, "resumed"), "s",
                     "<= 24" if which == "new" else "",
                     f"{where[which]}: median of {len(rs)}: "
                     + ", ".join(f"{r.total:.1f}" for r in rs) + "; phases: "
                     + ", ".join(f"{k} {med(which, k):.1f}" for k in ("step ended",
                                                                      "relaunched")))
        yield Figure(f"recovery.submit_to_first_rank_{which}_s",
                     med(which, "first rank line"), "s", "",
                     f"{where[which]} ({hooks_note}): median of {len(rs)}: "
                     + ", ".join(f"{r.start['first rank line']:.2f}" for r in rs)
                     + f"; job started {med(which, 'job started'):.2f} (Slurm's scheduling and "
                     f"the prologs); job started -> first rank line "
                     + (f"{statistics.median(launch(r) for r in rs):.2f}" if rs else "n/a")
                     + f"; bv submit itself {med(which, 'submit'):.2f}")
    yield Figure("recovery.bv_new_vs_old_ratio",
                 statistics.median(ratios) if ratios else float("nan"), "ratio", "<= 1.1",
                 "crash -> resumed; " + spread(ratios))
    yield Figure("recovery.submit_new_vs_old_ratio",
                 statistics.median(sratios) if sratios else float("nan"), "ratio", "<= 1.1",
                 "submit -> first rank line; " + spread(sratios))
    if gratios or any(grows.values()):
        yield Figure("recovery.grow_new_vs_old_ratio",
                     statistics.median(gratios) if gratios else float("nan"), "ratio",
                     "<= 1.1", "crash -> resumed on a grown node (no spare, the job grows); "
                     + "; ".join(f"{w}: " + ", ".join(f"{r.total:.1f}" for r in grows[w])
                                 for w in ("old", "new")) + "; " + spread(gratios))
    if hratios or any(hangs.values()):
        yield Figure("recovery.hang_new_vs_old_ratio",
                     statistics.median(hratios) if hratios else float("nan"), "ratio",
                     "<= 1.1", f"rank 1 stopped -> resumed (--hang-timeout {HANG_TIMEOUT_S:g}, "
                     "a spare); " + "; ".join(
                         f"{w}: " + ", ".join(f"{r.total:.1f} (ended {r.phases['step ended']:.1f})"
                                              for r in hangs[w]) for w in ("old", "new"))
                     + "; " + spread(hratios))
    if subs:
        total = statistics.median(r.total for r in subs)
        yield Figure("recovery.submitit_crash_to_resumed_s", total, "s", "",
                     f"examples/plain_ddp.py through submitit (Slurm's requeue), median of "
                     f"{len(subs)}: " + ", ".join(f"{r.total:.1f}" for r in subs) + "; job "
                     f"ended {statistics.median(r.phases['job ended'] for r in subs):.1f}, "
                     f"running again {statistics.median(r.phases['running again'] for r in subs):.1f}"
                     + (f"; bv (new) / submitit {med('new', 'resumed') / total:.3f}"
                        if runs["new"] else ""))
    yield Figure("recovery.launch_new_vs_old_ratio",
                 statistics.median(lratios) if lratios else float("nan"), "ratio", "",
                 "job started (attempt-1 banner) -> first rank line: supervisor, agents, "
                 "torchrun, ranks; " + spread(lratios))


def _pair(env: dict[str, str], old: Path, new: Path | None, example: str | None,
          hooks: SideHooks | None, i: int, *, grow: bool, hang: bool = False) -> dict[str, Run]:
    """One crash run by each side, in the pair's order (old first in even pairs): on a spare,
    or (`grow`) with no spare, the job growing by the free node, or (`hang`) a hung rank
    with a spare. The runs that completed."""
    kind = "grow" if grow else "hang" if hang else "bv"
    pair: dict[str, Run] = {}
    for which in (("old", "new") if i % 2 == 0 else ("new", "old")):
        if hooks is not None:
            hooks.switch(which)
        with tempfile.TemporaryDirectory(prefix="bv-bench-recovery-") as tmp:
            try:
                run = run_bv(env, Path(tmp), silent=False, spare=not grow, grow=grow,
                             checkout=old if which == "old" else new, example=example,
                             hang=hang)
            except (RuntimeError, subprocess.SubprocessError, OSError, ValueError) as exc:
                run = Run("bv" if kind == "bv" else f"bv {kind}",
                          error=f"{type(exc).__name__}: {exc}")
        print(f"recovery: pair {i + 1} {kind} ({which}, job {run.job}): crash -> " + ", ".join(
            f"{k} {v:.1f} s" for k, v in run.phases.items()) + "; submit " + ", ".join(
            f"{k} {v:.2f} s" for k, v in run.start.items())
            + (f" (ERROR {run.error})" if run.error else ""), flush=True)
        for window, roles in run.cpu.items():
            print(f"recovery: pair {i + 1} ({which}) CPU s in the {window}: " + ", ".join(
                f"{k} {v:.2f}" for k, v in sorted(roles.items(), key=lambda kv: -kv[1])),
                flush=True)
        if not run.error:
            pair[which] = run
    return pair


FIGURE_KINDS = {  # figures that need a kind's runs: left out when BV_BENCH_KINDS skips it
    "recovery.bv_crash_to_resumed_s": ("bv",), "recovery.bv_silent_crash_to_resumed_s":
    ("bv silent",), "recovery.bv_no_spare_crash_to_resumed_s": ("bv no spare",),
    "recovery.bv_grow_crash_to_resumed_s": ("bv grow",), "recovery.bv_shrink_crash_to_resumed_s":
    ("bv shrink",), "recovery.bv_grow_vs_requeue_ratio": ("bv grow", "bv no spare"),
    "recovery.bare_slurm_crash_to_resumed_s": ("bare",), "recovery.bv_to_bare_ratio":
    ("bv", "bare"), "recovery.bare_slurm_production_defaults_est_s": ("bare",),
}


def figures(args: argparse.Namespace) -> Iterator[Figure]:
    only = [k.strip() for k in os.environ.get("BV_BENCH_KINDS", "").split(",") if k.strip()]
    for fig in _figures(args):
        if not only or all(k in only for k in FIGURE_KINDS.get(fig.name, ())):
            yield fig


def _figures(args: argparse.Namespace) -> Iterator[Figure]:
    old_dir = os.environ.get("BV_BENCH_OLD")
    hooks: SideHooks | None = None
    if old_dir and os.environ.get("BV_BENCH_SIDE_HOOKS", "1") != "0":
        new_dir = os.environ.get("BV_BENCH_NEW")
        hooks = SideHooks({"old": Path(old_dir), "new": Path(new_dir) if new_dir else REPO})
        os.environ["BV_DEVCLUSTER_HOOKS"] = str(hooks.link)
    try:
        yield from _figures_on(args, old_dir, hooks)
    finally:
        if hooks is not None:  # the cluster as it was: this checkout's hooks and interpreter
            os.environ.pop("BV_DEVCLUSTER_HOOKS", None)
            subprocess.run([PY, DEVCLUSTER, "up", "--nodes", "3"], capture_output=True,
                           timeout=600, check=False, env={**os.environ, "BV_PYTHON": PY})
            hooks.close()


def _figures_on(args: argparse.Namespace, old_dir: str | None,
                hooks: SideHooks | None) -> Iterator[Figure]:
    env = devcluster_env()
    if env is None:
        yield Figure("recovery.bv_crash_to_resumed_s", float("nan"), "s", "<= 24",
                     "dev cluster unavailable (needs root and slurm/devcluster)")
        return
    if old_dir:
        if hooks is not None:
            os.environ["BV_DEVCLUSTER_DIR"] = env["BV_DEVCLUSTER_DIR"]
            hooks.switch("old")
        n_pairs = int(os.environ.get("BV_BENCH_PAIRS") or (2 if args.quick else 3))
        yield from _before_after(env, Path(old_dir), n_pairs, hooks)
        return
    rounds = 1 if args.quick else 2
    runs: dict[str, list[Run]] = {"bv": [], "bare": [], "bv silent": [], "bv no spare": [],
                                  "bv grow": [], "bv shrink": []}
    # BV_BENCH_KINDS="bv grow,bv no spare": only those (the machine is shared; each run ~1 min).
    only = [k.strip() for k in os.environ.get("BV_BENCH_KINDS", "").split(",") if k.strip()]
    kinds = [k for k in runs if (not only or k in only)
             and (k != "bare" or SCRIPT.name == "runtime")]  # bare runs the runtime script
    for _ in range(rounds):
        for kind in kinds:
            with tempfile.TemporaryDirectory(prefix="bv-bench-recovery-") as tmp:
                work = Path(tmp)
                try:
                    run = (run_bare(env, work) if kind == "bare"
                           else run_bv(env, work, silent=kind == "bv silent",
                                       spare=kind in ("bv", "bv silent"),
                                       grow=kind == "bv grow", shrink=kind == "bv shrink"))
                except (RuntimeError, subprocess.SubprocessError, OSError, ValueError) as exc:
                    run = Run(kind, error=f"{type(exc).__name__}: {exc}")
            print(f"recovery: {kind}: " + ", ".join(f"{k} {v:.1f} s" for k, v in run.phases.items())
                  + (f" (ERROR {run.error})" if run.error else ""), flush=True)
            if run.error:
                print(f"recovery: {kind} run failed: {run.error}", flush=True)
            else:
                runs[kind].append(run)
    ok = {k: v for k, v in runs.items() if v}
    med = {k: statistics.median(r.total for r in v) for k, v in ok.items()}
    bv, bare = med.get("bv", float("nan")), med.get("bare", float("nan"))
    steps = {k: sorted({r.resumed_step for r in v if r.resumed_step is not None})
             for k, v in ok.items()}
    yield Figure("recovery.bv_crash_to_resumed_s", bv, "s", "<= 24",
                 f"median of {len(ok.get('bv', []))}; phases after the crash: "
                 f"{_phases(ok.get('bv', []))}; resumed from step {steps.get('bv')}")
    yield Figure("recovery.bv_silent_crash_to_resumed_s", med.get("bv silent", float("nan")),
                 "s", "<= 24", f"link down first, detection by --node-timeout 10 s; phases: "
                 f"{_phases(ok.get('bv silent', []))}")
    yield Figure("recovery.bv_no_spare_crash_to_resumed_s", med.get("bv no spare", float("nan")),
                 "s", "", "the default (no spare, no shrink): the job lets go of the node and is "
                 "requeued at once; the requeue hold (cred_expire) remains; phases: "
                 f"{_phases(ok.get('bv no spare', []))}; with cred_expire "
                 f"{PROD_CRED_EXPIRE_S} s: ~"
                 f"{med.get('bv no spare', float('nan')) - CRED_EXPIRE_S + PROD_CRED_EXPIRE_S:.0f} s")
    grows = ok.get("bv grow", [])
    yield Figure("recovery.bv_grow_crash_to_resumed_s", med.get("bv grow", float("nan")), "s",
                 "<= 15", f"no spare, the job grows by the free node (issue 19); median of "
                 f"{len(grows)}: " + ", ".join(f"{r.total:.1f}" for r in grows)
                 + f"; phases: {_phases(grows)}; no requeue, so the same with production "
                 "cred_expire/SlurmdTimeout (neither is on its path)")
    shrinks = ok.get("bv shrink", [])
    yield Figure("recovery.bv_shrink_crash_to_resumed_s", med.get("bv shrink", float("nan")),
                 "s", "", f"--min-nodes 1; median of {len(shrinks)}: "
                 + ", ".join(f"{r.total:.1f}" for r in shrinks))
    pairs = list(zip(grows, ok.get("bv no spare", []), strict=False))
    ratios = [g.total / r.total for g, r in pairs if r.total]
    yield Figure("recovery.bv_grow_vs_requeue_ratio",
                 statistics.median(ratios) if ratios else float("nan"), "ratio", "",
                 f"{len(ratios)} interleaved rounds; per-round range "
                 + (f"{min(ratios):.2f}-{max(ratios):.2f}" if ratios else "n/a"))
    yield Figure("recovery.bare_slurm_crash_to_resumed_s", bare, "s", "",
                 f"median of {len(ok.get('bare', []))}; phases: {_phases(ok.get('bare', []))}")
    yield Figure("recovery.bv_to_bare_ratio", bv / bare if bare else float("nan"), "ratio",
                 "<= 0.4", "same job, interleaved runs, same cluster")
    if ok.get("bare"):
        ended = statistics.median(r.phases["job ended"] for r in ok["bare"])
        hold = statistics.median(r.phases["running again"] - r.phases["job ended"]
                                 for r in ok["bare"])
        start = bare - ended - hold
        prod = (ended - SLURMD_TIMEOUT_S + PROD_SLURMD_TIMEOUT_S
                + hold - CRED_EXPIRE_S + PROD_CRED_EXPIRE_S + start)
        yield Figure("recovery.bare_slurm_production_defaults_est_s", prod, "s", "",
                     f"bare phases with SlurmdTimeout {PROD_SLURMD_TIMEOUT_S} s and cred_expire "
                     f"{PROD_CRED_EXPIRE_S} s instead of {SLURMD_TIMEOUT_S}/{CRED_EXPIRE_S}; the "
                     "bv figures use neither")
