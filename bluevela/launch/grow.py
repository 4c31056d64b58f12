"""Grow a running job by one node in place of a lost one (issue 19; docs/resilience.md).

Slurm merges a second allocation into a running job when the site sets
``SchedulerParameters=permit_job_expansion``:

    salloc --no-shell -N1 --exclusive --dependency=expand:JOB ...   # job NEW, one node
    scontrol update JobId=NEW NumNodes=0                             # NEW gives its node up
    scancel NEW
    scontrol update JobId=JOB NumNodes=ALL                           # JOB takes it

The last command writes ``slurm_job_JOB_resize.sh`` (in its working directory: here a private
temporary one) with the ``SLURM_*`` variables the next ``srun`` of the job needs; the
supervisor merges them into the environment of its next step.

Pure parts (argv, parsers, the support verdict) are unit-tested; `grow()` runs the commands.
Standard library only: it runs inside the supervisor, which must not import torch or
pydantic. Talks to Slurm through its CLI with argv lists, never a shell.
"""

from __future__ import annotations

import logging
import re
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

EXPANSION_PARAM = "permit_job_expansion"
# The variables of Slurm's resize script the supervisor takes over (the rest are csh/echo).
RESIZE_VAR = re.compile(r'^export (SLURM_[A-Z_]+)="?([^"\n]*)"?\s*$', re.M)
GRANTED = re.compile(r"Granted job allocation (\d+)")
PENDING = re.compile(r"Pending job allocation (\d+)")

Runner = Callable[[Sequence[str], float, str | None], "subprocess.CompletedProcess[str]"]


def run_cli(argv: Sequence[str], timeout: float,
            cwd: str | None = None) -> subprocess.CompletedProcess[str]:
    """Run one Slurm command (argv list, no shell); a timeout reads as exit 124."""
    try:
        return subprocess.run(list(argv), capture_output=True, text=True, check=False,
                              timeout=max(1.0, timeout), cwd=cwd, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout if isinstance(exc.stdout, str) else ""
        err = exc.stderr if isinstance(exc.stderr, str) else ""
        return subprocess.CompletedProcess(list(argv), 124, out, err + " (timed out)")
    except OSError as exc:
        return subprocess.CompletedProcess(list(argv), 127, "", str(exc))


def _one_line(text: str) -> str:
    return " ".join(text.split())[:300]


# --------------------------------------------------------------------------------------------
# Pure pieces


def parse_fields(text: str) -> dict[str, str]:
    """`scontrol show job -o` / `scontrol show config` text as KEY -> value. Values may hold
    spaces only in config output (``KEY = value``); job output is ``Key=value`` words."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        if " = " in line:
            key, _, value = line.partition(" = ")
            out[key.strip()] = value.strip()
            continue
        for word in line.split():
            key, sep, value = word.partition("=")
            if sep and key not in out:
                out[key] = value
    return out


def support_problem(config: dict[str, str]) -> str | None:
    """Why this Slurm cannot grow a running job, or None when it can (as far as the config
    says: the salloc itself is the final word, and its refusal is reported as such)."""
    params = {p.strip().split("=", 1)[0] for p in config.get("SchedulerParameters", "").split(",")}
    if EXPANSION_PARAM not in params:
        return (f"this Slurm cannot grow jobs: SchedulerParameters lacks {EXPANSION_PARAM} "
                "(docs/install.md, 'Growing a job')")
    return None


def _minutes(value: str) -> int | None:
    """Slurm's [days-]hh:mm:ss as whole minutes (rounded down); None for UNLIMITED or junk."""
    m = re.fullmatch(r"(?:(\d+)-)?(?:(\d+):)?(\d+):(\d+)", value.strip())
    if m is None:
        return None
    days, hours, mins, secs = (int(g) if g else 0 for g in m.groups())
    if m.group(2) is None:  # mm:ss
        hours, mins, secs = 0, int(m.group(3)), int(m.group(4))
    return ((days * 24 + hours) * 60 + mins) + secs // 60


@dataclass(frozen=True)
class JobShape:
    """What a node added to the job must match (from `scontrol show job -o`)."""

    partition: str = ""
    account: str = ""
    qos: str = ""
    constraints: str = ""
    gres: str = ""  # per node, e.g. gres:gpu:8
    cpus_per_node: int = 0  # a shared (not exclusive) job's CPUs on each of its nodes
    mem_per_node: str = ""  # MinMemoryNode, when set
    exclusive: bool = True
    minutes_left: int | None = None  # None: no time limit
    nodes: list[str] = field(default_factory=list)


def shape_of(fields: dict[str, str]) -> JobShape:
    def val(key: str) -> str:
        v = fields.get(key, "")
        return "" if v in ("(null)", "(null)=", "N/A") else v

    limit = _minutes(val("TimeLimit"))
    run = _minutes(val("RunTime")) or 0
    left = None if limit is None else max(1, limit - run)
    # OverSubscribe=NO is what --exclusive gives; anything else: the job shares nodes.
    exclusive = val("OverSubscribe") in ("NO", "") or val("Exclusive") not in ("", "0")
    cpus, nodes = val("NumCPUs"), val("NumNodes")
    per_node = int(cpus) // int(nodes) if cpus.isdigit() and nodes.isdigit() and int(nodes) else 0
    mem = val("MinMemoryNode")
    return JobShape(partition=val("Partition"), account=val("Account"), qos=val("QOS"),
                    constraints=val("Features"), gres=val("TresPerNode"), exclusive=exclusive,
                    minutes_left=left, cpus_per_node=per_node,
                    mem_per_node="" if mem in ("", "0") else mem)


def salloc_argv(job: str, shape: JobShape, exclude: Sequence[str], deadline_s: float,
                count: int = 1) -> list[str]:
    """`count` node(s) for job `job`: same partition, account, QOS, constraints, exclusive; never a
    node in `exclude` (the lost ones, and the job's own). Drained/down nodes are never
    allocated by Slurm. --immediate bounds the wait: salloc gives up (and withdraws the
    request) when no node is free by then."""
    argv = ["salloc", "--no-shell", f"--nodes={max(1, count)}", f"--dependency=expand:{job}",
            f"--immediate={max(1, int(deadline_s))}", f"--job-name=bv-grow-{job}"]
    if shape.exclusive:
        argv.append("--exclusive")
    elif shape.cpus_per_node > 1:
        argv.append(f"--mincpus={shape.cpus_per_node}")
    if shape.mem_per_node:
        argv.append(f"--mem={shape.mem_per_node}")
    if shape.partition:
        argv.append(f"--partition={shape.partition}")
    if shape.account:
        argv.append(f"--account={shape.account}")
    if shape.qos:
        argv.append(f"--qos={shape.qos}")
    if shape.constraints:
        argv.append(f"--constraint={shape.constraints}")
    if shape.gres:
        argv.append(f"--gres={shape.gres.removeprefix('gres:').replace('gres:', '')}")
    if shape.minutes_left is not None:
        argv.append(f"--time={shape.minutes_left}")
    if exclude:
        argv.append(f"--exclude={','.join(sorted(set(exclude)))}")
    return argv


def granted_job(text: str) -> str | None:
    m = GRANTED.search(text) or PENDING.search(text)
    return m.group(1) if m else None


def parse_resize(text: str) -> dict[str, str]:
    """The SLURM_* exports of Slurm's `slurm_job_<id>_resize.sh` (values are node lists and
    counts; anything with a shell character is dropped rather than trusted)."""
    return {k: v for k, v in RESIZE_VAR.findall(text) if re.fullmatch(r"[\w\[\],.()*:-]*", v)}


# --------------------------------------------------------------------------------------------
# The Slurm steps


@dataclass
class GrowResult:
    added: list[str]  # the new node(s); empty when the grow failed
    env: dict[str, str]  # SLURM_* for the next srun (from the resize script)
    seconds: float
    why: str = ""  # the reason when `added` is empty

    @property
    def ok(self) -> bool:
        return bool(self.added)


def _expand_nodes(nodelist: str) -> list[str]:
    import hostlist

    return list(hostlist.expand_hostlist(nodelist)) if nodelist and nodelist != "(null)" else []


def grow(job: str, keep: Sequence[str], lost: Sequence[str], deadline_s: float,
         run: Runner = run_cli, count: int = 1) -> GrowResult:
    """Let go of `lost`, then add `count` node(s) to `job`; `keep` are the nodes it keeps.

    Never raises for Slurm's answers: a failed step returns a GrowResult with `why`."""
    # Slurm writes slurm_job_<id>_resize.{sh,csh} into the working directory of the
    # `scontrol update` that resizes: a private directory, not the job's.
    with tempfile.TemporaryDirectory(prefix="bv-grow-") as tmp:
        return _grow(job, keep, lost, deadline_s, run, tmp, count)


def _grow(job: str, keep: Sequence[str], lost: Sequence[str], deadline_s: float,
          run: Runner, tmp: str, count: int) -> GrowResult:
    start = time.monotonic()

    def fail(why: str) -> GrowResult:
        return GrowResult([], {}, time.monotonic() - start, why)

    cfg = run(["scontrol", "show", "config"], 30, None)
    if cfg.returncode != 0:
        return fail(f"scontrol show config: {_one_line(cfg.stderr)}")
    problem = support_problem(parse_fields(cfg.stdout))
    if problem is not None:
        return fail(problem)
    show = run(["scontrol", "show", "job", "-o", job], 30, None)
    if show.returncode != 0:
        return fail(f"scontrol show job {job}: {_one_line(show.stderr)}")
    shape = shape_of(parse_fields(show.stdout))
    if lost and keep:
        # The dead node out first: the job stays COMPLETING on it otherwise (SlurmdTimeout).
        upd = _retry(run, ["scontrol", "update", f"JobId={job}", f"NodeList={','.join(keep)}"],
                     start + deadline_s, cwd=tmp)
        if upd.returncode != 0:
            return fail(f"letting go of {','.join(lost)}: {_one_line(upd.stderr)}")
    left = deadline_s - (time.monotonic() - start)
    if left < 1:
        return fail(f"no time left of the {deadline_s:g} s deadline")
    alloc = run(salloc_argv(job, shape, [*lost, *keep], left, count), left + 15, None)
    new = granted_job(alloc.stderr + alloc.stdout)
    if alloc.returncode != 0 or new is None or "Granted" not in alloc.stderr + alloc.stdout:
        if new is not None:
            run(["scancel", new], 30, None)  # a pending request left behind
        text = _one_line(alloc.stderr or alloc.stdout) or f"exit {alloc.returncode}"
        return fail(f"no node granted in {deadline_s:g} s ({text})")
    try:
        info = parse_fields(run(["scontrol", "show", "job", "-o", new], 30, None).stdout)
        added = _expand_nodes(info.get("NodeList", ""))
        bye = _retry(run, ["scontrol", "update", f"JobId={new}", "NumNodes=0"],
                     time.monotonic() + 30, cwd=tmp)
        if bye.returncode != 0:
            return fail(f"scontrol update JobId={new} NumNodes=0: {_one_line(bye.stderr)}")
    finally:
        run(["scancel", new], 30, None)
    # On 22.05 `NumNodes=0` on the helper job already moves its node to JOB ("killing JobId=NEW
    # and moving all resources to JobId=JOB"); `NumNodes=ALL` on JOB is then only needed where
    # that did not happen, and without accounting it is refused for good ("the DB index is
    # being set"), each try costing slurmctld's 5 s wait.
    fields = parse_fields(run(["scontrol", "show", "job", "-o", job], 30, None).stdout)
    now = _expand_nodes(fields.get("NodeList", ""))
    env: dict[str, str] = {}
    if not added or not set(added) <= set(now):
        resize = Path(tmp) / f"slurm_job_{job}_resize.sh"
        resize.unlink(missing_ok=True)  # the one the shrink above wrote
        merge = _retry(run, ["scontrol", "update", f"JobId={job}", "NumNodes=ALL"],
                       start + deadline_s, cwd=tmp)
        if merge.returncode != 0:
            return fail(f"scontrol update JobId={job} NumNodes=ALL: {_one_line(merge.stderr)}")
        try:
            env = parse_resize(resize.read_text())
        except OSError:
            env = {}
        fields = parse_fields(run(["scontrol", "show", "job", "-o", job], 30, None).stdout)
        now = _expand_nodes(fields.get("NodeList", ""))
    added = [n for n in now if n not in keep]
    if not added:
        return fail("the job did not take the new node")
    env.setdefault("SLURM_JOB_NODELIST", fields.get("NodeList", ""))
    env.setdefault("SLURM_NODELIST", fields.get("NodeList", ""))
    env.setdefault("SLURM_JOB_NUM_NODES", str(len(now)))
    env.setdefault("SLURM_NNODES", str(len(now)))
    return GrowResult(added, env, time.monotonic() - start)


def _retry(run: Runner, argv: Sequence[str], until: float,
           cwd: str | None = None) -> subprocess.CompletedProcess[str]:
    """Job updates right after an allocation may be refused for a moment ("Job update not
    available right now, the DB index is being set"): retry those until `until`."""
    while True:
        proc = run(argv, 30, cwd)
        transient = "not available right now" in proc.stderr or "try again" in proc.stderr.lower()
        if proc.returncode == 0 or not transient or time.monotonic() > until:
            return proc
        time.sleep(0.5)


def readiness(deadline_s: float, run: Runner = run_cli) -> str | None:
    """For `bv site validate`: a one-line note when the site asks for growth
    (launch.grow_deadline_s > 0) that this Slurm cannot give, or None when all is well."""
    if deadline_s <= 0:
        return None
    cfg = run(["scontrol", "show", "config"], 30, None)
    if cfg.returncode != 0:
        return (f"launch.grow_deadline_s is {deadline_s:g} s, but whether Slurm can grow jobs "
                f"is unknown (scontrol show config: {_one_line(cfg.stderr) or 'failed'})")
    fields = parse_fields(cfg.stdout)
    problem = support_problem(fields)
    if problem is None:
        return None
    version = fields.get("SLURM_VERSION", "?")
    return (f"launch.grow_deadline_s is {deadline_s:g} s, but {problem} (Slurm {version}): "
            "a node lost without a spare is requeued instead")
