"""The sampler's segment store: `<state>/samples/seg-<unix_start>.bvts`, kept within its bounds.

Records go to the open segment (`format.SegmentWriter`); a new one is opened on the hour, at
every start, when the column set or the component labels change, and when the clock steps
back (records of a segment are in time order). Before a new segment is opened the directory
is pruned: a killed start's `.seg-*.tmp` once a minute old, segments dated in the future
(written under a wrong clock), then those older than the retention, then the oldest while
the directory is over its size bound; never the segment being written.

A write that fails (ENOSPC) closes the segment, unlinks it when it holds no record, and the
next attempts back off (1, 2, 4 ... `MAX_BACKOFF_TICKS` intervals) until one succeeds; the
loop asks `backing_off(now)` before it samples. Standard library only.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Sequence
from pathlib import Path

from bluevela.telemetry.format import (
    TMP_SEGMENT_RE,
    Column,
    FormatError,
    Header,
    SegmentWriter,
    list_segments,
    probe_file,
)

logger = logging.getLogger(__name__)

# Slack before a segment counts as dated in the future (written under a wrong clock).
FUTURE_SLACK_S = 60.0
# The longest pause between write attempts while the disk is full, in intervals.
MAX_BACKOFF_TICKS = 32
# How old a killed start's temporary segment must be before it goes (a start may be under way).
STALE_TMP_S = 60.0


class SegmentStore:
    """The segments of one node's samples directory and the one being written.

    Args:
        directory: `<state>/samples` (created 0750 at the first segment).
        node, interval_s: what every segment's header records.
        retain_s: segments that ended longer ago than this go.
        max_bytes: the oldest go while the directory is larger than this.
    """

    def __init__(self, directory: Path, node: str, interval_s: float, retain_s: float,
                 max_bytes: int) -> None:
        self.directory = directory
        self.node = node
        self.interval_s = interval_s
        self.retain_s = retain_s
        self.max_bytes = max_bytes
        self.writer: SegmentWriter | None = None
        self._hour: int | None = None
        self._last_t = -math.inf
        self.write_failures = 0  # consecutive failed writes (a full disk)
        self._retry_at = -math.inf

    def append(self, now: float, columns: tuple[Column, ...],
               components: dict[str, dict[str, str]], values: Sequence[float]) -> None:
        """One record at `now`, in a new segment when it must roll.

        Raises:
            OSError: the segment could not be opened or the record written (see `write_failed`).
        """
        hour = int(now // 3600)
        w = self.writer
        if w is not None and now < self._last_t:
            logger.warning("the clock stepped back %.1f s: a new segment", self._last_t - now)
            w = None
        if w is None or hour != self._hour or w.header.columns != columns \
                or w.header.components != components:
            self._roll(now, columns, components)
            self._hour = hour
        assert self.writer is not None
        self.writer.append(now, values)
        self._last_t = now

    def _roll(self, now: float, columns: tuple[Column, ...],
              components: dict[str, dict[str, str]]) -> None:
        self.close()
        # Room first: on a full disk the old segments past their bounds must go before a new
        # file is asked for.
        self.prune(now)
        self.directory.mkdir(mode=0o750, parents=True, exist_ok=True)
        start = int(now)
        while (self.directory / f"seg-{start}.bvts").exists():
            start += 1  # a restart within the same second: never append to an old segment
        header = Header(self.node, self.interval_s, columns, float(now), components)
        self.writer = SegmentWriter(self.directory / f"seg-{start}.bvts", header)

    def close(self, *, failed: bool = False) -> None:
        """Close the open segment (fsync'd unless `failed`; a failed one with no record is
        unlinked: a header alone is nothing to keep)."""
        w, self.writer = self.writer, None
        if w is None:
            return
        w.close(sync=not failed)
        if failed and w.records == 0:
            try:
                os.unlink(w.path)
            except OSError:
                pass

    # -- a full disk ----------------------------------------------------------------------

    def backing_off(self, now: float) -> bool:
        """True while the next attempt after failed writes is not due yet."""
        return now < self._retry_at

    def write_failed(self, now: float, exc: OSError) -> None:
        """A record not written: close what was opened and wait 1, 2, 4 ... intervals."""
        self.close(failed=True)
        self.write_failures += 1
        ticks = min(2 ** (self.write_failures - 1), MAX_BACKOFF_TICKS)
        self._retry_at = now + (ticks - 0.5) * self.interval_s
        if self.write_failures == 1:
            logger.error("sample not written: %s; trying again in %d interval(s), backing "
                         "off to %d while it fails", exc, ticks, MAX_BACKOFF_TICKS)
        else:
            logger.debug("sample not written (%d in a row): %s", self.write_failures, exc)

    def write_ok(self) -> None:
        """A record written: the back-off, if any, is over."""
        if self.write_failures:
            logger.warning("writing samples again after %d failed attempt(s)",
                           self.write_failures)
            self.write_failures = 0
            self._retry_at = -math.inf

    # -- pruning --------------------------------------------------------------------------

    def prune(self, now: float) -> list[str]:
        """Remove segments dated in the future (more than FUTURE_SLACK_S + one interval after
        `now`: written under a wrong clock, later corrected), then those that ended more than
        `retain_s` ago (at the next one's start; the newest closed one at its last record),
        then the oldest while over `max_bytes` (never the one being written). Returns the
        names removed."""
        self._prune_stale_tmp(now)
        current = self.writer.path.name if self.writer is not None else None
        removed: list[str] = []
        segs = self._prune_future(now, list_segments(self.directory), current, removed)
        sizes = {name: self._size(name) for _, name in segs}
        total = sum(sizes.values())
        for i, (_, name) in enumerate(segs):
            if name == current:
                break
            ended = segs[i + 1][0] if i + 1 < len(segs) else self._last_record(name, now)
            if ended >= now - self.retain_s and total <= self.max_bytes:
                continue
            if self._unlink(name, removed):
                total -= sizes[name]
        return removed

    def _prune_future(self, now: float, segs: list[tuple[float, str]], current: str | None,
                      removed: list[str]) -> list[tuple[float, str]]:
        """The segments left once those dated in the future are gone."""
        future = now + FUTURE_SLACK_S + self.interval_s
        kept = []
        for start, name in segs:
            if start > future and name != current:
                logger.warning("segment %s starts %.0f s in the future (a wrong clock when it "
                               "was written): removed", name, start - now)
                if self._unlink(name, removed):
                    continue
            kept.append((start, name))
        return kept

    def _last_record(self, name: str, now: float) -> float:
        """When the newest closed segment ended: its last record (a sampler down since?)."""
        try:
            return min(now, probe_file(self.directory / name).t_last)
        except (OSError, FormatError):
            return now

    def _size(self, name: str) -> int:
        try:
            return os.stat(self.directory / name, follow_symlinks=False).st_size
        except OSError:
            return 0

    def _unlink(self, name: str, removed: list[str]) -> bool:
        try:
            os.unlink(self.directory / name)
        except FileNotFoundError:
            pass
        except OSError as exc:
            logger.warning("cannot remove %s: %s", self.directory / name, exc.strerror)
            return False
        removed.append(name)
        return True

    def _prune_stale_tmp(self, now: float) -> None:
        """A segment's header is written under `.seg-<start>.bvts.<pid>.tmp` and linked into
        place; a sampler killed in between leaves that name behind. Gone after a minute."""
        try:
            names = os.listdir(self.directory)
        except OSError:
            return
        for name in names:
            if not TMP_SEGMENT_RE.match(name):
                continue
            try:
                st = os.stat(self.directory / name, follow_symlinks=False)
                if st.st_mtime < now - STALE_TMP_S:
                    os.unlink(self.directory / name)
            except OSError:
                pass
