"""The kernel log's GPU lines: reading them (/dev/kmsg or a dmesg-style file) and parsing the
NVIDIA XIDs and NVSwitch SXids in them.

Lines are kept in dmesg's form, `[  812.345678] NVRM: Xid (PCI:0000:18:00): 79, ...`: the
record's time since boot (kernel Documentation/ABI/testing/dev-kmsg) dates every XID against
the snapshot's `uptime_s` (the XID window, docs/health.md). Only lines with one of
`KMSG_MARKS` are kept.

Three readers, one record format:

- `read_kmsg_nvrm()`: the whole ring buffer once (the gpu check's live snapshot);
- `KmsgFollower`: the records written since it was opened, read a little at each call (the
  telemetry sampler counts the XIDs that happen while it runs);
- `read_marked_lines(path)`: a dmesg-style text file (`BV_KMSG`, the dev cluster, tests).

Reading /dev/kmsg needs root (or dmesg_restrict off); each reader raises OSError when it
cannot open its source and the caller decides what that means.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

DEV_KMSG = "/dev/kmsg"
KMSG_MARKS = ("NVRM", "SXid")  # the kernel log lines the gpu check and the sampler keep

_XID = re.compile(r"NVRM: Xid \(PCI:([0-9A-Fa-f:.]+)\): (\d+)")
# nvidia-nvswitch0: SXid (PCI:0000:c3:00.0): 24007, Fatal, Link 30 sourcetrack timeout error
_SXID = re.compile(r"(nvidia-nvswitch\d*): SXid \(PCI:([0-9A-Fa-f:.]+)\): (\d+), "
                   r"(Fatal|Non-fatal)?,?\s*(.*)$", re.IGNORECASE)
_STAMP = re.compile(r"^\s*\[\s*([0-9]+(?:\.[0-9]+)?)\]")
_RECORD_MAX = 8192  # one /dev/kmsg read returns one record, at most this long


def bus_key(pci: str) -> str:
    """'00000000:18:00.0' (NVML) and '0000:18:00' (XID form) both -> '18:00'."""
    head = pci.split(".")[0].lower()
    parts = head.split(":")
    return ":".join(parts[-2:]) if len(parts) >= 2 else head


@dataclass(frozen=True)
class Xid:
    """An NVIDIA XID line (`NVRM: Xid (PCI:0000:18:00): 79, ...`)."""

    pci: str
    code: int
    line: str
    at_s: float | None = None  # the kernel record's time since boot, when the line has one

    @property
    def bus(self) -> str:
        return bus_key(self.pci)


@dataclass(frozen=True)
class SXid:
    """An NVSwitch error line (`nvidia-nvswitch0: SXid (PCI:0000:c3:00.0): 24007, Fatal, ...`)."""

    switch: str  # nvidia-nvswitch0
    pci: str
    code: int
    fatal: bool | None  # the driver's own word: Fatal / Non-fatal; None when the line has none
    text: str  # what follows (`Link 30 sourcetrack timeout error`)
    line: str
    at_s: float | None = None


def _stamp(line: str) -> float | None:
    m = _STAMP.match(line)
    return float(m.group(1)) if m else None


def parse_xids(lines: Sequence[str] | None) -> list[Xid]:
    """NVIDIA XID events in kernel log lines (`NVRM: Xid (PCI:0000:18:00): 79, ...`)."""
    out = []
    for line in lines or ():
        m = _XID.search(line)
        if m:
            out.append(Xid(m.group(1), int(m.group(2)), line.strip(), _stamp(line)))
    return out


def parse_sxids(lines: Sequence[str] | None) -> list[SXid]:
    """NVSwitch SXid events in kernel log lines; the driver says Fatal or Non-fatal itself."""
    out = []
    for line in lines or ():
        m = _SXID.search(line)
        if m:
            word = (m.group(4) or "").lower()
            out.append(SXid(m.group(1), m.group(2), int(m.group(3)),
                            True if word == "fatal" else False if word else None,
                            m.group(5).strip(), line.strip(), _stamp(line)))
    return out


def kmsg_record_line(record: str) -> str | None:
    """One /dev/kmsg record (`6,1234,812345678,-;NVRM: ...`, kernel Documentation/ABI/testing/
    dev-kmsg) as a dmesg line `[  812.345678] NVRM: ...`; None unless it is an NVRM or an
    NVSwitch SXid line."""
    head, _, msg = record.partition(";")
    if not any(mark in msg for mark in KMSG_MARKS):
        return None
    first = msg.splitlines()[0]
    fields = head.split(",")  # priority,sequence,microseconds since boot,flags
    usec = fields[2] if len(fields) > 2 and fields[2].isdigit() else None
    return f"[{int(usec) / 1e6:12.6f}] {first}" if usec else first


def _open_kmsg(path: str) -> int:
    return os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)


def _read_records(fd: int, max_records: int) -> list[str]:
    """The GPU lines among the records readable now from an open /dev/kmsg, without blocking."""
    lines: list[str] = []
    for _ in range(max_records):
        try:
            rec = os.read(fd, _RECORD_MAX)
        except BlockingIOError:
            break
        except BrokenPipeError:
            continue  # the record was overwritten while we read: skip it
        if not rec:
            break
        line = kmsg_record_line(rec.decode("utf-8", "replace"))
        if line is not None:
            lines.append(line)
    return lines


def read_kmsg_nvrm(path: str = DEV_KMSG, max_records: int = 200_000) -> list[str]:
    """NVRM (and NVSwitch SXid) lines of the whole kernel ring buffer, read without blocking,
    each with its record's time since boot in dmesg's form (`[  812.345678] NVRM: Xid ...`).

    Raises:
        OSError: /dev/kmsg cannot be opened (not root, dmesg_restrict, no such device).
    """
    fd = _open_kmsg(path)
    try:
        return _read_records(fd, max_records)
    finally:
        os.close(fd)


def read_marked_lines(path: str | Path) -> list[str]:
    """The NVRM and SXid lines of a dmesg-style text file, without their newlines.

    Raises:
        OSError: the file cannot be read.
    """
    with open(path, encoding="utf-8", errors="replace") as fh:
        return [ln.rstrip("\n") for ln in fh if any(mark in ln for mark in KMSG_MARKS)]


class KmsgFollower:
    """The kernel log's GPU lines written since the follower opened /dev/kmsg.

    The first `new_lines()` opens the device at its end and returns nothing: what the ring
    buffer held before is history (the gpu check judges that). Each later call returns the
    GPU lines logged since the previous one. Not thread-safe; `close()` when done.
    """

    def __init__(self, path: str = DEV_KMSG, max_records: int = 100_000) -> None:
        self.path = path
        self.max_records = max_records
        self._fd: int | None = None

    def new_lines(self) -> list[str]:
        """GPU lines since the last call ([] at the first, which opens the log at its end).

        Raises:
            OSError: the first call could not open the log (not root, dmesg_restrict).
        """
        if self._fd is None:
            fd = _open_kmsg(self.path)
            try:
                os.lseek(fd, 0, os.SEEK_END)
            except OSError:
                os.close(fd)
                raise
            self._fd = fd
            return []
        return _read_records(self._fd, self.max_records)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
