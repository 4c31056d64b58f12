"""The checkpoint store: a save that blocks only for staging, three tiers, a verified resume.

    from bluevela import runtime
    store = runtime.checkpoint_store("/shared/ckpt/run1")      # after init_process_group
    restored = store.load_latest()                             # None: start from scratch
    for step in range(restored.step + 1 if restored else 0, steps):
        train_step()
        if step % k == 0 or runtime.checkpoint_requested():
            store.save(step, {"model": model.state_dict(), "optim": opt.state_dict()})
    store.finalize()                                           # drain the newest, wait

`save` waits for the previous save's buffers (normally long free), copies the state into them
(`stage.Stager`) and returns; a writer thread then writes the rank's shard to the node-local
tier, sends a copy to the partner node's shard server (`partner`), and every `drain_every`-th
save, at a signalled save (bv's checkpoint request) and at `finalize` copies the verified local
file to shared storage. A node-local write that fails (a full disk, the budget) sends nothing
to the partner and drains that step to shared storage from the buffers instead.

`load_latest` takes the newest step every rank can read somewhere (`plan`), each rank from its
fastest verified place; a torn, partial or corrupt copy is skipped (the next place, then an
older step), and the summary line names every skip with its reason.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bluevela.ckpt import layout
from bluevela.ckpt.collective import Collective, default_collective
from bluevela.ckpt.partner import (
    MAX_SHARD_BYTES,
    ShardServer,
    TransferError,
    choose_partners,
    fetch_payload,
    send_shard,
)
from bluevela.ckpt.plan import (
    NodeInv,
    Place,
    World,
    candidates,
    needs_shared,
    places,
    saved_world,
)
from bluevela.ckpt.shardfile import (
    ShardError,
    ShardInfo,
    copy_verified,
    file_size,
    load_at,
    open_shard,
    write_shard,
)
from bluevela.ckpt.stage import Staged, StageError, Stager, decode
from bluevela.errors import UnsafeValueError
from bluevela.util.fs import owner_problem

logger = logging.getLogger(__name__)

LOCAL_DIR_ENV = "BV_CKPT_LOCAL_DIR"
BUDGET_ENV = "BV_CKPT_LOCAL_BUDGET_GB"


@dataclass(frozen=True)
class StoreConfig:
    """How a store keeps its steps (`from_site` fills what the script does not say).

    Attributes:
        shared_dir: the script's checkpoint directory on shared storage (None: no shared tier).
        local_dir: the node-local tier's root (None: no node-local tier, no partner copy).
        name: this checkpoint's name under both (letters, digits, '_', '-', '.').
        keep: node-local steps kept (own and partner copies each), at least 1.
        drain_every: every n-th save is drained to shared storage (0: only when signalled and
            at `finalize`).
        budget_bytes: the node-local tier's room per node, shared evenly by the node's ranks
            (None: the disk's own limit).
        partner: keep a copy on another node of the job.
        switches: node -> switch (or rail) name, where the site describes its topology.
        job: the job's id (the node-local directory's name).
    """

    shared_dir: Path | None
    local_dir: Path | None
    name: str = "ckpt"
    keep: int = 2
    drain_every: int = 0
    budget_bytes: int | None = None
    partner: bool = True
    switches: dict[str, str] = field(default_factory=dict)
    job: str = ""


@dataclass
class SaveStats:
    """What one save cost the loop and what its background phase did."""

    step: int
    wait_s: float = 0.0  # for the previous save's buffers
    stage_s: float = 0.0
    local_s: float | None = None
    partner_s: float | None = None
    drain_s: float | None = None
    bytes: int = 0

    @property
    def stall_s(self) -> float:
        return self.wait_s + self.stage_s


@dataclass
class Restored:
    """A resumed state and where it came from. Its tensors are views of the one buffer the
    shard was read into (no second copy); a shard fetched from another node is also written
    to this node's tier from that buffer, in the background until `wait()`: load them into
    the model (`load_state_dict` copies) rather than changing them in place."""

    step: int
    state: Any
    extra: dict[str, bytes]
    source: str  # this rank's place, in words
    seconds: float
    skipped: list[str]  # this rank's skips
    summary: str  # every rank's, one line (the same on every rank)
    world: int = 0  # the ranks the step was saved by (0: this job's, the same world)


class _Job:
    def __init__(self, step: int, staged: Staged, drain: bool, stats: SaveStats) -> None:
        self.step = step
        self.staged = staged
        self.drain = drain
        self.stats = stats
        self.done = threading.Event()


def _node_name() -> str:
    return socket.gethostname().split(".")[0]


class CheckpointStore:
    """One rank's side of the store (see the module docstring). Every rank of the job makes
    one with the same config; building it is a collective (the ranks exchange addresses)."""

    def __init__(self, cfg: StoreConfig, collective: Collective | None = None,
                 key: bytes | None = None, node: str | None = None) -> None:
        self.cfg = cfg
        layout.check_name(cfg.name)
        self.coll = collective or default_collective()
        self.rank, self.world = self.coll.rank, self.coll.world
        self.node = node or _node_name()
        self.stager = Stager()
        self.status: dict[int, dict[str, str]] = {}
        self.saves: list[SaveStats] = []
        self._free = threading.Semaphore(1)  # the staging buffers
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._lock = threading.Lock()
        self.server: ShardServer | None = None
        self._pending: _Job | None = None
        self._skips: list[str] = []
        self._bad: set[tuple[int, int, Place]] = set()
        self._keepers: list[threading.Thread] = []
        self.shared_reads = 0  # listings and loads of shared storage by this rank's resumes
        self._reserved = 0  # bytes of fetched shards being written to this node (`_lock`)
        # (step, rank, None or why not) of each fetched shard: kept on this node or not
        self.kept_fetched: list[tuple[int, int, str | None]] = []
        self._invs: list[NodeInv] = []
        self._shared: dict[int, frozenset[int]] = {}
        self.root = (layout.job_root(cfg.local_dir, cfg.job or "none")
                     if cfg.local_dir else None)
        if self.root is not None:
            # bv-<uid> may sit in a directory others can write (/dev/shm): it must be ours and
            # private, or another user could read or plant shards.
            ufd = layout.open_chain(self.root.parent.parent, [self.root.parent.name],
                                    create=True)
            try:
                if (why := owner_problem(os.fstat(ufd))) is not None:
                    raise UnsafeValueError(f"{self.root.parent}: {why}")
            finally:
                os.close(ufd)
            os.close(layout.open_chain(self.root.parent.parent,
                                       [self.root.parent.name, self.root.name, cfg.name],
                                       create=True))
        secret = key if key is not None else _key_from_env()
        if self.root is not None and cfg.partner:
            self.server = ShardServer(
                secret or b"", self._held_dir, self._find, self._admit, MAX_SHARD_BYTES)
        hello = {"node": self.node, "port": self.server.port if self.server else None,
                 "host": _my_addr(), "key": None if secret or self.rank else os.urandom(32).hex()}
        self.peers: list[dict[str, Any]] = self.coll.all_gather(hello)
        if secret is None:  # no bv step secret: rank 0's, over the job's own process group
            secret = bytes.fromhex(self.peers[0]["key"])
            if self.server is not None:
                self.server.key = secret
        self.key = secret
        nodes = [p["node"] for p in self.peers]
        self.partner_node = choose_partners(nodes, cfg.switches).get(self.node)
        self.partner_addr = self._partner_addr()
        self.local_ranks = sum(1 for n in nodes if n == self.node)
        self._writer = threading.Thread(target=self._write_loop, name="bv-ckpt-writer",
                                        daemon=True)
        self._writer.start()

    # -- paths -----------------------------------------------------------------------------
    def _parts(self, kind: str) -> list[str]:
        assert self.root is not None
        return [self.root.parent.name, self.root.name, self.cfg.name, kind]

    def _base(self) -> Path:
        assert self.root is not None
        return self.root.parent.parent

    def _step_fd(self, kind: str, step: int, create: bool = True) -> int:
        return layout.open_chain(self._base(), [*self._parts(kind), layout.step_dir(step)],
                                 create=create)

    def _shared_fd(self, step: int, create: bool = True) -> int:
        assert self.cfg.shared_dir is not None
        return layout.open_chain(self.cfg.shared_dir,
                                 [self.cfg.name, layout.step_dir(step)], create=create)

    def _held_dir(self, step: int) -> int:
        return self._step_fd("held", step)

    def _find(self, step: int, rank: int) -> tuple[int, str] | None:
        for kind in ("held", "own"):
            try:
                fd = self._step_fd(kind, step, create=False)
            except (OSError, ValueError):
                continue
            try:
                os.stat(layout.shard_name(rank), dir_fd=fd, follow_symlinks=False)
                return fd, layout.shard_name(rank)
            except OSError:
                os.close(fd)
        return None

    def _partner_addr(self) -> tuple[str, int] | None:
        if self.partner_node is None:
            return None
        mine = [i for i, p in enumerate(self.peers) if p["node"] == self.node]
        theirs = [i for i, p in enumerate(self.peers) if p["node"] == self.partner_node]
        if not theirs:
            return None
        peer = self.peers[theirs[mine.index(self.rank) % len(theirs)]]
        return (peer["host"], peer["port"]) if peer["port"] else None

    # -- budget ------------------------------------------------------------------------------
    def _used(self) -> int:
        return sum(e.size for kind in ("own", "held")
                   for e in layout.inventory(self._base(), self._parts(kind)))

    def _prune(self, kind: str, rank: int, keep: int) -> None:
        steps = sorted({e.step for e in layout.inventory(self._base(), self._parts(kind))
                        if e.rank == rank}, reverse=True)
        for step in steps[keep:]:
            layout.remove_step(self._base(), self._parts(kind), step, rank)

    def _admit(self, step: int, rank: int, size: int) -> str | None:
        with self._lock:
            self._prune("held", rank, self.cfg.keep - 1)
            budget = self.cfg.budget_bytes
            if budget is not None and self._used() + self._reserved + size > budget:
                self._prune("held", rank, 0)
                if self._used() + self._reserved + size > budget:
                    return f"node-local budget ({self.cfg.budget_bytes} bytes) full"
        return None

    # -- save -------------------------------------------------------------------------------
    def save(self, step: int, state: Any, *, drain: bool | None = None,
             extra: dict[str, bytes] | None = None, hold: bool = False) -> SaveStats:
        """Stage `state` and return; the writes go on in the background.

        Args:
            step: the step this state is after (steps only grow).
            state: dicts, lists, tuples, tensors, bytes, numbers and strings.
            drain: copy this step to shared storage (default: every `drain_every`-th save, or
                when bv asked for a checkpoint: `runtime.checkpoint_requested()`).
            extra: small named byte strings saved with the state (DCP's metadata).
            hold: stage only; `commit()` queues it (DCP adds its metadata in between).

        Raises:
            StageError: the state holds a value the store cannot save.
        """
        stats = SaveStats(step)
        t0 = time.monotonic()
        self._free.acquire()
        t1 = time.monotonic()
        try:
            staged = self.stager.stage(state)
        except BaseException:
            self._free.release()
            raise
        if extra:
            staged.extra.update(extra)
        t2 = time.monotonic()
        stats.wait_s, stats.stage_s = t1 - t0, t2 - t1
        _ledger("checkpoint_saved", step, started=t0)  # the stall: what the loop waited for
        stats.bytes = staged.nbytes
        self.saves.append(stats)
        if drain is None:
            drain = bool(self.cfg.drain_every and len(self.saves) % self.cfg.drain_every == 0)
            drain = drain or _bv_requested()
        self.status[step] = {"local": "pending", "partner": "pending",
                             "shared": "pending" if drain else "not drained"}
        self._pending = _Job(step, staged, drain, stats)
        if not hold:
            self.commit()
        return stats

    def commit(self, extra: dict[str, bytes] | None = None) -> None:
        """Queue the save staged with `hold=True` (adding `extra`)."""
        job = self._pending
        if job is None:
            raise RuntimeError("commit() without a held save")
        self._pending = None
        if extra:
            job.staged.extra.update(extra)
        self._queue.put(job)

    def wait(self) -> None:
        """Block until every queued save's background phase (and every node-local copy of a
        fetched shard) is over."""
        self._queue.join()
        while self._keepers:
            self._keepers.pop().join()

    def _write_loop(self) -> None:
        while True:
            job = self._queue.get()
            try:
                if job is not None:
                    self._write(job)
            except Exception as exc:  # never let the writer die: the next save must go on
                logger.warning("bv ckpt: step %s: %s", job.step if job else "?", exc)
            finally:
                self._queue.task_done()

    def _header(self, step: int, payload: int) -> dict[str, Any]:
        return {"job": self.cfg.job, "name": self.cfg.name, "step": step, "rank": self.rank,
                "world": self.world, "payload": payload, "node": self.node,
                "created": round(time.time(), 3)}

    def _write(self, job: _Job) -> None:
        started = time.monotonic()
        try:
            self._write_tiers(job)
        finally:
            self._report_background(job.step, started)

    def _report_background(self, step: int, started: float) -> None:
        """The background phase of `step` to bv's goodput ledger: off the training path, with
        the tiers this rank's shard is complete in now."""
        st = self.status.get(step, {})
        _ledger("checkpoint_background", step, started, time.monotonic(),
                [t for t in ("local", "partner", "shared") if st.get(t, "").startswith("ok")],
                rank=self.rank)

    def _write_tiers(self, job: _Job) -> None:
        st = self.status[job.step]
        staged, released = job.staged, False
        header = self._header(job.step, staged.payload_size)
        name = layout.shard_name(self.rank)
        local_ok = False
        try:
            if self.root is None:
                st["local"] = "no node-local tier"
                st["partner"] = "no node-local tier"
            else:
                t = time.perf_counter()
                try:
                    self._room_for(file_size(header))
                    fd = self._step_fd("own", job.step)
                    try:
                        write_shard(fd, name, header, staged.chunks())
                    finally:
                        os.close(fd)
                    local_ok = True
                    st["local"] = "ok"
                    job.stats.local_s = time.perf_counter() - t
                except (OSError, ValueError, _NoRoom) as exc:
                    st["local"] = f"failed: {_words(exc)}"
                    st["partner"] = "not sent: no local shard"
                    job.drain = job.drain or self.cfg.shared_dir is not None
            if local_ok:
                # The buffers are free once the local file is written: the partner copy and
                # the drain read the file.
                self._free.release()
                released = True
                self._send_partner(job, name)
            if job.drain:
                self._drain(job, name, staged if not local_ok else None)
        finally:
            if not released:
                self._free.release()

    def _fetched_room(self, size: int) -> str | None:
        """Why a fetched shard of `size` bytes cannot be kept on this node without removing
        anything (None: it fits). Call under `_lock`."""
        budget = self.cfg.budget_bytes
        if budget is None:
            return None  # the disk's own limit: a full disk fails the write, said
        share = budget // max(1, self.local_ranks)
        if size > share:
            return f"{size} bytes over this rank's node-local budget ({share} bytes)"
        if self._used() + self._reserved + size > budget:
            return f"node-local budget ({budget} bytes) full; nothing is removed for a fetch"
        return None

    def _room_for(self, size: int) -> None:
        keep = max(1, self.cfg.keep)
        with self._lock:
            self._prune("own", self.rank, keep - 1)
            budget = self.cfg.budget_bytes
            if budget is None:
                return
            share = budget // max(1, self.local_ranks)
            if size > share:
                raise _NoRoom(f"shard of {size} bytes over this rank's node-local budget "
                              f"({share} bytes)")
            if self._used() + self._reserved + size > budget:
                self._prune("own", self.rank, 0)
                if self._used() + self._reserved + size > budget:
                    raise _NoRoom(f"node-local budget ({budget} bytes) full")

    def _send_partner(self, job: _Job, name: str) -> None:
        st = self.status[job.step]
        if not self.cfg.partner:
            st["partner"] = "off"
            return
        if self.partner_addr is None:
            st["partner"] = "no other node in the job"
            return
        t = time.perf_counter()
        fd = self._step_fd("own", job.step, create=False)
        try:
            send_shard(self.partner_addr, self.key, fd, name, job.step, self.rank)
            st["partner"] = f"ok ({self.partner_node})"
            job.stats.partner_s = time.perf_counter() - t
        except TransferError as exc:
            st["partner"] = f"failed ({self.partner_node}): {exc}"
        finally:
            os.close(fd)

    def _drain(self, job: _Job, name: str, staged: Staged | None) -> None:
        st = self.status[job.step]
        if self.cfg.shared_dir is None:
            st["shared"] = "no shared tier"
            return
        t = time.perf_counter()
        try:
            dst = self._shared_fd(job.step)
            try:
                if staged is not None:
                    write_shard(dst, name, self._header(job.step, staged.payload_size),
                                staged.chunks())
                else:
                    src = self._step_fd("own", job.step, create=False)
                    try:
                        sfd = open_shard(src, name)
                    finally:
                        os.close(src)
                    try:
                        copy_verified(sfd, dst, name, expect={"step": job.step,
                                                              "rank": self.rank})
                    finally:
                        os.close(sfd)
            finally:
                os.close(dst)
            st["shared"] = "ok"
            self._mark_drained(job.step)
            job.stats.drain_s = time.perf_counter() - t
        except (OSError, ValueError, ShardError) as exc:
            st["shared"] = f"failed: {_words(exc)}"

    def _mark_drained(self, step: int) -> None:
        # Beside the node-local shard: a resume then knows shared storage may hold the step
        # without reading the file system (plan.needs_shared).
        if self.root is None:
            return
        try:
            fd = self._step_fd("own", step)
        except (OSError, ValueError):
            return
        try:
            os.close(os.open(layout.drained_name(self.rank),
                             os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                             dir_fd=fd))
        except OSError:
            pass
        finally:
            os.close(fd)

    # -- what is complete where ------------------------------------------------------------
    def complete(self) -> dict[int, list[str]]:
        """Each step's tiers that hold every rank's shard (a collective; waits for the
        background writes first)."""
        self.wait()
        everyone = self.coll.all_gather({str(s): v for s, v in self.status.items()})
        out: dict[int, list[str]] = {}
        for step in sorted(self.status):
            row = [r.get(str(step), {}) for r in everyone]
            out[step] = [tier for tier in ("local", "partner", "shared")
                         if all(v.get(tier, "").startswith("ok") for v in row)]
        return out

    def finalize(self) -> dict[int, list[str]]:
        """Drain the newest step if it was not, wait, write the shared manifest (rank 0) and
        stop serving. Returns `complete()`."""
        self.wait()
        if self.saves and self.cfg.shared_dir is not None:
            newest = max(self.status)
            if self.status[newest]["shared"] != "ok" and self.root is not None:
                job = _Job(newest, Staged(b"", [], []), True, self.saves[-1])
                started = time.monotonic()
                self._drain(job, layout.shard_name(self.rank), None)
                self._report_background(newest, started)
        done = self.complete()
        if self.rank == 0 and self.cfg.shared_dir is not None:
            for step, tiers in done.items():
                if "shared" in tiers:
                    self._write_manifest(step, tiers)
        self.close()
        return done

    def _write_manifest(self, step: int, tiers: list[str]) -> None:
        try:
            fd = self._shared_fd(step)
        except (OSError, ValueError):
            return
        try:
            from bluevela.util.fs import atomic_write_at

            body = {"step": step, "world": self.world, "name": self.cfg.name,
                    "job": self.cfg.job, "tiers": tiers}
            atomic_write_at(fd, "manifest.json", json.dumps(body).encode(), 0o644)
        except OSError as exc:
            logger.warning("bv ckpt: manifest of step %s: %s", step, exc)
        finally:
            os.close(fd)

    def close(self) -> None:
        """Wait for the queued writes, then stop serving this node's shards."""
        self.wait()
        if self.server is not None:
            self.server.close()
            self.server = None

    # -- resume ----------------------------------------------------------------------------
    def _my_inventory(self) -> NodeInv:
        addr = (_my_addr(), self.server.port) if self.server is not None else None
        if self.root is None:
            return NodeInv(self.node, addr)
        inv: dict[str, dict[int, set[int]]] = {"own": {}, "held": {}}
        drained: set[int] = set()
        for kind in inv:
            for e in layout.inventory(self._base(), self._parts(kind)):
                if e.drained:
                    drained.add(e.step)
                else:
                    inv[kind].setdefault(e.step, set()).add(e.rank)
        return NodeInv(self.node, addr, {s: frozenset(r) for s, r in inv["own"].items()},
                       {s: frozenset(r) for s, r in inv["held"].items()}, frozenset(drained))

    def _list_shared(self) -> dict[int, frozenset[int]]:
        if self.cfg.shared_dir is None:
            return {}
        self.shared_reads += 1
        out: dict[int, set[int]] = {}
        for e in layout.inventory(self.cfg.shared_dir, [self.cfg.name]):
            out.setdefault(e.step, set()).add(e.rank)
        return {s: frozenset(r) for s, r in out.items()}

    def load_latest(self, *, source_rank: int | None = None,
                    at_most: int | None = None, any_world: bool = False) -> Restored | None:
        """Resume (a collective): the newest step every rank can read, or None when there is
        none (see the module docstring). Logs and returns the summary line.

        Args:
            source_rank: every rank loads this rank's shard (a replicated state that only
                one rank saves: Lightning's checkpoint, saved on global rank 0).
            at_most: no step newer than this one (a named older checkpoint).
            any_world: a step saved by any number of ranks (a shrink or a grow: DCP's
                `StoreReader` reshards from it). The step must be complete (every shard it
                was saved with verified somewhere); rank r of this job verifies and returns
                the saved ranks r, r + world, ... (`state`: saved rank -> state; `extra`: the
                lowest of them), and `load_rank` reads any other one.
        """
        self.wait()
        t0 = time.perf_counter()
        started = time.monotonic()
        first = self.rank == min(i for i, p in enumerate(self.peers)
                                 if p["node"] == self.node)
        mine = self._my_inventory()
        gathered = self.coll.all_gather(mine.to_wire() if first else None)
        invs = [NodeInv.from_wire(g) for g in gathered if g is not None]
        need: World = self.world if source_rank is None else [source_rank]
        if any_world:
            need = None
        wanted = self.rank if source_rank is None else source_rank
        failed: set[int] = set()
        if at_most is not None:
            failed = {s for inv in invs for s in (*inv.own, *inv.held) if s > at_most}
        shared: dict[int, frozenset[int]] = {}
        listed = retry_shared = False
        skipped: list[str] = []
        all_skips: list[str] = []
        while True:
            if not listed and (retry_shared or needs_shared(invs, need, failed)):
                shared = self._gather_shared()
                if at_most is not None:
                    failed |= {s for s in shared if s > at_most}
                listed = True
            self._invs, self._shared = invs, shared
            cands = candidates(invs, need, shared, failed)
            if not cands:
                self._announce(None, [], all_skips, time.perf_counter() - t0, started)
                return None
            step = cands[0]
            if any_world:
                saved = saved_world(step, invs, shared)
                result = self._load_ranks(step, range(self.rank, saved, self.world), saved)
                mine_skips = list(self._skips)
            else:
                saved = self.world
                result = self._load_step(
                    step, places(step, wanted, self.node, invs, shared), wanted,
                    world=self.world if source_rank is None else None)
                mine_skips = [f"rank {wanted} step {step} {s}" for s in self._skips]
                if source_rank is not None and self.rank != 0:
                    mine_skips = []  # every rank tried the same shard: rank 0 says it
            ok = result is not None
            skipped += mine_skips
            outcome = self.coll.all_gather(
                {"ok": ok, "skips": mine_skips, "source": result[2] if result else None})
            all_skips += [s for o in outcome for s in o["skips"]]
            if all(o["ok"] for o in outcome) and result is not None:
                seconds = time.perf_counter() - t0
                sources = [w for o in outcome for w in (o["source"].split("; ")
                                                         if o["source"] else [])]
                summary = self._announce(step, sources, all_skips, seconds, started,
                                         saved if saved != self.world else 0)
                state, extra, source = result
                return Restored(step, state, extra, source, seconds, skipped, summary,
                                saved if any_world else 0)
            del result
            if not listed:
                retry_shared = True  # the same step again, with shared storage's copies
                continue
            failed.add(step)

    def _gather_shared(self) -> dict[int, frozenset[int]]:
        """Shared storage's steps and ranks as rank 0 lists them, the same on every rank (a
        collective: one listing of shared storage for the job)."""
        got = self.coll.all_gather({str(s): sorted(r) for s, r in self._list_shared().items()}
                                   if self.rank == 0 else None)
        return {int(s): frozenset(r) for s, r in got[0].items()}

    def _announce(self, step: int | None, sources: list[str], skips: list[str],
                  seconds: float, started: float, saved: int = 0) -> str:
        """Say how the resume ended (the summary line, logged and, on rank 0, printed): from
        `step`, or from nothing (None; a warning when copies were skipped). A resume from a
        step is recorded for the goodput ledger: one record for the job, from rank 0, with
        every shard's tier. `saved`: the ranks a resharded step was saved by. Returns the
        summary line."""
        summary = _summary(step, sources, skips, seconds, saved, self.world)
        (logger.warning if step is None and skips else logger.info)(summary)
        _say(summary, self.rank)
        if step is not None and self.rank == 0:
            tiers: dict[str, int] = {}
            for source in sources:
                tier = source.split(" ")[0]  # Place.words(): the tier first
                tiers[tier] = tiers.get(tier, 0) + 1
            _ledger("checkpoint_resumed", step, started, time.monotonic(), tiers, len(skips),
                    rank=0)
        return summary

    def load_rank(self, step: int, rank: int) -> tuple[Any, dict[str, bytes], str] | None:
        """Another rank's shard of `step` (DCP reads replicated items from the rank that
        wrote them), from the fastest verified place the last `load_latest` found; None when
        none verifies (`last_skips` says why). Not a collective."""
        return self._load_step(step, places(step, rank, self.node, self._invs, self._shared),
                               rank)

    def _load_ranks(self, step: int, ranks: range, saved: int
                    ) -> tuple[dict[int, Any], dict[str, bytes], str] | None:
        """The saved ranks `ranks` of a step saved by `saved` ranks, each verified from its
        fastest place (a resharding resume); None when one has no good copy. `_skips` names
        every skip of them."""
        states: dict[int, Any] = {}
        extra: dict[str, bytes] = {}
        sources: list[str] = []
        skips: list[str] = []
        for r in ranks:
            got = self._load_step(step, places(step, r, self.node, self._invs, self._shared),
                                  r, world=saved, seen=True)
            skips += [f"rank {r} step {step} {s}" for s in self._skips]
            if got is None:
                states.clear()
                self._skips = skips
                return None
            states[r] = got[0]
            if not sources:
                extra = got[1]
            sources.append(got[2])
        self._skips = skips
        return states, extra, "; ".join(sources)

    def _keep_fetched(self, step: int, rank: int, info: ShardInfo, payload: memoryview) -> None:
        """A node-local copy of a fetched shard (the next resume on this node reads it here),
        written by a thread of its own: the resume goes on with the bytes in memory.

        Within the node-local budget and at no other step's cost: the copy is kept only when
        it fits beside everything the tier holds (`_fetched_room`); nothing is pruned for it.
        A resume may still fall back to an older step held here, and the copy only speeds up
        a later resume on this node (the partner still holds the shard, the next save's
        `keep`/budget rules apply as usual)."""
        if self.root is None:
            return
        size = file_size(info.header)
        with self._lock:
            why = self._fetched_room(size)
            if why is None:
                self._reserved += size  # a second fetch at once counts this one
        if why is not None:
            logger.info("bv ckpt: rank %s step %s fetched, not kept on this node: %s", rank,
                        step, why)
            self.kept_fetched.append((step, rank, why))
            return

        def keep() -> None:
            try:
                fd = self._step_fd("own" if rank == self.rank else "held", step)
                try:
                    write_shard(fd, layout.shard_name(rank), info.header, [payload],
                                digest_of=lambda: bytes.fromhex(info.digest),
                                magic=info.magic)
                finally:
                    os.close(fd)
                self.kept_fetched.append((step, rank, None))
            except (OSError, ValueError) as exc:
                logger.info("bv ckpt: no node-local copy of rank %s step %s: %s", rank, step,
                            _words(exc))
                self.kept_fetched.append((step, rank, _words(exc)))
            finally:
                with self._lock:
                    self._reserved -= size

        t = threading.Thread(target=keep, name="bv-ckpt-keep", daemon=True)
        t.start()
        self._keepers.append(t)

    @property
    def last_skips(self) -> list[str]:
        return list(self._skips)

    def _load_step(self, step: int, where: list[Place], rank: int | None = None,
                   world: int | None = None, seen: bool = False
                   ) -> tuple[Any, dict[str, bytes], str] | None:
        """`rank`'s shard of `step` from the first of `where` that verifies; `world`: the
        ranks it must have been saved by (None: not checked), this job's own or (`seen`) the
        ranks of the step seen anywhere (a resharding resume)."""
        self._skips = []
        rank = self.rank if rank is None else rank
        expect = {"step": step, "rank": rank, "name": self.cfg.name}
        if world is not None:
            expect["world"] = world  # refused on its header, before its payload is read
        name = layout.shard_name(rank)
        for place in where:
            if (step, rank, place) in self._bad:
                continue  # failed in an earlier round of this resume: said once already
            try:
                if place.tier == "local":
                    fd = self._step_fd(place.kind, step, create=False)
                    try:
                        info, payload = load_at(fd, name, expect)
                    finally:
                        os.close(fd)
                elif place.tier == "partner":
                    assert place.addr is not None
                    if self.root is None:
                        raise TransferError("no node-local tier to fetch into")
                    info, payload = fetch_payload(place.addr, self.key, step, rank,
                                                  expect=expect)
                    self._keep_fetched(step, rank, info, payload)
                else:
                    self.shared_reads += 1
                    fd = self._shared_fd(step, create=False)
                    try:
                        info, payload = load_at(fd, name, expect)
                    finally:
                        os.close(fd)
                state, extra = decode(payload)
                return state, extra, place.words()
            except (ShardError, TransferError, StageError, OSError, ValueError) as exc:
                self._bad.add((step, rank, place))
                why = _words(exc)
                if isinstance(exc, ShardError) and exc.field == "world":
                    why = (f"saved by {exc.found} ranks, {world} seen" if seen else
                           f"saved by {exc.found} ranks, now {self.world} (resharding: "
                           "DCP's StoreReader)")
                self._skips.append(f"{place.words()}: {why}")
        if not where:
            self._skips.append("no copy anywhere")
        return None


class _NoRoom(Exception):
    pass


def _words(exc: BaseException) -> str:
    if isinstance(exc, ShardError):
        return exc.reason
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc) or type(exc).__name__


def _summary(step: int | None, sources: list[str], skips: list[str], seconds: float,
             saved: int = 0, world: int = 0) -> str:
    if step is None:
        head = "bv ckpt: no checkpoint to resume from"
    else:
        counts: dict[str, int] = {}
        for s in sources:
            counts[s] = counts.get(s, 0) + 1
        resharded = f" (saved by {saved} ranks, now {world})" if saved else ""
        head = (f"bv ckpt: resumed step {step}{resharded} in {seconds:.2f} s from "
                + ", ".join(f"{w} x{n}" for w, n in sorted(counts.items())))
    return head + ("; skipped: " + "; ".join(skips) if skips else "; nothing skipped")


def _say(line: str, rank: int) -> None:
    if rank == 0:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


def _my_addr() -> str:
    host = socket.gethostname()
    try:
        return socket.gethostbyname(host)
    except OSError:
        return "127.0.0.1"


def _key_from_env() -> bytes | None:
    from bluevela.protocol.keys import derive, secret_from_env

    secret = secret_from_env()
    return derive(secret, b"ckpt") if secret is not None else None


def _ledger(what: str, *args: Any, **kwargs: Any) -> None:
    """One record for bv's goodput ledger (`bluevela.runtime.heartbeat`: a signed datagram to
    the job's supervisor; nothing outside a bv job). Never raises."""
    try:
        from bluevela.runtime import heartbeat

        getattr(heartbeat, what)(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - a record must never break a save
        logger.debug("bv ckpt: no ledger record: %s", exc)


def _bv_requested() -> bool:
    # Read bv's flag without installing a handler (a plain script keeps its own signals).
    mod = sys.modules.get("bluevela.runtime.checkpoint")
    return bool(mod is not None and mod._requested.is_set())


def from_site(shared_dir: str | os.PathLike[str] | None, name: str = "ckpt",
              **overrides: Any) -> StoreConfig:
    """A config from site.yaml (this node's class: `checkpoint.dir`, `budget_gb`; the site's
    `checkpoint` keep, drain_every and switches) and the environment (`BV_CKPT_LOCAL_DIR`,
    `BV_CKPT_LOCAL_BUDGET_GB`, `SLURM_JOB_ID`), with `overrides` on top; `%n` in the
    node-local directory is this node's name. No site file: no node-local tier unless the
    environment names one."""
    values: dict[str, Any] = {"shared_dir": Path(shared_dir) if shared_dir else None,
                              "local_dir": None, "name": name,
                              "job": os.environ.get("SLURM_JOB_ID", "")}
    try:
        from bluevela.site import load_site

        site = load_site(cwd=False)
        ck = site.checkpoint
        values.update(keep=ck.keep_local, drain_every=ck.drain_every,
                      switches=ck.switch_map())
        local = site.node_class().checkpoint
        if local.dir is not None:
            values["local_dir"] = local.dir
            if local.budget_gb:
                values["budget_bytes"] = int(local.budget_gb * 1e9)
    except Exception as exc:  # no site, not in a class: the environment and the arguments
        logger.debug("bv ckpt: no site checkpoint settings: %s", exc)
    if os.environ.get(LOCAL_DIR_ENV):
        values["local_dir"] = Path(os.environ[LOCAL_DIR_ENV])
    if os.environ.get(BUDGET_ENV):
        values["budget_bytes"] = int(float(os.environ[BUDGET_ENV]) * 1e9)
    values.update(overrides)
    if values["local_dir"] is not None:
        values["local_dir"] = layout.node_dir(Path(values["local_dir"]), _node_name())
    return StoreConfig(**values)


def open_store(shared_dir: str | os.PathLike[str] | None, name: str = "ckpt",
               collective: Collective | None = None, **overrides: Any) -> CheckpointStore:
    """The store for this rank (a collective: every rank calls it), configured by `from_site`."""
    return CheckpointStore(from_site(shared_dir, name, **overrides), collective)
