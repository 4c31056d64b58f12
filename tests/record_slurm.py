"""Record what a real Slurm prints, for the parsing tests (tests/slurm/test_slurm_releases.py).

With a dev cluster up on the release to record (``slurm/devcluster up --slurm 24.11``)::

    eval "$(slurm/devcluster env)"; python3 -m tests.record_slurm

submits a few jobs that end (or stand) in the states bv reads, then writes what the real
daemons print about them to ``tests/data/slurm/<major.minor>/``: ``squeue --json`` (what
CliSlurmClient parses), ``sacct -c`` lines (the jobcomp record of a job slurmctld forgot),
``scontrol show config``, the grow path's ``squeue -o`` fields and ``scontrol show job -o``,
``scontrol show reservation -o`` and ``sinfo`` of a drained node, then of it resumed. ``jobs.json`` names each job
by its role and says what it is (the tests assert these facts). Overwrites the release's folder.

``python3 -m tests.record_slurm --completing`` records, into the same folder and touching nothing
else there, ``squeue --json`` of a 2-node job that has ended while one node's epilog has not
(that node's slurmd is stopped with SIGSTOP meanwhile, then continued): ``squeue-completing.json``
and ``completing.json`` (the job, its allocation, the node still completing).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bluevela.slurm.cli_client import job_fields_argv

DATA = Path(__file__).resolve().parent / "data" / "slurm"
SACCT_FIELDS = "JobIDRaw,State,ExitCode,NodeList,Partition,User,Start,End"
HOSTILE_NAME = "x'y $(id)"


def sh(*argv: str, stdin: str | None = None, check: bool = True) -> str:
    proc = subprocess.run(list(argv), input=stdin, capture_output=True, text=True, timeout=60,
                          check=False)
    if check and proc.returncode != 0:
        raise SystemExit(f"record_slurm: {' '.join(argv)}: {proc.stderr.strip()}")
    return proc.stdout


def submit(workdir: Path, script: str, *opts: str) -> int:
    out = sh("sbatch", "--parsable", f"--chdir={workdir}", *opts, stdin=f"#!/bin/sh\n{script}\n")
    return int(out.strip().split(";")[0])


def state(job: int) -> str:
    return sh("squeue", "-h", "-t", "all", "-j", str(job), "-o", "%T", check=False).strip()


def wait_state(job: int, wanted: set[str], timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while (now := state(job)) not in wanted:
        if time.monotonic() > deadline:
            raise SystemExit(f"record_slurm: job {job} is {now!r}, not {sorted(wanted)}")
        time.sleep(0.5)


def _release_dir() -> tuple[str, Path]:
    version = sh("sinfo", "--version").strip()
    m = re.search(r"(\d+)\.(\d+)", version)
    if m is None:
        raise SystemExit(f"record_slurm: cannot read the release from {version!r}")
    out = DATA / f"{int(m.group(1))}.{int(m.group(2)):02d}"
    out.mkdir(parents=True, exist_ok=True)
    return version, out


def _slurmd_pid(node: str) -> int:
    """The node's slurmd, from the dev cluster's pid file (slurm/devcluster env names it)."""
    state = os.environ.get("BV_DEVCLUSTER_DIR")
    if not state:
        raise SystemExit("record_slurm: --completing needs the dev cluster's environment "
                         "(eval \"$(slurm/devcluster env)\")")
    return int((Path(state) / "run" / f"slurmd.{node}.pid").read_text().split()[0])


def record_completing() -> int:
    """A 2-node job that ended on node1 and node2 while node2's slurmd (so its epilog's end)
    is stopped: slurmctld holds the job COMPLETING on node2 alone."""
    version, out = _release_dir()
    work = Path(tempfile.mkdtemp(prefix="bv-record-"))
    job = submit(work, "sleep 3", "-N2", "-w", "node1,node2", "--job-name=completing")
    wait_state(job, {"RUNNING"})
    pid = _slurmd_pid("node2")
    os.kill(pid, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 30
        while True:
            text = sh("squeue", "--all", "--states=all", "--json", "-j", str(job))
            raw = json.loads(text)["jobs"][0]
            st = raw["job_state"]
            if raw.get("nodes") == "node2" and (st == "COMPLETING" or "COMPLETING" in st):
                break
            if time.monotonic() > deadline:
                raise SystemExit(f"record_slurm: job {job} never stood completing on node2 "
                                 f"alone ({st}, {raw.get('nodes')!r})")
            time.sleep(0.3)
    finally:
        os.kill(pid, signal.SIGCONT)
    wait_state(job, {"COMPLETED"})
    manifest = {"_source": f"tests/record_slurm.py --completing on the dev cluster, {version}, "
                f"{time.strftime('%Y-%m-%d', time.gmtime())}",
                "job": job, "allocated": ["node1", "node2"], "completing": ["node2"]}
    (out / "squeue-completing.json").write_text(text)
    (out / "completing.json").write_text(json.dumps(manifest, indent=1) + "\n")
    print(f"record_slurm: squeue-completing.json, completing.json in {out}")
    return 0


def main() -> int:
    if sys.argv[1:] == ["--completing"]:
        return record_completing()
    version, out = _release_dir()
    work = Path(tempfile.mkdtemp(prefix="bv-record-"))
    jobs = {
        "completed": submit(work, "true", "-N2", f"--job-name={HOSTILE_NAME}", "-o", "bv-%j.out"),
        "failed3": submit(work, "exit 3", "-N1", "--job-name=fail3"),
        "cancelled": submit(work, "sleep 300", "-N1", "--job-name=killed",
                            "-o", "out-%x-%3j.txt"),
        "requeued": submit(work, "sleep 300", "-N1", "--job-name=requeued", "--requeue"),
        "held": submit(work, "true", "-N1", "--job-name=held", "--hold"),
        "running": submit(work, "sleep 300", "-N1", "--job-name=running"),
    }
    wait_state(jobs["completed"], {"COMPLETED"})
    wait_state(jobs["failed3"], {"FAILED"})
    for role in ("cancelled", "requeued", "running"):
        wait_state(jobs[role], {"RUNNING"})
    sh("scancel", str(jobs["cancelled"]))
    wait_state(jobs["cancelled"], {"CANCELLED"})
    sh("scontrol", "requeue", str(jobs["requeued"]))
    wait_state(jobs["requeued"], {"PENDING"})
    sh("scontrol", "hold", str(jobs["requeued"]))  # stays pending, restart count 1
    time.sleep(1)
    files = {
        "version.txt": version + "\n",
        "squeue.json": sh("squeue", "--all", "--states=all", "--json"),
        "sacct-c.txt": sh("sacct", "-c", "-D", "-P", "-n", "-X", "-o", SACCT_FIELDS, "-j",
                          ",".join(str(j) for j in jobs.values()), check=False),
        "show-config.txt": sh("scontrol", "show", "config"),
        "squeue-fields.txt": sh(*job_fields_argv(str(jobs["running"]))),
        "show-job-o.txt": sh("scontrol", "show", "job", "-o", str(jobs["running"])),
    }
    node = sh("squeue", "-h", "-j", str(jobs["running"]), "-o", "%N").strip()
    idle = next(n for n in ("node1", "node2", "node3") if n != node)
    sh("scontrol", "create", "reservation", "ReservationName=bv-drain-rec", f"Nodes={idle}",
       "StartTime=now+60", "Duration=5", "Users=root", "Flags=MAINT,IGNORE_JOBS")
    files["show-reservation-o.txt"] = sh("scontrol", "show", "reservation", "-o")
    sh("scontrol", "delete", "ReservationName=bv-drain-rec")
    sh("scontrol", "update", f"NodeName={idle}", "State=DRAIN", "Reason=bv: recorded drain")
    files["sinfo-nodes.txt"] = sh("sinfo", "-h", "-N", "-o", "%N|%T|%P|%E")
    sh("scontrol", "update", f"NodeName={idle}", "State=RESUME")
    deadline = time.monotonic() + 20
    while "drain" in sh("sinfo", "-h", "-N", "-n", idle, "-o", "%T") and \
            time.monotonic() < deadline:
        time.sleep(0.5)
    time.sleep(2)  # the node registers again after a resume
    files["sinfo-resumed.txt"] = sh("sinfo", "-h", "-N", "-o", "%N|%T|%P|%E")
    sh("scancel", *(str(j) for j in jobs.values()))
    manifest = {"_source": f"tests/record_slurm.py on the dev cluster, {version}, "
                f"{time.strftime('%Y-%m-%d', time.gmtime())}; workdir {work}",
                "workdir": str(work), "hostile_name": HOSTILE_NAME, "jobs": jobs,
                "running_node": node, "drained_node": idle}
    files["jobs.json"] = json.dumps(manifest, indent=1) + "\n"
    for name, text in files.items():
        (out / name).write_text(text)
    print(f"record_slurm: {len(files)} files in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
