"""NVML's clocks event (throttle) reason bits, and which of them count as what.

The bits are NVML's `nvmlClocksEventReason*` values (nvml.h; `nvmlClocksThrottleReason*` is
the older name of the same bits), as nvidia-ml-py's pynvml.py defines them. BOARD_LIMIT and
RELIABILITY exist only under the older `nvmlClocksThrottleReason*` names in pynvml.py.

The classes are decided here once, for the gpu check and the efficiency report alike:

- THERMAL is SW thermal slowdown (0x20: the GPU or memory above its maximum operating
  temperature, the driver lowers clocks) together with HW thermal slowdown (0x40: the
  hardware halves clocks or worse because the GPU is too hot). Both say "too hot"; one is the
  driver's reaction, the other the hardware's.
- HW slowdown (0x8) is not thermal. nvml.h documents it as "HW Slowdown (reducing the core
  clocks by a factor of 2 or more) is engaged", an indicator of temperature too high, an
  external power brake, or power draw too high (fast trigger protection): the umbrella bit,
  whose cause the drivers that know it report alongside as 0x40 (thermal) or 0x80 (power
  brake). Counting 0x8 as thermal would call a power brake thermal.
- HW_SLOWDOWNS (0x8 | 0x40 | 0x80) are the reasons where the hardware itself cut the clocks
  by half or more: the gpu check drains a node that shows one in two readings. SW thermal
  slowdown is only a warning there (the driver easing off, not the hardware).
"""

from __future__ import annotations

from typing import NamedTuple

GPU_IDLE = 0x1
APPLICATIONS_CLOCKS_SETTING = 0x2
SW_POWER_CAP = 0x4
HW_SLOWDOWN = 0x8
SYNC_BOOST = 0x10
SW_THERMAL_SLOWDOWN = 0x20
HW_THERMAL_SLOWDOWN = 0x40
HW_POWER_BRAKE_SLOWDOWN = 0x80
DISPLAY_CLOCK_SETTING = 0x100
BOARD_LIMIT = 0x200
RELIABILITY = 0x400

# Each bit's name, as the gpu check's messages show it.
REASON_BITS: dict[int, str] = {
    GPU_IDLE: "gpu_idle",
    APPLICATIONS_CLOCKS_SETTING: "applications_clocks_setting",
    SW_POWER_CAP: "sw_power_cap",
    HW_SLOWDOWN: "hw_slowdown",
    SYNC_BOOST: "sync_boost",
    SW_THERMAL_SLOWDOWN: "sw_thermal_slowdown",
    HW_THERMAL_SLOWDOWN: "hw_thermal_slowdown",
    HW_POWER_BRAKE_SLOWDOWN: "hw_power_brake_slowdown",
    DISPLAY_CLOCK_SETTING: "display_clock_setting",
    BOARD_LIMIT: "board_limit",
    RELIABILITY: "reliability",
}

THERMAL = SW_THERMAL_SLOWDOWN | HW_THERMAL_SLOWDOWN
HW_SLOWDOWNS = HW_SLOWDOWN | HW_THERMAL_SLOWDOWN | HW_POWER_BRAKE_SLOWDOWN


class ThrottleClass(NamedTuple):
    """A class of reasons: the bits that belong to it and how a page names it."""

    mask: int
    label: str


# The classes a job's report counts per GPU. SW power cap is normal at full load: reported,
# never flagged (FLAGGED_CLASSES are those that make a GPU a straggler).
CLASSES: dict[str, ThrottleClass] = {
    "hw_slowdown": ThrottleClass(HW_SLOWDOWN, "HW slowdown"),
    "thermal": ThrottleClass(THERMAL, "thermal slowdown"),
    "hw_power_brake": ThrottleClass(HW_POWER_BRAKE_SLOWDOWN, "HW power brake"),
    "sw_power_cap": ThrottleClass(SW_POWER_CAP, "SW power cap"),
}
FLAGGED_CLASSES = ("hw_slowdown", "thermal", "hw_power_brake")


def reason_names(mask: int) -> list[str]:
    """The names of the bits set in `mask`, lowest bit first (unknown bits are left out)."""
    return [name for bit, name in REASON_BITS.items() if mask & bit]
