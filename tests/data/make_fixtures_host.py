"""Network and host parts of the health fixtures (issue 11), used by make_fixtures.py.

`build_root(root)` adds to the healthy H100 node what the ib and node checks read besides the
port files: each port's `hw_counters/`, each HCA's PCI device link (`<hca>/device/`; a
directory here where sysfs has the kernel's symlink to the PCI device), `/proc/modules` with
nvidia_peermem, `/proc/driver/nvidia/version`, `/proc/sys/kernel/osrelease`, EDAC memory
controllers, the daemons' `/proc/<pid>/stat` and `comm`, and the `/home` mount point.
SYNTHETIC: the formats are the kernel's (drivers/infiniband/hw/mlx5/counters.c names,
drivers/pci/pci-sysfs.c, drivers/edac/edac_mc_sysfs.c, proc(5) for stat), values typical.

`FAILURES`: one change each to the healthy node, merged into make_fixtures.FAILURES.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

HCAS = [f"mlx5_{i}" for i in range(8)]
# mlx5's hw_counters on an InfiniBand port (RoCE-only counters absent), a node up for weeks.
HW_COUNTERS = {
    "duplicate_request": 0,
    "implied_nak_seq_err": 0,
    "lifespan": 12,
    "local_ack_timeout_err": 0,
    "out_of_buffer": 0,
    "out_of_sequence": 0,
    "packet_seq_err": 0,
    "req_cqe_error": 0,
    "req_cqe_flush_error": 0,
    "req_remote_access_errors": 0,
    "req_remote_invalid_request": 0,
    "resp_cqe_error": 0,
    "resp_cqe_flush_error": 0,
    "resp_local_length_error": 0,
    "resp_remote_access_errors": 0,
    "rnr_nak_retry_err": 0,
    "rx_atomic_requests": 0,
    "rx_read_requests": 48_120_533,
    "rx_write_requests": 9_912_004_871,
}
# ConnectX-7 (15b3:1021) on PCIe Gen5 x16.
PCI_FILES = {
    "vendor": "0x15b3\n",
    "device": "0x1021\n",
    "class": "0x020700\n",
    "current_link_speed": "32.0 GT/s PCIe\n",
    "max_link_speed": "32.0 GT/s PCIe\n",
    "current_link_width": "16\n",
    "max_link_width": "16\n",
}
PCI_ADDRS = ["18", "2a", "3a", "5d", "9a", "ab", "ba", "db"]
MODULES = """\
nvidia_peermem 16384 0 - Live 0x0000000000000000 (POE)
nvidia_uvm 1523712 4 - Live 0x0000000000000000 (POE)
nvidia_drm 77824 0 - Live 0x0000000000000000 (POE)
nvidia_modeset 1302528 1 nvidia_drm, Live 0x0000000000000000 (POE)
nvidia 56680448 98 nvidia_peermem,nvidia_uvm,nvidia_modeset, Live 0x0000000000000000 (POE)
mlx5_ib 458752 0 - Live 0x0000000000000000 (OE)
ib_uverbs 163840 2 nvidia_peermem,mlx5_ib, Live 0x0000000000000000 (OE)
mlx5_core 2260992 1 mlx5_ib, Live 0x0000000000000000 (OE)
ib_core 442368 8 nvidia_peermem,mlx5_ib,ib_uverbs, Live 0x0000000000000000 (OE)
"""
NVIDIA_VERSION = ("NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.129.03  Thu Oct 19 "
                  "18:56:32 UTC 2023\nGCC version:  gcc version 11.4.0 (Ubuntu "
                  "11.4.0-1ubuntu1~22.04) \n")
OSRELEASE = "5.15.0-91-generic\n"
PF_KTHREAD = 0x00200000
# pid, comm (the kernel's 15 characters), state, ppid, flags, starttime (clock ticks), uid
PROCS = [
    (1, "systemd", "S", 0, 0x400100, 12, 0),
    (2, "kthreadd", "S", 0, 0x208040, 12, 0),
    (845, "kworker/12:1H", "I", 2, 0x4208060, 1411, 0),
    (1502, "munged", "S", 1, 0x400140, 2950, 105),
    (1618, "nvidia-persiste", "S", 1, 0x400140, 3012, 106),
    (1644, "nv-fabricmanage", "S", 1, 0x400140, 3020, 0),
    (1690, "nv-hostengine", "S", 1, 0x400140, 3105, 0),
    (2011, "slurmd", "S", 1, 0x400140, 3377, 0),
    (2213, "chronyd", "S", 1, 0x400140, 3391, 107),
]
# <root>/etc/passwd: the service accounts the node check resolves `node.service_owners` with.
PASSWD = """\
root:x:0:0:root:/root:/bin/bash
daemon:x:1:1:daemon:/usr/sbin:/usr/sbin/nologin
nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin
munge:x:105:112::/nonexistent:/usr/sbin/nologin
nvidia-persistenced:x:106:113:NVIDIA Persistence Daemon,,,:/nonexistent:/usr/sbin/nologin
_chrony:x:107:114:Chrony daemon,,,:/var/lib/chrony:/usr/sbin/nologin
"""
D_STATE_PID, D_STATE_START = 61234, 912_345_678


def stat_line(pid: int, comm: str, state: str, ppid: int, flags: int, starttime: int) -> str:
    """A /proc/<pid>/stat line (proc(5): 52 fields on Linux >= 3.5)."""
    kthread = bool(flags & PF_KTHREAD)
    fields = [str(pid), f"({comm})", state, str(ppid), str(pid if ppid == 1 else 0),
              str(pid if ppid == 1 else 0), "0", "-1", str(flags), "2188", "0", "12", "0",
              "331", "207", "0", "0", "20", "0", "1", "0", str(starttime),
              "0" if kthread else "23465984", "0" if kthread else "2051",
              "18446744073709551615", "0" if kthread else "94558316986368",
              "0" if kthread else "94558317112437", "0" if kthread else "140732526870816",
              "0", "0", "0", "0", "0" if kthread else "4096", "0" if kthread else "81923",
              "0", "0", "0", "17", "12", "0", "0", "0", "0", "0", "0", "0", "0", "0", "0",
              "0", "0", "0"]
    assert len(fields) == 52, len(fields)
    return " ".join(fields) + "\n"


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def status_text(pid: int, comm: str, state: str, ppid: int, uid: int) -> str:
    """The head of a /proc/<pid>/status (proc(5)): the node check reads its Uid line."""
    names = {"R": "running", "S": "sleeping", "D": "disk sleep", "I": "idle", "Z": "zombie"}
    return (f"Name:\t{comm}\nUmask:\t0022\nState:\t{state} ({names.get(state, '?')})\n"
            f"Tgid:\t{pid}\nNgid:\t0\nPid:\t{pid}\nPPid:\t{ppid}\nTracerPid:\t0\n"
            f"Uid:\t{uid}\t{uid}\t{uid}\t{uid}\nGid:\t{uid}\t{uid}\t{uid}\t{uid}\n")


def write_proc(root: Path, pid: int, comm: str, state: str, ppid: int, flags: int,
               starttime: int, uid: int = 0) -> None:
    write(root / "proc" / str(pid) / "stat", stat_line(pid, comm, state, ppid, flags, starttime))
    write(root / "proc" / str(pid) / "comm", comm + "\n")
    write(root / "proc" / str(pid) / "status", status_text(pid, comm, state, ppid, uid))


def build_root(root: Path) -> None:
    for i, hca in enumerate(HCAS):
        base = root / "sys/class/infiniband" / hca
        for name, value in HW_COUNTERS.items():
            write(base / "ports/1/hw_counters" / name, f"{value}\n")
        for name, text in PCI_FILES.items():
            write(base / "device" / name, text)
        write(base / "device" / "uevent", f"DRIVER=mlx5_core\nPCI_SLOT_NAME=0000:{PCI_ADDRS[i]}:00.1\n")
    write(root / "proc/modules", MODULES)
    write(root / "proc/driver/nvidia/version", NVIDIA_VERSION)
    write(root / "proc/sys/kernel/osrelease", OSRELEASE)
    for proc in PROCS:
        write_proc(root, *proc)
    write(root / "etc/passwd", PASSWD)
    for mc in range(4):
        base = root / "sys/devices/system/edac/mc" / f"mc{mc}"
        for name, text in {"mc_name": f"Intel_10nm Socket#{mc // 2} IMC#{mc % 2}\n",
                           "ce_count": "0\n", "ue_count": "0\n", "ce_noinfo_count": "0\n",
                           "ue_noinfo_count": "0\n", "size_mb": "262144\n",
                           "seconds_since_reset": "1987654\n"}.items():
            write(base / name, text)
        for dimm in range(2):
            d = base / f"dimm{dimm}"
            write(d / "dimm_label", f"CPU_SrcID#{mc // 2}_MC#{mc % 2}_Chan#{dimm}_DIMM#0\n")
            write(d / "dimm_ce_count", "0\n")
            write(d / "dimm_ue_count", "0\n")
            write(d / "size", "131072\n")
            write(d / "dimm_mem_type", "Registered-DDR5\n")
    # The mount points of proc/mounts (the mount probe statvfs()es and reads them).
    for mount_point in ("home", "raid"):
        write(root / mount_point / ".keep", "")


# -- failures: (root, nvml, state) -> None ----------------------------------------------------


def link_downed_rising(root: Path, nvml: dict[str, Any], state: Path) -> None:
    """mlx5_2/1 went down 3 times since the stored reading."""
    counters = root / "sys/class/infiniband/mlx5_2/ports/1/counters"
    write(counters / "link_downed", "3\n")
    write(counters / "link_error_recovery", "0\n")
    previous = {}
    for hca in HCAS:
        port = root / "sys/class/infiniband" / hca / "ports/1/counters"
        previous[f"{hca}/1"] = {p.name: int(p.read_text()) for p in sorted(port.iterdir())}
    previous["mlx5_2/1"]["link_downed"] = 0
    hw = {f"{h}/1": {k: v for k, v in HW_COUNTERS.items() if k != "lifespan"} for h in HCAS}
    write(state / "ib_counters.json",
          json.dumps({"time": 1768464000.0, "ports": previous, "hw": hw}, indent=1,
                     sort_keys=True) + "\n")


def hca_pcie(hca: str, **files: str) -> Callable[[Path, dict[str, Any], Path], None]:
    def change(root: Path, nvml: dict[str, Any], state: Path) -> None:
        for name, text in files.items():
            write(root / "sys/class/infiniband" / hca / "device" / name, text + "\n")

    return change


def no_peermem(root: Path, nvml: dict[str, Any], state: Path) -> None:
    text = (root / "proc/modules").read_text()
    lines = [ln.replace("nvidia_peermem,", "") for ln in text.splitlines(keepends=True)
             if not ln.startswith("nvidia_peermem ")]
    write(root / "proc/modules", "".join(lines))


def service_gone(pid: int) -> Callable[[Path, dict[str, Any], Path], None]:
    def change(root: Path, nvml: dict[str, Any], state: Path) -> None:
        shutil.rmtree(root / "proc" / str(pid))

    return change


def edac_ue(root: Path, nvml: dict[str, Any], state: Path) -> None:
    base = root / "sys/devices/system/edac/mc/mc1"
    write(base / "ue_count", "1\n")
    write(base / "ce_count", "3\n")
    write(base / "dimm1/dimm_ue_count", "1\n")
    write(base / "dimm1/dimm_ce_count", "3\n")


def d_state(root: Path, nvml: dict[str, Any], state: Path) -> None:
    """A job's python in D, first seen so by a reading 2 h before the stored one."""
    write_proc(root, D_STATE_PID, "python3", "D", 2011, 0x400040, D_STATE_START, 1000)
    write(state / "host_state.json",
          json.dumps({"time": 1768464000.0, "edac": {f"mc{i}": 0 for i in range(4)},
                      "d_state": {f"{D_STATE_PID}:{D_STATE_START}": 1768456800.0}},
                     indent=1, sort_keys=True) + "\n")


FAILURES: dict[str, tuple[str, list[Callable[[Path, dict[str, Any], Path], None]]]] = {
    "h100-ib-link-downed-rising": ("mlx5_2/1 link_downed 0 -> 3 since the stored reading",
                                   [link_downed_rising]),
    "h100-ib-hca-pcie-x8": ("mlx5_4's PCIe link trained at x8 of x16",
                            [hca_pcie("mlx5_4", current_link_width="8")]),
    "h100-ib-hca-pcie-gen4": ("mlx5_1's PCIe link at 16.0 GT/s (Gen4) of 32.0 GT/s",
                              [hca_pcie("mlx5_1", current_link_speed="16.0 GT/s PCIe")]),
    "h100-ib-no-peermem": ("nvidia_peermem not loaded (GPUDirect RDMA unavailable)",
                           [no_peermem]),
    "h100-node-service-down": ("nv-fabricmanager not running (its process is gone)",
                               [service_gone(1644)]),
    "h100-node-edac-ue": ("EDAC mc1: 1 uncorrectable memory error on "
                          "CPU_SrcID#0_MC#1_Chan#1_DIMM#0", [edac_ue]),
    "h100-node-d-state": ("python3 pid 61234 in D state, first seen so 2 h before the stored "
                          "reading", [d_state]),
}
