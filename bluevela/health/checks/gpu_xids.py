"""What an XID means for the node: NVIDIA's XID catalog, judged as NVIDIA judges it.

NVIDIA's catalog (docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html, Ampere and
newer) gives every XID an immediate resolution ("Resolution Bucket (Immediate Action)"). bv
takes it as the verdict:

- CRITICAL (drain): RESET_GPU, RESTART_BM (reboot), RESTART_VM, CHECK_MECHANICALS and
  CONTACT_SUPPORT: the next job on the node would fail, or a person must act first.
- WARNING (reported, the node stays in service): RESTART_APP (the application's fault; the
  GPU is healthy) and IGNORE.

Where the catalog gives a workflow instead of a bucket, or no bucket at all, bv's choice and
its reason are in `BV_CHOICES` (docs/health.md, "XIDs"); two workflows are decided by the log
line itself: XID 154 by the recovery action it names, XIDs 144-150 by the driver's own
`Fatal` / `Non-fatal` word. An XID the catalog marks Unused on A100 and later (and any code
it does not list) is a WARNING, except where `BV_CHOICES` says otherwise.

Pure data and pure functions: no I/O, cheap to import (the prolog's quick path).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from bluevela.health.result import Status

_C, _W = Status.CRITICAL, Status.WARNING

# The catalog's immediate resolution buckets -> bv's verdict.
DRAIN_RESOLUTIONS = frozenset({"RESET_GPU", "RESTART_BM", "RESTART_VM", "CHECK_MECHANICALS",
                               "CONTACT_SUPPORT"})
KEEP_RESOLUTIONS = frozenset({"RESTART_APP", "IGNORE"})
_ACTION = {
    "RESET_GPU": "reset the GPU",
    "RESTART_BM": "reboot the node",
    "RESTART_VM": "restart the VM that owns the GPU",
    "CHECK_MECHANICALS": "check the GPU's seating and power connections",
    "CONTACT_SUPPORT": "contact support",
    "RESTART_APP": "the application's error: restart it",
    "IGNORE": "no action needed",
}


@dataclass(frozen=True)
class XidKind:
    """One XID: its catalog resolution, what it means and what to do, and bv's verdict."""

    status: Status
    what: str
    action: str
    resolution: str  # the catalog's immediate resolution bucket; "-" where it gives none


@dataclass(frozen=True)
class Choice:
    """bv's verdict where the catalog gives a workflow or no bucket, and why."""

    status: Status
    action: str
    why: str


# Where the plain rule above cannot decide (a workflow, no bucket, an Unused code bv still
# drains on). Every entry is listed, with its reason, in docs/health.md.
BV_CHOICES: dict[int, Choice] = {
    45: Choice(_W, "see the XID before it",
               "WORKFLOW_XID_45: alone a Fabric Manager restart, else follow the other XID, "
               "which bv judges itself"),
    48: Choice(_C, "reset the GPU; RMA if it recurs",
               "WORKFLOW_XID_48: alone RESET_GPU, with XID 63/64 drain and reset"),
    74: Choice(_C, "reset the GPU, check NVLink/NVSwitch; RMA if it recurs",
               "WORKFLOW_NVLINK_ERR: the catalog's text says a GPU reset or node reboot is "
               "needed to clear it; the register decode only refines the investigation"),
    78: Choice(_C, "update the driver/firmware",
               "UPDATE_SWFW: the GPU cannot serve until an operator updates software"),
    123: Choice(_C, "reset the GPU; RMA if it recurs",
                "Unused on A100 and later; where it is logged (older GPUs) the catalog's "
                "bucket is CONTACT_SUPPORT, a failed write to the GPU's SPI flash"),
    144: Choice(_C, "reset the GPU (NVLink fatal)", "WORKFLOW_NVLINK5_ERR: see 144-150"),
    159: Choice(_C, "reset the GPU",
                "CHECK_UVM: RESET_GPU when UVM is in use; every CUDA job on Linux goes "
                "through nvidia-uvm, so bv cannot rule it out"),
    162: Choice(_W, "no action needed", "no bucket: power smoothing capability back"),
    163: Choice(_W, "no GPU reset needed; see the thermal events",
                "no bucket: the catalog's text says no GPU reset is required"),
    164: Choice(_W, "watch power swings; plan the GPU's replacement",
                "no bucket: the catalog's text says monitor"),
    165: Choice(_W, "power smoothing is off; replace the GPU if power swings matter",
                "no bucket: the GPU still computes"),
    166: Choice(_W, "confidential-computing mode only", "no bucket: CC mode only"),
    167: Choice(_C, "reset the GPU, check PCIe; reboot if it recurs",
                "no bucket: a fatal PCIe timeout leaves the GPU unreachable, as XID 79 "
                "(RESTART_BM) does"),
    168: Choice(_C, "enable ECC or reboot the node",
                "no bucket: the catalog's text asks for ECC on or a reboot, an operator's "
                "action before the GPU's full memory serves again"),
    169: Choice(_C, "reset the GPU; RMA if it recurs",
                "no bucket: an internal micro-controller halt, as XID 62 (RESET_GPU)"),
    170: Choice(_W, "confidential-computing mode only", "no bucket: CC mode only"),
    171: Choice(_C, "reset the GPU; RMA if it recurs",
                "no bucket: the detail line of an XID 48 (WORKFLOW_XID_48: reset)"),
    172: Choice(_C, "reset the GPU; RMA if it recurs",
                "no bucket: the detail line of an XID 48 (WORKFLOW_XID_48: reset)"),
}
for _code in range(145, 151):
    BV_CHOICES[_code] = BV_CHOICES[144]
BV_CHOICES[154] = Choice(_C, "do the recovery action the log line names",
                         "XID_154: the line's recovery action; None is a WARNING")

# code: (what, catalog immediate resolution); the codes NVIDIA lists as used on A100 and
# later, and bv's entry for 123. Descriptions shortened from the catalog's.
_CATALOG: dict[int, tuple[str, str]] = {
    8: ("GPU stopped processing (idle timeout)", "RESTART_APP"),
    11: ("invalid or corrupted push buffer stream", "RESTART_APP"),
    13: ("graphics engine exception", "RESTART_APP"),
    14: ("fake or injected error", "IGNORE"),
    25: ("invalid or illegal push buffer stream", "RESTART_APP"),
    31: ("GPU memory page fault", "RESTART_APP"),
    32: ("invalid or corrupted push buffer stream (PBDMA)", "RESTART_APP"),
    37: ("driver firmware error", "IGNORE"),
    38: ("driver firmware error (watchdog timeout)", "IGNORE"),
    39: ("copy engine exception", "RESTART_APP"),
    40: ("copy engine exception", "RESTART_APP"),
    41: ("copy engine exception", "RESTART_APP"),
    43: ("GPU stopped processing (application fault)", "IGNORE"),
    44: ("graphics engine fault during context switch", "IGNORE"),
    45: ("preemptive cleanup after earlier errors", "WORKFLOW_XID_45"),
    46: ("GPU stopped processing (GPU timeout)", "RESET_GPU"),
    48: ("double-bit ECC error", "WORKFLOW_XID_48"),
    54: ("auxiliary power not connected to the GPU board", "CHECK_MECHANICALS"),
    60: ("video processor exception", "RESTART_APP"),
    62: ("internal micro-controller halt", "RESET_GPU"),
    63: ("ECC page retirement/row remap recorded", "IGNORE"),
    64: ("ECC page retirement/row remap failed", "RESET_GPU"),
    66: ("illegal access by driver", "IGNORE"),
    67: ("illegal access by driver", "IGNORE"),
    68: ("NVDEC0 exception", "RESTART_APP"),
    69: ("graphics engine class error", "RESTART_APP"),
    74: ("NVLink error", "WORKFLOW_NVLINK_ERR"),
    78: ("vGPU start error", "UPDATE_SWFW"),
    79: ("fallen off the bus", "RESTART_BM"),
    80: ("corrupted data sent to the GPU", "RESTART_APP"),
    82: ("NVJPG0 error", "RESTART_APP"),
    86: ("OFA exception", "RESTART_APP"),
    92: ("high single-bit ECC error rate", "IGNORE"),
    93: ("InfoROM wear limit reached (non-fatal)", "IGNORE"),
    94: ("contained ECC error", "RESTART_APP"),
    95: ("uncontained ECC error", "RESET_GPU"),
    106: ("SMBPBI test message", "IGNORE"),
    107: ("SMBPBI test message (silent)", "IGNORE"),
    108: ("NVLink remote translation error", "IGNORE"),
    109: ("context switch timeout", "RESET_GPU"),
    110: ("security fault", "RESET_GPU"),
    119: ("GSP RPC timeout", "RESET_GPU"),
    120: ("GSP error", "RESET_GPU"),
    121: ("C2C link corrected errors", "IGNORE"),
    123: ("SPI PMU RPC write failure", "CONTACT_SUPPORT"),
    136: ("NVLink training failed", "RESET_GPU"),
    137: ("NVLink privilege error (illegal peer access)", "IGNORE"),
    139: ("OFA1 error", "RESTART_APP"),
    140: ("unrecovered ECC error", "RESET_GPU"),
    141: ("CUDA fast path error", "IGNORE"),
    142: ("NVENC3 error", "CONTACT_SUPPORT"),
    143: ("GPU initialization failure", "RESET_GPU"),
    151: ("key rotation error", "RESTART_VM"),
    152: ("DLA SMMU error", "IGNORE"),
    153: ("DLA timeout", "IGNORE"),
    154: ("GPU recovery action changed", "XID_154"),
    155: ("NVLink link down (software defined)", "RESET_GPU"),
    156: ("resource retirement event", "RESET_GPU"),
    157: ("resource retirement failure", "IGNORE"),
    158: ("GPU fatal timeout", "RESET_GPU"),
    159: ("CHI non-data error", "CHECK_UVM"),
    160: ("channel retirement event", "IGNORE"),
    161: ("channel retirement failure", "IGNORE"),
    162: ("power smoothing circuitry re-engaged", "-"),
    163: ("power smoothing circuitry disengaged", "-"),
    164: ("power smoothing circuitry low lifetime", "-"),
    165: ("power smoothing circuitry lifetime exhausted", "-"),
    166: ("NVLink traffic before encryption was set up (CC mode)", "-"),
    167: ("PCIe fatal timeout", "-"),
    168: ("reduced GPU memory capacity (errors in the write-protected region)", "-"),
    169: ("SEC2 micro-controller halt", "-"),
    170: ("NVLink interrupt in CC mode", "-"),
    171: ("uncorrectable DRAM error (detail of XID 48)", "-"),
    172: ("uncorrectable SRAM error (detail of XID 48)", "-"),
}
for _code, _n in ((70, 3), (71, 4), (72, 5), (75, 6), (76, 7), (77, 8), (85, 9),
                  *((c, c - 116) for c in range(126, 136))):
    _CATALOG[_code] = (f"copy engine CE{_n} error", "RESTART_APP")
for _code, _n in ((83, 1), (84, 2), (88, 3), (89, 4), (96, 5), (97, 6), (98, 7)):
    _CATALOG[_code] = (f"NVDEC{_n} error", "RESTART_APP")
for _code in range(99, 106):
    _CATALOG[_code] = (f"NVJPG{_code - 98} error", "RESTART_APP")
for _code, _unit in zip(range(144, 151), ("SAW", "RLW", "TLW", "TREX", "NVLPW_CTRL", "NETIR",
                                          "MSE"), strict=True):
    _CATALOG[_code] = (f"NVLink {_unit} error", "WORKFLOW_NVLINK5_ERR")

# Kept from bv's earlier table where the catalog's one-liner says less.
_ACTION_TEXT = {
    62: "reset the GPU; RMA if it recurs",
    64: "reset the GPU; RMA if it recurs",
    79: "reboot the node, check PCIe/power; RMA if it recurs",
    95: "reset the GPU",
    119: "reset the GPU; reboot if it recurs",
    120: "reset the GPU; reboot if it recurs",
    140: "reset the GPU; RMA if it recurs",
    143: "reset the GPU; reboot if it recurs; RMA if it persists",
    94: "the application's error: restart it; reset the GPU when idle",
    63: "no action needed; the row remap takes effect at the next GPU reset",
    92: "no action needed; reset the GPU when idle",
}


def _kind(code: int, what: str, resolution: str) -> XidKind:
    choice = BV_CHOICES.get(code)
    if choice is not None:
        return XidKind(choice.status, what, choice.action, resolution)
    if resolution in DRAIN_RESOLUTIONS:
        status = _C
    elif resolution in KEEP_RESOLUTIONS:
        status = _W
    else:  # a bucket added to the table without a choice: fail loud at import
        raise ValueError(f"XID {code}: no verdict for resolution {resolution!r}")
    return XidKind(status, what, _ACTION_TEXT.get(code, _ACTION[resolution]), resolution)


XID_TABLE: dict[int, XidKind] = {code: _kind(code, what, res)
                                 for code, (what, res) in sorted(_CATALOG.items())}

# XID 154: "GPU recovery action changed from 0x0 (None) to 0x2 (Node Reboot Required)".
_RECOVERY_TO = re.compile(r"\bto\s+(0x[0-9A-Fa-f]+)\s*(?:\(([^)]*)\))?")
_RECOVERY_NONE = {"0x0", "0x00", "0x00000000"}
# XIDs 144-150: "NVRM: Xid (PCI:...): 149, NETIR_LINK_EVT Fatal XC0 i0 Link 04 (0x...)".
_NONFATAL = re.compile(r"\bnon-?fatal\b", re.IGNORECASE)


def xid_verdict(code: int, line: str) -> tuple[Status, str, str] | None:
    """(status, what, action) of one XID line; None for a code bv does not list (the
    caller's WARNING). XID 154 follows the recovery action the line names (None: WARNING,
    unreadable: CRITICAL); XIDs 144-150 the driver's `Non-fatal` (WARNING) or `Fatal`
    (CRITICAL; a line with neither word: CRITICAL)."""
    kind = XID_TABLE.get(code)
    if kind is None:
        return None
    after = line.split(f"{code},", 1)[1] if f"{code}," in line else line
    if code == 154:
        m = _RECOVERY_TO.search(after)
        if m is not None and m.group(1).lower() in _RECOVERY_NONE:
            return Status.WARNING, kind.what, "recovery action None: no action needed"
        if m is not None and m.group(2):
            return Status.CRITICAL, kind.what, f"recovery action {m.group(2).strip()}"
        return kind.status, kind.what, kind.action
    if kind.resolution == "WORKFLOW_NVLINK5_ERR":
        if _NONFATAL.search(after):
            return Status.WARNING, f"{kind.what} (non-fatal)", "no action unless an XID 154 names one"
        return Status.CRITICAL, f"{kind.what} (fatal)", "reset the GPU"
    return kind.status, kind.what, kind.action


FATAL_XIDS = frozenset(code for code, kind in XID_TABLE.items() if kind.status is Status.CRITICAL)


# -- evidence that a GPU was reset after an XID -------------------------------------------------

# nvidia.ko logs `NVRM: loading NVIDIA UNIX x86_64 Kernel Module  <version> ...` (the open
# module: `NVRM: loading NVIDIA UNIX Open Kernel Module for x86_64 ...`) each time it loads
# (kernel-open/nvidia/nv.c): a driver reload re-initialises every GPU of the node.
_DRIVER_LOAD = re.compile(r"^\s*\[\s*([0-9]+(?:\.[0-9]+)?)\]\s.*NVRM: loading NVIDIA UNIX")


def driver_loads(lines: list[str] | tuple[str, ...] | None) -> tuple[float, ...]:
    """The times since boot of every NVIDIA driver load in dated kernel log lines."""
    out = []
    for line in lines or ():
        m = _DRIVER_LOAD.match(line)
        if m:
            out.append(float(m.group(1)))
    return tuple(sorted(out))


def reset_since(at_s: float | None, loads: tuple[float, ...]) -> float | None:
    """The first driver load after an XID at `at_s` (s since boot): the evidence that its GPU
    was reset; None when there is none (an undated XID has none: it stays).

    A reboot needs no evidence here: the kernel log is the current boot's, so an XID logged
    before the boot is not in it.
    """
    if at_s is None:
        return None
    return next((t for t in loads if t > at_s), None)
