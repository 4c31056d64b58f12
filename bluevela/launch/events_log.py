"""The supervisor's goodput events of one Slurm attempt (`EventLog`, as the job's user):
what it saw happen to each launch, one JSON line per event, for the ledger
(docs/resilience.md, "Where the time went: goodput events").

Per Slurm attempt it appends to ``<dir>/bv-goodput.<job>.r<restart>.u<uid>.<random>.jsonl``
(bluevela/goodput/events_dir.py: created O_EXCL|O_NOFOLLOW, mode 0600): the launch (time,
attempt, nodes), the first progress, one line per checkpoint (step, first start, last end,
rank count; the ranks' datagrams folded in memory), the step's end (kind, when the failure
happened, when it was detected, cause, lost nodes), the requeue; once per Slurm attempt the
job's submit/start time and time limit from ``squeue`` (`slurm_times`). A checkpoint
datagram is range-checked (rank, step, ages within the step's life) and its sequence number
must rise per (rank, pid), as for heartbeats. The file is bounded as the epilog reads it
(MAX_FILE_BYTES, MAX_LINES), with room kept for the lines that close a launch
(CLOSE_RESERVE); every line also goes to the step's keeper (bluevela/launch/events_copy.py).

Standard library only: the supervisor imports it.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import time
from collections.abc import Mapping
from typing import Any

from bluevela.goodput.events import (
    CLOSE_RESERVE,
    MAX_CAUSE,
    MAX_FILE_BYTES,
    MAX_LINES,
    MAX_NODES,
)
from bluevela.goodput.events_dir import create_file, events_dir
from bluevela.goodput.outcome import Loss, LossKind, StepEnd
from bluevela.launch.events_copy import CopySender
from bluevela.protocol.messages import (
    CKPT_BG_MAGIC,
    CKPT_MAGIC,
    RESUME_MAGIC,
    TIER_BITS,
    CkptBgMsg,
    CkptMsg,
    ResumeMsg,
    fresh_seq,
    parse_ckpt,
    parse_ckpt_bg,
    parse_resume,
)
from bluevela.protocol.names import safe_name
from bluevela.slurm.command import run_slurm

logger = logging.getLogger(__name__)

CKPT_WINDOW = 8  # recent saves the supervisor folds late ranks into
_CK_HEADS = tuple(f"{m} ".encode() for m in (CKPT_MAGIC, CKPT_BG_MAGIC, RESUME_MAGIC))


def slurm_times(job: str, timeout: float = 10.0) -> dict[str, float | None]:
    """Submit time, start time and time limit (s) of `job`, read once at the supervisor's
    start with ``squeue -h -j JOB -o %V|%S|%l`` (local times; a read, never an action on
    the job), each None when unknown. One try through the seam (bluevela/slurm/command.py),
    bounded by `timeout` (the first launch waits for it); never raises."""
    out: dict[str, float | None] = {"submit": None, "start": None, "time_limit_s": None}
    call = run_slurm(["squeue", "-h", "-j", job, "-o", "%V|%S|%l"], timeout_s=timeout)
    words = (call.stdout.strip().splitlines() or [""])[0].split("|")
    if not call.ok or len(words) != 3:
        return out
    for key, value in (("submit", words[0]), ("start", words[1])):
        try:
            out[key] = time.mktime(time.strptime(value.strip(), "%Y-%m-%dT%H:%M:%S"))
        except (ValueError, OverflowError):
            pass
    out["time_limit_s"] = parse_limit(words[2].strip())
    return out


def parse_limit(text: str) -> float | None:
    """Slurm's `[days-]hours:minutes:seconds` (or `minutes:seconds`, `minutes`) in seconds."""
    days, _, rest = text.rpartition("-") if "-" in text else ("0", "", text)
    parts = rest.split(":")
    try:
        nums = [int(p) for p in parts]
        d = int(days)
    except ValueError:
        return None
    if len(nums) == 3:
        h, m, s = nums
    elif len(nums) == 2:
        h, m, s = 0, nums[0], nums[1]
    elif len(nums) == 1:
        h, m, s = 0, nums[0], 0
    else:
        return None
    return float(((d * 24 + h) * 60 + m) * 60 + s)


class EventLog:
    """The supervisor's side. Every method is best-effort: an error disables the log (one
    line on stderr), never the supervisor.

    Bounded as the epilog reads (MAX_FILE_BYTES, MAX_LINES), with CLOSE_RESERVE bytes kept
    free while a launch is open: when the file is full, later saves are left out, never the
    `end` that closes the launch or the requeue. One `ckpt` line per save, not per rank: the
    ranks' datagrams of one step are folded in memory (first start, last end, rank count)
    and the line is written when the next save starts, the step ends or the job requeues
    (a 1,024 x 8-rank job: ~100 bytes per save instead of 8,192 lines)."""

    def __init__(self, fd: int | None, host: str) -> None:
        self.fd = fd
        self.host = host
        self.launch_no = 0
        self.started_mono = 0.0
        self.first_progress = False
        self.ckpts: dict[int, list[float]] = {}  # step -> [start, end, ranks], recent saves
        self.dirty: dict[int, None] = {}  # steps whose line is not written yet, in order
        self.ck_seqs: dict[tuple[int, int], int] = {}  # (rank, pid) -> last seq, this launch
        # The checkpoint store's background phases: step -> [start, end, {rank: tier bits}]
        self.bgs: dict[int, list[Any]] = {}
        self.bg_dirty: dict[int, None] = {}
        self.resumed = False  # this launch's resume line is written (the first one counts)
        self.signal_mono: float | None = None
        self.lines = 0
        self.bytes = 0
        self.open_launch = False  # a launch line is written and its end not yet
        self.skipping = False  # this launch's line did not fit: its events are left out
        self.full_logged = False
        # The copy on a second node (`CopySender`): every line written, in order, and the
        # current step's keeper agent's channel.
        self.written: list[bytes] = []
        self.copy: CopySender | None = None

    @classmethod
    def open(cls, env: Mapping[str, str], host: str, *, query: bool = True) -> EventLog:
        job, restart = env.get("SLURM_JOB_ID", ""), env.get("SLURM_RESTART_COUNT") or "0"
        if not job.isdigit() or not restart.isdigit() or len(job) > 12 or len(restart) > 5:
            return cls(None, host)
        name = f"bv-goodput.{job}.r{int(restart)}.u{os.getuid()}.{secrets.token_hex(8)}.jsonl"
        fd = None
        try:
            fd = create_file(env, name)
        except OSError as exc:
            logger.warning("no goodput events: cannot create %s in %s: %s", name,
                           events_dir(env), exc.strerror or exc)
        log = cls(fd, host)
        info: dict[str, Any] = {"e": "job", "t": time.time(), "host": host, "job": int(job),
                                "restart": int(restart)}
        if query and fd is not None:
            info.update(slurm_times(job))
        log._write(info)
        return log

    def _write(self, rec: dict[str, Any], *, closing: bool = False) -> bool:
        """Append one line; False when it was left out (no file, or no room for it)."""
        if self.fd is None:
            return False
        data = json.dumps(rec, separators=(",", ":")).encode() + b"\n"
        # A line that opens or fills a launch leaves room for the lines that close it.
        room = MAX_FILE_BYTES - (0 if closing else CLOSE_RESERVE)
        if self.bytes + len(data) > room or self.lines + (1 if closing else 3) > MAX_LINES:
            if not self.full_logged:
                self.full_logged = True
                logger.warning("goodput events full (%d lines, %d bytes): later %s events "
                               "are left out", self.lines, self.bytes, rec.get("e"))
            return False
        try:
            os.write(self.fd, data)
        except OSError as exc:
            logger.warning("goodput events stopped: %s", exc.strerror or exc)
            self.close()
            return False
        self.lines += 1
        self.bytes += len(data)
        self.written.append(data)
        if self.copy is not None:
            self.copy.pump(self.written)
        return True

    def attach(self, chan: Any) -> None:
        """Stream every line, the ones written so far first, to this step's keeper agent
        over its signed channel (`protocol.channel.Channel`): the copy its node's epilog reads when the
        supervisor's own node dies (`CopyWriter`). A later step's keeper replaces it."""
        if self.fd is None:
            return
        self.copy = CopySender(chan)
        self.copy.pump(self.written)

    def pump(self) -> None:
        """Send more of the copy's backlog (the supervisor's tick): the channel is fed at most
        COPY_OUT_MAX bytes ahead of what the socket took, so a long backlog never breaks it."""
        if self.copy is not None:
            self.copy.pump(self.written)

    def close(self) -> None:
        self._flush_ckpts()
        if self.fd is not None:
            try:
                os.close(self.fd)
            except OSError:
                pass
            self.fd = None

    @staticmethod
    def wall(mono: float) -> float:
        return time.time() - (time.monotonic() - mono)

    def launch(self, attempt: int, launch: int, nodes: list[str], spares: int,
               started_mono: float) -> None:
        self._flush_ckpts()
        self.launch_no = launch
        self.started_mono = started_mono
        self.first_progress = False
        self.ckpts, self.dirty, self.ck_seqs = {}, {}, {}
        self.bgs, self.bg_dirty, self.resumed = {}, {}, False
        self.skipping = not self._write({
            "e": "launch", "t": self.wall(started_mono), "attempt": attempt, "launch": launch,
            "n_nodes": len(nodes), "nodes": nodes[:MAX_NODES], "spares": spares})
        self.open_launch = not self.skipping

    def progress(self, mono: float) -> None:
        if not self.first_progress:
            self.first_progress = True
            if not self.skipping:
                self._write({"e": "progress", "t": self.wall(mono), "launch": self.launch_no})

    def datagram(self, data: bytes, key: bytes, max_ranks: int, now_mono: float) -> bool:
        """Record a checkpoint datagram of this step (a save's stall, its background phase,
        a resume); True when it was one (valid or not). A datagram whose sequence number is
        not above the last one of its (rank, pid) is a replay and changes nothing (as for
        heartbeats; the three kinds share one sequence)."""
        if not data.startswith(_CK_HEADS):
            return False
        msg = (parse_ckpt(data, key) if data.startswith(_CK_HEADS[0])
               else parse_ckpt_bg(data, key) if data.startswith(_CK_HEADS[1])
               else parse_resume(data, key))
        life = now_mono - self.started_mono + 5
        if msg is None or msg.rank >= max_ranks or msg.start_age_s > life:
            return True
        if not fresh_seq(self.ck_seqs, (msg.rank, msg.pid), msg.seq, 4 * max_ranks):
            return True  # a replayed or reordered datagram
        now = time.time()
        if not isinstance(msg, CkptMsg):
            self._store_event(msg, now - msg.start_age_s, now - msg.end_age_s)
            return True
        start, end = now - msg.start_age_s, now - msg.end_age_s
        have = self.ckpts.get(msg.step)
        if have is not None:  # another rank's save of the same step: one save, widest span
            have[0], have[1], have[2] = min(have[0], start), max(have[1], end), have[2] + 1
        else:
            self._flush_ckpts()  # a new save: the ones before it are complete
            self.ckpts[msg.step] = [start, end, 1]
            while len(self.ckpts) > CKPT_WINDOW:  # a late rank of an older save: a 2nd line
                del self.ckpts[next(iter(self.ckpts))]
        self.dirty[msg.step] = None
        return True

    def _store_event(self, msg: CkptBgMsg | ResumeMsg, start: float, end: float) -> None:
        """The checkpoint store's records: a save's background phase folded per step as the
        stalls are (widest span; each rank's latest tiers), written when the next step's
        comes or the step ends; the launch's first resume written at once."""
        if isinstance(msg, ResumeMsg):
            if not self.resumed and not self.skipping:
                self.resumed = True
                self._write({"e": "resume", "launch": self.launch_no, "step": msg.step,
                             "t0": round(start, 3), "t1": round(end, 3), "local": msg.local,
                             "partner": msg.partner, "shared": msg.shared,
                             "skipped": msg.skipped})
            return
        have = self.bgs.get(msg.step)
        if have is not None:
            have[0], have[1] = min(have[0], start), max(have[1], end)
            have[2][msg.rank] = have[2].get(msg.rank, 0) | msg.tiers
        else:
            self._flush_bgs()
            self.bgs[msg.step] = [start, end, {msg.rank: msg.tiers}]
            while len(self.bgs) > CKPT_WINDOW:
                del self.bgs[next(iter(self.bgs))]
        self.bg_dirty[msg.step] = None

    def _flush_ckpts(self) -> None:
        """One line per save changed since its last line (its stall; its background phase)."""
        for step in list(self.dirty):
            c = self.ckpts.get(step)
            if c is not None and not self.skipping:
                self._write({"e": "ckpt", "launch": self.launch_no, "step": step,
                             "t0": round(c[0], 3), "t1": round(c[1], 3), "ranks": int(c[2])})
        self.dirty = {}
        self._flush_bgs()

    def _flush_bgs(self) -> None:
        for step in list(self.bg_dirty):
            b = self.bgs.get(step)
            if b is not None and not self.skipping:
                tiers = b[2].values()
                self._write({"e": "ckpt_bg", "launch": self.launch_no, "step": step,
                             "t0": round(b[0], 3), "t1": round(b[1], 3), "ranks": len(b[2]),
                             **{t: sum(1 for v in tiers if v & bit)
                                for t, bit in TIER_BITS.items()}})
        self.bg_dirty = {}

    def signal(self, mono: float) -> None:
        if self.signal_mono is None:
            self.signal_mono = mono

    def step_ended(self, kind: StepEnd, cause: str, lost: Mapping[str, Loss],
                   failed_mono: float | None, detected_mono: float | None, gone_mono: float,
                   *, hung: str | None = None) -> None:
        """The step's end: how it ended, the words the job output shows (`cause`), each lost
        node with its `LossKind` (the ledger reads the kinds, never the words) and `hung`,
        the node of the rank a hang stopped first. For a signal the failure and its
        detection are the signal."""
        self._flush_ckpts()
        if kind.by_signal and self.signal_mono is not None:
            failed_mono = detected_mono = max(self.signal_mono, self.started_mono)
        failed = self.wall(failed_mono) if failed_mono is not None else None
        detected = self.wall(detected_mono) if detected_mono is not None else None
        if self.skipping:
            return
        names = [n for n in sorted(lost) if safe_name(n) == n][:MAX_NODES]
        kinds = {hung: LossKind.HUNG.value} if hung is not None and safe_name(hung) == hung \
            else {}
        kinds.update((n, lost[n].kind.value) for n in names)
        self._write({"e": "end", "launch": self.launch_no, "kind": kind.value,
                     "cause": cause[:MAX_CAUSE], "nodes": names, "loss_kinds": kinds,
                     "failed": failed, "detected": detected, "gone": self.wall(gone_mono)},
                    closing=True)
        self.open_launch = False

    def grown(self, helper: str, nodes: list[str]) -> None:
        """Nodes that joined the job from a helper job (bluevela/launch/grow.py): their prolog
        ran under the helper's id, and the archive gives it to this job (archive/query.py)."""
        names = [n for n in nodes if safe_name(n) == n][:MAX_NODES]
        if helper.isdigit() and len(helper) <= 12 and int(helper) > 0 and names:
            self._write({"e": "grow", "t": time.time(), "helper": int(helper), "nodes": names})

    def requeue(self) -> None:
        self._flush_ckpts()
        self._write({"e": "requeue", "t": time.time()}, closing=True)
