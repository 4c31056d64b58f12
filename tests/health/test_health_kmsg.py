"""The kernel-log reader shared by the gpu check and the telemetry sampler (health.kmsg)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bluevela.health.kmsg import (
    KmsgFollower,
    kmsg_record_line,
    parse_xids,
    read_kmsg_nvrm,
    read_marked_lines,
)

XID79 = "NVRM: Xid (PCI:0000:5d:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."


def _append(path: Path, text: str) -> None:
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(text)


def test_follower_starts_at_the_end_and_returns_each_new_gpu_record(tmp_path: Path) -> None:
    # A regular file stands in for /dev/kmsg: one record is what each read returns there, and
    # here each call finds exactly one new record after the end it last read.
    log = tmp_path / "kmsg"
    log.write_text(f"4,1,1000000,-;{XID79}\n")  # history: before the follower opened
    follower = KmsgFollower(str(log))
    try:
        assert follower.new_lines() == []
        assert follower.new_lines() == []
        _append(log, f"4,2,86012345678,-;{XID79}\n SUBSYSTEM=pci\n")
        (line,) = follower.new_lines()
        assert line == f"[86012.345678] {XID79}"
        (xid,) = parse_xids([line])
        assert (xid.bus, xid.code, xid.at_s) == ("5d:00", 79, 86012.345678)
        _append(log, "6,3,86100000000,-;usb 1-1: new device\n")
        assert follower.new_lines() == []  # not a GPU line
    finally:
        follower.close()
    follower.close()  # twice is harmless


def test_follower_that_cannot_open_raises(tmp_path: Path) -> None:
    with pytest.raises(OSError):
        KmsgFollower(str(tmp_path / "absent")).new_lines()


def test_marked_lines_of_a_text_file(tmp_path: Path) -> None:
    log = tmp_path / "dmesg.txt"
    log.write_text(f"[ 1.0] usb 1-1: new device\n[ 2.0] {XID79}\n"
                   "[ 3.0] nvidia-nvswitch0: SXid (PCI:0000:c3:00.0): 24007, Fatal, Link 30\n")
    assert read_marked_lines(log) == [
        f"[ 2.0] {XID79}",
        "[ 3.0] nvidia-nvswitch0: SXid (PCI:0000:c3:00.0): 24007, Fatal, Link 30"]
    with pytest.raises(OSError):
        read_marked_lines(tmp_path / "absent")


def test_record_line_form() -> None:
    assert kmsg_record_line(f"4,9,5,-;{XID79}") == f"[    0.000005] {XID79}"
    assert kmsg_record_line(f"4,9,x,-;{XID79}") == XID79  # no timestamp field: the text alone
    assert kmsg_record_line("6,1,2,-;usb 1-1: new device") is None


@pytest.mark.skipif(not os.access("/dev/kmsg", os.R_OK), reason="/dev/kmsg not readable here")
def test_the_real_ring_buffer_gives_only_gpu_lines() -> None:
    lines = read_kmsg_nvrm()
    assert all(("NVRM" in ln or "SXid" in ln) and ln.startswith("[") for ln in lines)
