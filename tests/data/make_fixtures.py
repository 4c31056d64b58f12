#!/usr/bin/env python3
"""Build the health-check fixture trees in tests/data/health/ (see tests/data/README.md).

    python tests/data/make_fixtures.py            # (re)write every fixture
    python tests/data/make_fixtures.py --out DIR  # write them somewhere else
    python tests/data/make_fixtures.py --full --out DIR  # full trees, no overlays

Each fixture is a directory holding `root/` (stands for `/`: BV_SYSFS_ROOT), `nvml.json`
(BV_NVML_SNAPSHOT) and, where a baseline matters, `state/` (a node state dir to copy).
Only `h100-healthy` is committed so: every other fixture is committed as an overlay on it
(`root.overlay/` + `root.removed`, tests/fixture_trees.py; tests read the full trees from
`fixture_trees.materialized()`). The trees are generated in full in a temporary directory,
then each one's root is diffed against the healthy root.

The healthy H100 node's sysfs tree and meminfo are generated here from the constants below.
Its NVML snapshot `h100-healthy/nvml.json` is read if it exists (so a snapshot recorded on a
real H100 with `bv health snapshot` can replace it) and written from `HEALTHY_GPUS` only when
missing or with --regen-healthy. Every failure fixture is the healthy one with ONE change.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
OUT = HERE / "health"
HEALTHY = "h100-healthy"
# Issue 11's network and host parts of each tree live in make_fixtures_host.py.
_spec = importlib.util.spec_from_file_location("make_fixtures_host", HERE / "make_fixtures_host.py")
assert _spec and _spec.loader
host = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(host)
# Issue 11's GPU parts (NVLink, fabric, ECC by location, ...) live in make_fixtures_gpu.py.
_spec = importlib.util.spec_from_file_location("make_fixtures_gpu", HERE / "make_fixtures_gpu.py")
assert _spec and _spec.loader
gpu11 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu11)
# The committed (overlay) form of the trees: tests/fixture_trees.py.
_spec = importlib.util.spec_from_file_location("fixture_trees", HERE.parent / "fixture_trees.py")
assert _spec and _spec.loader
fixture_trees = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fixture_trees)

# -- the healthy HGX H100 node ----------------------------------------------------------------

# PCI bus ids of the eight SXM GPUs on a DGX/HGX H100 baseboard (NVML's busId form).
BUS_IDS = ["18", "2A", "3A", "5D", "9A", "AB", "BA", "DB"]
TEMPS_C = [31, 33, 30, 34, 32, 35, 31, 33]  # idle, air-cooled
POWER_W = [69.81, 71.02, 68.44, 72.37, 70.05, 73.11, 69.33, 71.76]  # idle H100 SXM draws ~70 W


def healthy_gpus() -> dict[str, Any]:
    gpus = []
    for i, bus in enumerate(BUS_IDS):
        gpus.append({
            "index": i,
            "name": "NVIDIA H100 80GB HBM3",
            "uuid": f"GPU-5f3c{i}a2e-91b7-4c0d-8e2f-0b6a{i}d4c7e1{i}",
            "pci_bus_id": f"00000000:{bus}:00.0",
            "serial": f"165322303{4100 + i}",
            "temperature_c": TEMPS_C[i],
            "power_w": POWER_W[i],
            "power_limit_w": 700.0,
            "total_energy_mj": 412_872_345_123 + 1_000_003 * i,
            "persistence_mode": True,
            "ecc_uncorrected_volatile": 0,
            "ecc_uncorrected_aggregate": 0,
            # Hopper retires no pages (row remapping replaces it): NVML says Not Supported.
            "retired_pages_sbe": None,
            "retired_pages_dbe": None,
            "retired_pages_pending": None,
            "remapped_rows_correctable": 0,
            "remapped_rows_uncorrectable": 0,
            "remapped_rows_pending": False,
            "remapped_rows_failure": False,
            "clocks_event_reasons": 1,  # GPU idle
            "pcie_link_gen_current": 5,
            "pcie_link_gen_max": 5,
            "pcie_link_gen_gpu_max": 5,
            "pcie_link_width_current": 16,
            "pcie_link_width_max": 16,
            "compute_processes": [],
            "memory_total_bytes": 81559 * 1024 * 1024,
            "memory_used_bytes": 553 * 1024 * 1024,
            "errors": {
                "retired_pages_sbe": "Not Supported",
                "retired_pages_dbe": "Not Supported",
                "retired_pages_pending": "Not Supported",
            },
        })
    return {
        "schema": 1,
        "kind": "nvml_snapshot",
        "source": "fixture: tests/data/make_fixtures.py (values typical of an idle HGX H100; "
                  "replace with `bv health snapshot` from a real node)",
        "recorded_at": "2026-01-15T09:00:00Z",
        "hostname": "gpu001",
        "driver_version": "535.129.03",
        "nvml_version": "12.535.129.03",
        "cuda_driver_version": 12020,
        "device_count": 8,
        "gpus": gpus,
        "kmsg": [
            "NVRM: loading NVIDIA UNIX x86_64 Kernel Module  535.129.03  Thu Oct 19 18:56:32 UTC 2023",
        ],
        "errors": {},
    }


# One NDR ConnectX-7 port per HCA, as on an HGX H100 node with 8 compute rails.
HCAS = [f"mlx5_{i}" for i in range(8)]
HEALTHY_COUNTERS = {
    "VL15_dropped": 0,
    "excessive_buffer_overrun_errors": 0,
    "link_downed": 0,
    "link_error_recovery": 0,
    "local_link_integrity_errors": 0,
    "multicast_rcv_packets": 1874,
    "multicast_xmit_packets": 0,
    "port_rcv_constraint_errors": 0,
    "port_rcv_data": 987_654_321_098,
    "port_rcv_errors": 0,
    "port_rcv_packets": 243_118_902_117,
    "port_rcv_remote_physical_errors": 0,
    "port_rcv_switch_relay_errors": 0,
    "port_xmit_constraint_errors": 0,
    "port_xmit_data": 986_123_456_789,
    "port_xmit_discards": 0,
    "port_xmit_packets": 242_907_331_560,
    "port_xmit_wait": 3_104_227,
    "symbol_error": 0,
    "unicast_rcv_packets": 243_118_900_243,
    "unicast_xmit_packets": 242_907_331_560,
}
PORT_FILES = {
    "state": "4: ACTIVE\n",
    "phys_state": "5: LinkUp\n",
    "rate": "400 Gb/sec (4X NDR)\n",
    "link_layer": "InfiniBand\n",
    "cap_mask": "0xa751e84a\n",
    "sm_lid": "0x1\n",
    "sm_sl": "0\n",
    "lid_mask_count": "0\n",
}
HCA_FILES = {
    "node_type": "1: CA\n",
    "hca_type": "MT4129\n",  # ConnectX-7
    "fw_ver": "28.39.1002\n",
    "board_id": "MT_0000000838\n",
}
MEMINFO = """\
MemTotal:       2113384308 kB
MemFree:        2051773296 kB
MemAvailable:   2063180812 kB
Buffers:           5231876 kB
Cached:           14322040 kB
SwapCached:              0 kB
Active:            9120612 kB
Inactive:         12012344 kB
SwapTotal:               0 kB
SwapFree:                0 kB
Dirty:                 132 kB
Shmem:              410344 kB
HugePages_Total:         0
Hugepagesize:         2048 kB
"""
MOUNTS = """\
/dev/md126p2 / ext4 rw,relatime 0 0
proc /proc proc rw,nosuid,nodev,noexec,relatime 0 0
sysfs /sys sysfs rw,nosuid,nodev,noexec,relatime 0 0
tmpfs /dev/shm tmpfs rw,nosuid,nodev 0 0
/dev/md0 /raid ext4 rw,relatime,stripe=256 0 0
nfs01:/export/home /home nfs4 rw,relatime,vers=4.2,rsize=1048576,wsize=1048576 0 0
"""


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def build_root(root: Path) -> None:
    for i, hca in enumerate(HCAS):
        base = root / "sys/class/infiniband" / hca
        for name, text in HCA_FILES.items():
            write(base / name, text)
        write(base / "node_guid", f"a088:c203:00{i:02x}:4f1e\n")
        port = base / "ports/1"
        for name, text in PORT_FILES.items():
            write(port / name, text)
        write(port / "lid", f"0x{0x1a0 + i:x}\n")
        for name, value in HEALTHY_COUNTERS.items():
            write(port / "counters" / name, f"{value}\n")
    write(root / "proc/meminfo", MEMINFO)
    write(root / "proc/mounts", MOUNTS)
    # Device nodes cannot be committed: empty files stand for them (the check tests presence).
    write(root / "dev/nvidiactl", "")
    write(root / "dev/infiniband/uverbs0", "")
    write(root / "tmp/.keep", "")
    host.build_root(root)


# -- the failure modes: each one change to the healthy node ---------------------------------------


def set_port(port: str, **files: str) -> Callable[[Path, dict[str, Any], Path], None]:
    hca, _, num = port.partition("/")

    def change(root: Path, nvml: dict[str, Any], state: Path) -> None:
        for name, text in files.items():
            write(root / "sys/class/infiniband" / hca / "ports" / num / name, text + "\n")

    return change


def set_gpu(index: int, **values: Any) -> Callable[[Path, dict[str, Any], Path], None]:
    def change(root: Path, nvml: dict[str, Any], state: Path) -> None:
        nvml["gpus"][index % len(nvml["gpus"])].update(values)

    return change


def drop_last_gpu(root: Path, nvml: dict[str, Any], state: Path) -> None:
    nvml["gpus"].pop()
    nvml["device_count"] = len(nvml["gpus"])


def rising_symbol_errors(root: Path, nvml: dict[str, Any], state: Path) -> None:
    port = root / "sys/class/infiniband/mlx5_2/ports/1/counters"
    write(port / "symbol_error", "1543\n")
    previous = {f"{h}/1": dict(HEALTHY_COUNTERS) for h in HCAS}
    previous["mlx5_2/1"]["symbol_error"] = 12
    # One hour before the fixture's reading (the probe compares values, not times).
    write(state / "ib_counters.json",
          json.dumps({"time": 1768464000.0, "ports": previous}, indent=1, sort_keys=True) + "\n")


def add_xid(root: Path, nvml: dict[str, Any], state: Path) -> None:
    nvml["kmsg"].append("NVRM: Xid (PCI:0000:5d:00): 79, pid='<unknown>', name=<unknown>, "
                        "GPU has fallen off the bus.")


def nvml_init_fails(message: str, *kmsg: str) -> Callable[[Path, dict[str, Any], Path], None]:
    """nvmlInit failed: what `gather_live` records then (no GPUs, NVML's message)."""

    def change(root: Path, nvml: dict[str, Any], state: Path) -> None:
        nvml.update(driver_version=None, nvml_version=None, cuda_driver_version=None,
                    device_count=None, gpus=[], kmsg=list(kmsg), errors={},
                    init_error=message, source="fixture: tests/data/make_fixtures.py "
                    "(the healthy node with nvmlInit failing as recorded by gather_live)")

    return change


def set_top(**values: Any) -> Callable[[Path, dict[str, Any], Path], None]:
    def change(root: Path, nvml: dict[str, Any], state: Path) -> None:
        nvml.update(values)

    return change


def recheck(after_s: float, *gpus: dict[str, Any]) -> Callable[[Path, dict[str, Any], Path], None]:
    """The second reading of some GPUs `after_s` later (what gather_live adds)."""

    def change(root: Path, nvml: dict[str, Any], state: Path) -> None:
        nvml["recheck"] = {"after_s": after_s, "gpus": [dict(g, errors={}) for g in gpus]}

    return change


XID79 = ("NVRM: Xid (PCI:0000:5d:00): 79, pid='<unknown>', name=<unknown>, "
         "GPU has fallen off the bus.")


def stamped_xid(at_s: float, uptime_s: float, reload_at_s: float | None = None
                ) -> Callable[[Path, dict[str, Any], Path], None]:
    """An XID 79 record at `at_s` s after boot, the snapshot read at `uptime_s`; with
    `reload_at_s`, the driver loaded again then (the evidence of a GPU reset)."""

    def change(root: Path, nvml: dict[str, Any], state: Path) -> None:
        nvml["uptime_s"] = uptime_s
        load = nvml["kmsg"][0]
        nvml["kmsg"] = [f"[{1.804211:12.6f}] {load}", f"[{at_s:12.6f}] {XID79}"]
        if reload_at_s is not None:
            nvml["kmsg"].append(f"[{reload_at_s:12.6f}] {load}")

    return change


FAILURES: dict[str, tuple[str, list[Callable[[Path, dict[str, Any], Path], None]]]] = {
    "h100-ib-port-down": ("mlx5_3/1 administratively down: state DOWN, phys_state Disabled",
                          [set_port("mlx5_3/1", state="1: DOWN", phys_state="3: Disabled",
                                    rate="10 Gb/sec (4X SDR)")]),
    "h100-ib-port-polling": ("mlx5_5/1 without a link partner: state DOWN, phys_state Polling",
                             [set_port("mlx5_5/1", state="1: DOWN", phys_state="2: Polling",
                                       rate="10 Gb/sec (4X SDR)")]),
    "h100-ib-rate-hdr": ("mlx5_6/1 trained at HDR: 200 Gb/sec (4X HDR)",
                         [set_port("mlx5_6/1", rate="200 Gb/sec (4X HDR)")]),
    "h100-ib-symbol-errors-rising": ("mlx5_2/1 symbol_error 12 -> 1543 since the stored reading",
                                     [rising_symbol_errors]),
    "h100-gpu-missing": ("7 GPUs: the one at DB:00 is gone", [drop_last_gpu]),
    "h100-gpu-row-remap-pending": ("GPU4 row remap pending after 1 uncorrectable row",
                                   [set_gpu(4, remapped_rows_pending=True,
                                            remapped_rows_uncorrectable=1)]),
    "h100-gpu-ecc-uncorrected": ("GPU2 2 volatile uncorrected ECC errors",
                                 [set_gpu(2, ecc_uncorrected_volatile=2,
                                          ecc_uncorrected_aggregate=2)]),
    "h100-gpu-thermal-throttle": ("GPU5 92 C with HW thermal + HW slowdown (0x48)",
                                  [set_gpu(5, temperature_c=92, clocks_event_reasons=0x48,
                                           power_w=412.5)]),
    "h100-gpu-pcie-x8": ("GPU1 PCIe link x8 of x16", [set_gpu(1, pcie_link_width_current=8)]),
    "h100-gpu-xid79": ("XID 79 (fallen off the bus) on 5d:00 in the kernel log", [add_xid]),
    "h100-gpu-leftover-process": ("GPU0 still held by pid 48213 (a previous job's process), "
                                  "in both readings 1 s apart",
                                  [set_gpu(0, compute_processes=[
                                      {"pid": 48213, "used_memory_bytes": 78_102_183_936}]),
                                   recheck(1.0, {"index": 0, "clocks_event_reasons": 1,
                                                 "compute_processes": [
                                                     {"pid": 48213,
                                                      "used_memory_bytes": 78_102_183_936}]})]),
    # Issue 9, item 2: NVML that cannot start, or hangs (synthetic; the NVML messages are
    # pynvml's texts for NVML_ERROR_DRIVER_NOT_LOADED / NVML_ERROR_LIB_RM_VERSION_MISMATCH).
    "h100-gpu-nvml-driver-not-loaded": ("nvmlInit fails: Driver Not Loaded (nvidia.ko not loaded)",
                                        [nvml_init_fails("Driver Not Loaded")]),
    "h100-gpu-nvml-version-mismatch": (
        "nvmlInit fails: user-space NVML 535.154.05 against kernel module 535.129.03",
        [nvml_init_fails(
            "RM has detected an NVML/RM version mismatch.",
            "NVRM: API mismatch: the client has the version 535.154.05, but NVRM: this kernel "
            "module has the version 535.129.03.  Please NVRM: make sure that this kernel module "
            "and all NVIDIA driver NVRM: components have the same version.")]),
    "h100-gpu-nvml-hang": ("nvmlDeviceGetTemperature on GPU3 never returns (replay blocks)",
                           [set_top(hang={"call": "nvmlDeviceGetTemperature", "gpu": 3})]),
    # Issue 9, item 4: one reading must not drain; old XIDs expire; an unreadable log is UNKNOWN.
    "h100-gpu-hw-slowdown-transient": ("GPU6 HW power brake (0x80) in the first reading only, "
                                       "gone 1 s later",
                                       [set_gpu(6, clocks_event_reasons=0x80),
                                        recheck(1.0, {"index": 6, "clocks_event_reasons": 0x1,
                                                      "compute_processes": []})]),
    "h100-gpu-hw-slowdown-persistent": ("GPU6 HW power brake (0x80) in both readings 1 s apart",
                                        [set_gpu(6, clocks_event_reasons=0x80),
                                         recheck(1.0, {"index": 6, "clocks_event_reasons": 0x80,
                                                       "compute_processes": []})]),
    "h100-gpu-process-exiting": ("GPU2 pid 51007 in the first reading, gone 1 s later",
                                 [set_gpu(2, compute_processes=[
                                     {"pid": 51007, "used_memory_bytes": 1_048_576}]),
                                  recheck(1.0, {"index": 2, "clocks_event_reasons": 1,
                                                "compute_processes": []})]),
    "h100-gpu-xid79-recent": ("XID 79 on 5d:00 logged 388 s before the reading (in the window)",
                              [stamped_xid(86012.345678, 86400.5)]),
    "h100-gpu-xid79-expired": ("XID 79 on 5d:00 logged 23 h before the reading, outside the 1 h "
                               "window, and the driver loaded again 30 min after it (the GPU "
                               "was reset since): healthy",
                               [stamped_xid(3601.25, 86400.5, reload_at_s=5400.0)]),
    "h100-gpu-kmsg-unreadable": ("no kernel log could be read (kmsg null, errors.kmsg EPERM)",
                                 [set_top(kmsg=None,
                                          errors={"kmsg": "Operation not permitted"})]),
}


def build_full(out: Path, regen_healthy: bool = False) -> list[str]:
    """Write every fixture under `out` as a full tree; return their names."""
    healthy_nvml_path = OUT / HEALTHY / "nvml.json"
    if healthy_nvml_path.exists() and not regen_healthy:
        healthy_nvml = json.loads(healthy_nvml_path.read_text())
    else:
        healthy_nvml = healthy_gpus()
    gpu11.extend(healthy_nvml)
    failures = {**FAILURES, **host.FAILURES, **gpu11.FAILURES}
    names = [HEALTHY, *failures]
    for name in names:
        target = out / name
        if target.exists():
            shutil.rmtree(target)
        root, state = target / "root", target / "state"
        build_root(root)
        nvml = copy.deepcopy(healthy_nvml)
        about = "healthy HGX H100 node: 8 GPUs, 8 NDR ports"
        if name in failures:
            about, changes = failures[name]
            for change in changes:
                change(root, nvml, state)
        write(target / "nvml.json", json.dumps(nvml, indent=2) + "\n")
        write(target / "ABOUT", about + "\n")
    return names


def build(out: Path, regen_healthy: bool = False) -> list[str]:
    """Write every fixture under `out` in the committed form (`h100-healthy` full, the others
    overlays on it); return their names."""
    with tempfile.TemporaryDirectory(prefix="bv-make-fixtures.") as tmp:
        names = build_full(Path(tmp), regen_healthy)
        out.mkdir(parents=True, exist_ok=True)
        fixture_trees.write_overlays(Path(tmp), out, names, base=HEALTHY)
    return names


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--regen-healthy", action="store_true",
                    help="rewrite h100-healthy/nvml.json from the constants here")
    ap.add_argument("--full", action="store_true",
                    help="write every fixture as a full tree (what tests read), no overlays")
    args = ap.parse_args()
    for name in (build_full if args.full else build)(args.out, args.regen_healthy):
        print(args.out / name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
