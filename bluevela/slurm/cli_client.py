"""`SlurmClient` over Slurm's command-line tools; works on Slurm 22.05, 24.11, 25.11 and 26.05
(what each printed is recorded under tests/data/slurm/<release>/).

Differences handled here rather than assumed:
- `squeue --json` ignores `-j` on 22.05, so jobs are filtered here.
- 22.05's JSON has plain values (`job_state: "COMPLETED"`, `exit_code: 768` as a raw wait status);
  24.11 wraps them (`job_state: ["COMPLETED"]`, `exit_code: {"return_code": {"number": 3}}`,
  numbers as `{"set": true, "number": N}`).
- 22.05's `sacct --json` reports a normal non-zero exit as 0, so the sacct fallback parses `-P`
  text (`ExitCode` is `code:signal`).
- 24.11 keeps a resumed node's old drain reason (sinfo %E beside "idle"): a reason is read only
  for a node that is drained, down or failing.
Recorded outputs of each release tested: tests/data/slurm/<release>/ (tests/record_slurm.py).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import subprocess
import time
from collections.abc import Callable, Sequence
from typing import Any

from bluevela.errors import SlurmError, SlurmUnreachable
from bluevela.slurm.client import AttemptRecord, JobInfo, NodeInfo, ReservationInfo
from bluevela.slurm.states import JobState

logger = logging.getLogger(__name__)

DEFAULT_RETRY_S = 120.0
_UNREACHABLE = re.compile(
    r"Unable to contact slurm controller|Socket timed out|Connection refused|"
    r"Zero Bytes were transmitted|controller not responding|Communication connection failure|"
    r"Transport endpoint is not connected|Connection timed out|Slurm backup controller in standby",
    re.IGNORECASE,
)
_BUSY = re.compile(r"Resource temporarily unavailable|queue is full|EAGAIN", re.IGNORECASE)
_DUPLICATE = re.compile(r"Duplicate reservation name", re.IGNORECASE)
_NO_RESERVATION = re.compile(r"Requested reservation is invalid|Invalid reservation",
                             re.IGNORECASE)


def _num(value: Any) -> int | None:
    """A number in either JSON dialect: 5, or {"set": true, "infinite": false, "number": 5}."""
    if isinstance(value, dict):
        if not value.get("set", True) or value.get("infinite"):
            return None
        value = value.get("number")
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int | float):
        return int(value)
    return None


def _expand_nodes(expr: str) -> tuple[str, ...]:
    if not expr or expr in ("(null)", "None assigned", "None"):
        return ()
    import hostlist

    try:
        return tuple(hostlist.expand_hostlist(expr))
    except hostlist.BadHostlist as exc:
        raise SlurmError(f"cannot parse node list {expr!r} from Slurm") from exc


def _allocated_nodes(raw: dict[str, Any]) -> tuple[str, ...]:
    """The job's allocation from `squeue --json`'s job_resources, or () where it has none."""
    res = raw.get("job_resources")
    if not isinstance(res, dict):
        return ()
    alloc = res.get("nodes")
    if isinstance(alloc, dict):  # 24.11+
        alloc = alloc.get("list")
    return _expand_nodes(alloc) if isinstance(alloc, str) else ()


def _expand_stdout(pattern: str, job_id: int, user: str, name: str, first_node: str) -> str:
    """Expand sbatch filename patterns (%j %J %A %u %x %N %n %t %%) for the batch step."""
    repl = {"j": str(job_id), "J": str(job_id), "A": str(job_id), "a": "4294967294",
            "u": user, "x": name, "N": first_node, "n": "0", "t": "0", "%": "%"}
    return re.sub(r"%(\d*)([jJAauxNnt%])",
                  lambda m: repl[m.group(2)].zfill(int(m.group(1) or 0)), pattern)


def parse_squeue_job(raw: dict[str, Any]) -> JobInfo:
    """One job object of `squeue --json` (22.05 or 24.11 dialect) to JobInfo."""
    job_id = _num(raw.get("job_id"))
    if job_id is None:
        raise SlurmError("squeue --json gave a job without job_id")
    state_raw = raw.get("job_state", "UNKNOWN")
    state_name = state_raw[0] if isinstance(state_raw, list) and state_raw else str(state_raw)
    state = JobState.from_slurm(state_name)
    if state is JobState.PENDING and isinstance(state_raw, list) and "REQUEUE_HOLD" in state_raw:
        state = JobState.REQUEUE_HOLD  # 24.11+: ["PENDING", "REQUEUE_HOLD"], held until released
    exit_raw = raw.get("exit_code")
    exit_code: int | None
    signal: int | None = None
    if isinstance(exit_raw, dict):  # 24.11
        exit_code = _num(exit_raw.get("return_code"))
        sig = exit_raw.get("signal", {})
        signal = _num(sig.get("id")) if isinstance(sig, dict) else None
        if signal == 0:
            signal = None
    else:  # 22.05: raw wait status
        status = _num(exit_raw)
        if status is None:
            exit_code = None
        elif status & 0x7F:
            exit_code, signal = None, status & 0x7F
        else:
            exit_code = (status >> 8) & 0xFF
    if not state.is_terminal() and state is not JobState.COMPLETING:
        exit_code, signal = None, None
    nodes = _expand_nodes(str(raw.get("nodes") or ""))
    completing = state is JobState.COMPLETING or (
        isinstance(state_raw, list) and "COMPLETING" in state_raw)
    if completing:
        # While a job completes, `nodes` names only the nodes whose epilog has not yet ended
        # (slurmctld packs the completing bitmap): a 2-node job that ended reads "node2" once
        # node1 is done. The allocation is in job_resources (24.11+: nodes.list; 22.05: nodes).
        nodes = _allocated_nodes(raw) or nodes
    user = str(raw.get("user_name") or "")
    name = str(raw.get("name") or "")
    stdout = str(raw.get("standard_output") or "")
    if stdout:
        stdout = _expand_stdout(stdout, job_id, user, name, nodes[0] if nodes else "")
    return JobInfo(
        job_id=job_id,
        state=state,
        state_name=state.value if state is not JobState.UNKNOWN else state_name,
        exit_code=exit_code,
        signal=signal,
        nodes=nodes,
        name=name,
        user=user,
        partition=str(raw.get("partition") or ""),
        reason="" if raw.get("state_reason") in (None, "None") else str(raw["state_reason"]),
        stdout=stdout,
        work_dir=str(raw.get("current_working_directory") or ""),
        restarts=_num(raw.get("restart_cnt")) or 0,
        start_time=_num(raw.get("start_time")) or None,
        end_time=_num(raw.get("end_time")) or None,
        requeue=bool(raw.get("requeue")),
    )


def parse_sacct_line(line: str) -> JobInfo:
    """One `sacct -P -n -X -o JobIDRaw,State,ExitCode,NodeList,Partition,User,Start,End` line."""
    parts = line.split("|")
    if len(parts) < 8:
        raise SlurmError(f"cannot parse sacct line {line!r}")
    job_id_s, state_s, exit_s, nodelist, partition, user, start_s, end_s = parts[:8]
    state = JobState.from_slurm(state_s)
    code_s, _, sig_s = exit_s.partition(":")
    exit_code = int(code_s) if code_s.isdigit() else None
    signal = int(sig_s) if sig_s.isdigit() and int(sig_s) else None
    return JobInfo(
        job_id=int(job_id_s.split(".")[0].split("_")[0]),
        state=state,
        state_name=state.value if state is not JobState.UNKNOWN else state_s,
        exit_code=exit_code if state.is_terminal() else None,
        signal=signal,
        nodes=_expand_nodes(nodelist),
        partition=partition,
        user=user,
        start_time=_sacct_time(start_s),
        end_time=_sacct_time(end_s),
    )


def _sacct_time(value: str) -> int | None:
    """sacct's local `YYYY-MM-DDTHH:MM:SS` (or Unknown/None) to unix seconds."""
    try:
        return int(time.mktime(time.strptime(value, "%Y-%m-%dT%H:%M:%S")))
    except (ValueError, OverflowError):
        return None


def _attempt(n: int, info: JobInfo) -> AttemptRecord:
    return AttemptRecord(attempt=n, state=info.state, state_name=info.state_name,
                         exit_code=info.exit_code, nodes=info.nodes,
                         start_time=info.start_time, end_time=info.end_time)


def fold_history(records: list[JobInfo], live: JobInfo | None = None) -> JobInfo | None:
    """One job's completion records (oldest first, one per attempt that ended) and, when
    slurmctld still knows it, its live state, to one JobInfo: the LAST attempt's state (not the
    first record's, which after a requeue is the failed attempt), the restart count, and every
    attempt. A requeued attempt's record is named REQUEUED whatever state jobcomp wrote."""
    if live is not None:
        ended = records[: live.restarts]
        current = live
    elif records:
        ended, current = records[:-1], records[-1]
    else:
        return None
    attempts = []
    for i, rec in enumerate(ended, start=1):
        a = _attempt(i, rec)
        if rec.state.requeued_record():
            a = AttemptRecord(attempt=i, state=JobState.REQUEUED, state_name="REQUEUED",
                              exit_code=None, nodes=rec.nodes, start_time=rec.start_time,
                              end_time=rec.end_time)
        attempts.append(a)
    attempts.append(_attempt(len(ended) + 1, current))
    restarts = max(len(ended), current.restarts)
    return dataclasses.replace(current, restarts=restarts, attempts=tuple(attempts),
                               requeue=current.requeue)


class CliSlurmClient:
    """SlurmClient through sbatch/squeue/sacct/scontrol/sinfo.

    Args:
        retry_s: how long to keep retrying an unreachable controller (default from
            `$BV_SLURM_RETRY_S`, else 120 s as sbatch itself does).
        sleep: injectable for tests of the backoff.
    """

    def __init__(
        self,
        retry_s: float | None = None,
        *,
        sleep: Callable[[float], None] = time.sleep,
        command_timeout_s: float = 60.0,
    ) -> None:
        if retry_s is None:
            env = os.environ.get("BV_SLURM_RETRY_S")
            retry_s = float(env) if env else DEFAULT_RETRY_S
        self.retry_s = retry_s
        self._sleep = sleep
        self._timeout = command_timeout_s
        self._version: tuple[int, int] | None = None

    # -- plumbing ------------------------------------------------------------------------------

    def _run_once(
        self, argv: Sequence[str], *, stdin: str | None = None, cwd: str | None = None,
        timeout: float | None = None,
    ) -> subprocess.CompletedProcess[str]:
        try:
            # errors="replace": Slurm hands back whatever bytes a user typed (a drain reason
            # or a job name from a Latin-1 terminal); a strict decode would raise in here.
            return subprocess.run(
                list(argv), input=stdin, capture_output=True, text=True, errors="replace",
                cwd=cwd, timeout=timeout or self._timeout, check=False,
            )
        except FileNotFoundError as exc:
            raise SlurmError(f"{argv[0]}: command not found (is Slurm installed and on PATH?)") from exc
        except subprocess.TimeoutExpired as exc:
            raise SlurmUnreachable(f"{argv[0]} did not answer within {exc.timeout:.0f} s") from exc

    def _run(
        self, argv: Sequence[str], *, stdin: str | None = None, cwd: str | None = None,
        retry: bool = True, timeout: float | None = None,
    ) -> str:
        """Run a Slurm command; retry with backoff while the controller is unreachable or busy."""
        deadline = time.monotonic() + (self.retry_s if retry else 0.0)
        delay = 1.0
        attempt = 0
        while True:
            attempt += 1
            try:
                proc = self._run_once(argv, stdin=stdin, cwd=cwd, timeout=timeout)
            except SlurmUnreachable as exc:
                err, transient = str(exc), True
            else:
                if proc.returncode == 0:
                    return proc.stdout
                err = (proc.stderr.strip() or proc.stdout.strip() or f"exit {proc.returncode}")
                transient = bool(_UNREACHABLE.search(err) or _BUSY.search(err))
                if not transient:
                    raise SlurmError(f"{argv[0]} failed: {err.splitlines()[-1]}")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                last = err.splitlines()[-1] if err else "no answer"
                raise SlurmUnreachable(
                    f"slurmctld unreachable: {argv[0]} failed {attempt} time(s) over "
                    f"{self.retry_s:.0f} s: {last}"
                )
            logger.warning("%s: %s; retrying in %.0f s", argv[0], err.splitlines()[-1], delay)
            self._sleep(min(delay, remaining))
            delay = min(delay * 2, 16.0)

    # -- SlurmClient ---------------------------------------------------------------------------

    def version(self) -> tuple[int, int]:
        if self._version is None:
            out = self._run(["sinfo", "--version"], retry=False)
            m = re.search(r"(\d+)\.(\d+)", out)
            if not m:
                raise SlurmError(f"cannot parse Slurm version from {out.strip()!r}")
            self._version = (int(m.group(1)), int(m.group(2)))
        return self._version

    def submit(self, script: str, *, cwd: str | None = None) -> int:
        out = self._run(["sbatch", "--parsable"], stdin=script, cwd=cwd)
        first = out.strip().splitlines()[-1] if out.strip() else ""
        job_s = first.split(";")[0]
        if not job_s.isdigit():
            raise SlurmError(f"sbatch --parsable printed {out.strip()!r}, not a job id")
        return int(job_s)

    def _squeue_all(self) -> list[JobInfo]:
        out = self._run(["squeue", "--all", "--states=all", "--json"])
        try:
            data = json.loads(out)
        except json.JSONDecodeError as exc:
            raise SlurmError("squeue --json printed something that is not JSON") from exc
        return [parse_squeue_job(j) for j in data.get("jobs", [])]

    def _sacct(self, job_ids: list[int]) -> list[JobInfo]:
        """Every completion record of the jobs, oldest first (`-D`: one per attempt)."""
        fields = "JobIDRaw,State,ExitCode,NodeList,Partition,User,Start,End"
        ids = ",".join(str(j) for j in job_ids)
        base = ["sacct", "-D", "-P", "-n", "-X", "-o", fields, "-j", ids]
        try:
            out = self._run(base, retry=False)
        except SlurmError:
            # No slurmdbd: read the jobcomp/filetxt record instead.
            try:
                out = self._run([*base[:1], "-c", *base[1:]], retry=False)
            except SlurmError:
                return []
        return [parse_sacct_line(line) for line in out.splitlines() if line.strip()]

    def jobs(self, job_ids: list[int] | None = None) -> list[JobInfo]:
        live = self._squeue_all()
        if job_ids is None:
            return live
        by_id = {j.job_id: j for j in live}
        # Jobs gone from slurmctld, and requeued ones (their earlier attempts): from the
        # completion records, the last one per job winning.
        want = [j for j in job_ids if j not in by_id or by_id[j].restarts > 0]
        if want:
            records: dict[int, list[JobInfo]] = {}
            for info in self._sacct(want):
                records.setdefault(info.job_id, []).append(info)
            for j in want:
                folded = fold_history(records.get(j, []), by_id.get(j))
                if folded is not None:
                    by_id[j] = folded
        return [by_id[j] for j in job_ids if j in by_id]

    def job(self, job_id: int) -> JobInfo:
        found = self.jobs([job_id])
        if not found:
            raise SlurmError(f"job {job_id} is not known to Slurm")
        return found[0]

    def cancel(self, job_ids: list[int]) -> None:
        if job_ids:
            self._run(["scancel", *[str(j) for j in job_ids]])

    def signal_batch(self, job_id: int, signal_name: str) -> None:
        self._run(["scancel", "--batch", f"--signal={signal_name}", str(job_id)])

    def nodes(self, names: list[str] | None = None) -> list[NodeInfo]:
        argv = ["sinfo", "-h", "-N", "-o", "%N|%T|%P|%E"]
        if names:
            argv += ["-n", ",".join(names)]
        out = self._run(argv)
        merged: dict[str, NodeInfo] = {}
        for line in out.splitlines():
            parts = line.split("|", 3)
            if len(parts) < 4:
                continue
            name, state, partition, reason = parts
            partition = partition.rstrip("*")
            prev = merged.get(name)
            parts_all = (prev.partitions if prev else ()) + ((partition,) if partition else ())
            merged[name] = NodeInfo(
                name=name,
                state=_long_state(state),
                reason="" if reason == "none" or not node_reason_current(state) else reason,
                partitions=parts_all,
            )
        return list(merged.values())

    def drain(self, node: str, reason: str, *, timeout_s: float = 5.0) -> None:
        self._run(
            ["scontrol", "update", f"NodeName={node}", "State=DRAIN", f"Reason={reason}"],
            retry=False, timeout=timeout_s,
        )

    def resume(self, node: str, *, timeout_s: float = 5.0) -> None:
        self._run(["scontrol", "update", f"NodeName={node}", "State=RESUME"],
                  retry=False, timeout=timeout_s)

    def reservations(self, *, timeout_s: float = 5.0) -> list[ReservationInfo]:
        out = self._run(["scontrol", "show", "reservation", "-o"], retry=False,
                        timeout=timeout_s)
        found = (parse_reservation_line(line) for line in out.splitlines())
        return [r for r in found if r is not None]

    def create_reservation(self, name: str, node: str, *, start_in_s: int, duration_min: int,
                           flags: tuple[str, ...], timeout_s: float = 5.0) -> bool:
        argv = ["scontrol", "create", "reservation", f"ReservationName={name}",
                f"Nodes={node}", f"StartTime=now+{int(start_in_s)}",
                f"Duration={int(duration_min)}", "Users=root"]
        if flags:
            argv.append(f"Flags={','.join(flags)}")
        return _reservation_done(self._run_once(argv, timeout=timeout_s), "create", name,
                                 already=_DUPLICATE)

    def delete_reservation(self, name: str, *, timeout_s: float = 5.0) -> bool:
        return _reservation_done(
            self._run_once(["scontrol", "delete", f"ReservationName={name}"], timeout=timeout_s),
            "delete", name, already=_NO_RESERVATION)


def _reservation_done(proc: subprocess.CompletedProcess[str], verb: str, name: str, *,
                      already: re.Pattern[str]) -> bool:
    """What `scontrol create|delete reservation` answered: True done, False when Slurm says
    it is already so (`already`: the name is taken, or there is no such reservation).

    Raises:
        SlurmUnreachable: slurmctld did not answer.
        SlurmError: any other refusal, with Slurm's last line.
    """
    if proc.returncode == 0:
        return True
    err = proc.stderr.strip() or proc.stdout.strip() or f"exit {proc.returncode}"
    if already.search(err):
        return False
    if _UNREACHABLE.search(err):
        raise SlurmUnreachable(f"scontrol {verb} reservation: {err.splitlines()[-1]}")
    raise SlurmError(f"scontrol {verb} reservation {name} failed: {err.splitlines()[-1]}")


def parse_reservation_line(line: str) -> ReservationInfo | None:
    """One `scontrol show reservation -o` line (`Key=Value` words) to ReservationInfo."""
    fields: dict[str, str] = {}
    for word in line.split():
        key, sep, value = word.partition("=")
        if sep:
            fields[key] = value
    name = fields.get("ReservationName")
    if not name:
        return None
    start: float | None = None
    raw = fields.get("StartTime", "")
    try:
        # scontrol prints local time without a zone; mktime reads it back the same way.
        start = time.mktime(time.strptime(raw, "%Y-%m-%dT%H:%M:%S"))
    except (ValueError, OverflowError):
        start = None
    flags = tuple(f for f in fields.get("Flags", "").split(",") if f and f != "(null)")
    return ReservationInfo(name, _expand_nodes(fields.get("Nodes", "")), start, flags)


# sinfo %T words of a node that is neither drained nor down nor failing. 24.11 keeps the reason
# of a drained node that was resumed (sinfo %E prints it beside "idle"; 22.05 clears it): a
# reason there is history, not why the node is out, and is not read as one.
_IN_SERVICE = frozenset({"idle", "mixed", "allocated", "completing", "reserved", "planned"})


def node_reason_current(t: str) -> bool:
    """Whether a node in sinfo %T state `t` is out of service, so that its reason is current."""
    words = t.rstrip("*~#!%$@^-").lower().split("+")
    return not (words[0] in _IN_SERVICE and not any(
        w.startswith(("drain", "down", "fail", "maint")) for w in words))


def _long_state(t: str) -> str:
    """sinfo %T ('drained', 'draining', 'idle', 'down*', 'mixed+drain') to 'IDLE+DRAIN' style."""
    t = t.rstrip("*~#!%$@^-").lower()
    table = {"drained": "IDLE+DRAIN", "draining": "ALLOCATED+DRAIN", "drain": "IDLE+DRAIN"}
    if t in table:
        return table[t]
    return t.upper()


# -- one job's allocation, field by field (for growing it: bluevela/launch/grow.py) ----------
# `scontrol show job -o` prints a job's name, comment, working directory, command and output
# paths as the user gave them, spaces, `=` and field names included: a job named
# `lr = 0.1 Partition=x NodeList=y` reads there as fields it is not, and 22.05 has no
# `scontrol --json`. squeue prints exactly the fields asked for, in the order asked, one job per
# line. None of these holds user text (Slurm's own names of partitions, accounts, QOS, nodes,
# numbers and words); the one the user typed, the constraint (which Slurm checked against the
# nodes' features), is last and split off last, so even a tab in it cannot shift another field.
# The keys are `scontrol show job`'s names for the same fields.
JOB_FIELDS: tuple[tuple[str, str], ...] = (
    ("JobId", "%i"), ("JobState", "%T"), ("Partition", "%P"), ("Account", "%a"),
    ("QOS", "%q"), ("TresPerNode", "%b"), ("NumCPUs", "%C"), ("NumNodes", "%D"),
    ("TimeLimit", "%l"), ("RunTime", "%M"), ("OverSubscribe", "%h"),
    ("MinMemoryNode", "%m"), ("NodeList", "%N"), ("Features", "%f"),
)
_JOB_SEP = "\t"


def job_fields_argv(job: str) -> list[str]:
    """`squeue` for one job's JOB_FIELDS (any state squeue still knows)."""
    fmt = _JOB_SEP.join(code for _, code in JOB_FIELDS)
    return ["squeue", "-h", "-t", "all", "-j", job, "-o", fmt]


def parse_job_fields(text: str, job: str) -> dict[str, str]:
    """The output of `job_fields_argv(job)` as field name -> value; {} when squeue printed
    no line for that job (it ended and was purged) or a line that is not one."""
    for line in text.splitlines():
        parts = line.split(_JOB_SEP, len(JOB_FIELDS) - 1)
        if len(parts) == len(JOB_FIELDS) and parts[0] == job:
            return {name: value.strip() for (name, _), value in zip(JOB_FIELDS, parts, strict=True)}
    return {}


def parse_config(text: str) -> dict[str, str]:
    """`scontrol show config` (``Key = value`` lines: an admin's file, no user text)."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(" = ")
        if sep and key.strip():
            out[key.strip()] = value.strip()
    return out


def unreachable(text: str) -> bool:
    """Slurm's words for a controller that did not answer (worth a retry), or a busy one."""
    return bool(_UNREACHABLE.search(text) or _BUSY.search(text))
