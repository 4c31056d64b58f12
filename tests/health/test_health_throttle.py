"""The throttle-reason bits against the installed NVML binding, and the classes decided once."""

from __future__ import annotations

import pynvml

from bluevela.health import throttle


def test_bits_are_the_bindings() -> None:
    # Each bit under NVML's current name where the binding has it, else the older name.
    for bit, name in throttle.REASON_BITS.items():
        camel = "".join(w.capitalize() for w in name.split("_"))
        candidates = [f"nvmlClocksEventReason{camel}", f"nvmlClocksThrottleReason{camel}"]
        found = [getattr(pynvml, c) for c in candidates if hasattr(pynvml, c)]
        assert found, (name, candidates)
        assert all(v == bit for v in found), name


def test_thermal_is_sw_and_hw_thermal_not_the_umbrella_hw_slowdown() -> None:
    assert throttle.THERMAL == (pynvml.nvmlClocksThrottleReasonSwThermalSlowdown
                                | pynvml.nvmlClocksThrottleReasonHwThermalSlowdown)
    assert not throttle.THERMAL & pynvml.nvmlClocksThrottleReasonHwSlowdown
    assert throttle.CLASSES["thermal"].mask == throttle.THERMAL
    mask, label = throttle.CLASSES["hw_power_brake"]
    assert (mask, label) == (pynvml.nvmlClocksThrottleReasonHwPowerBrakeSlowdown, "HW power brake")
    assert set(throttle.FLAGGED_CLASSES) <= set(throttle.CLASSES)
    assert "sw_power_cap" not in throttle.FLAGGED_CLASSES


def test_hw_slowdowns_and_names() -> None:
    assert throttle.HW_SLOWDOWNS == 0x8 | 0x40 | 0x80
    assert throttle.reason_names(0x1 | 0x40 | 0x8 | 0x10000) == [
        "gpu_idle", "hw_slowdown", "hw_thermal_slowdown"]
    assert throttle.reason_names(0) == []
