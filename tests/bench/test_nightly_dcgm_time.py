"""The nightly's node jobs make room for DCGM's diagnostic (issue 24 §3: docs/health.md said
the nightly's --time "must cover" nightly_timeout_s while the limit was a fixed 30 min and the
watchdog a fixed 1800 s)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from bluevela.bench import nightly
from bluevela.site import load_site

REPO = Path(__file__).resolve().parents[2]


def test_limits_grow_by_the_dcgm_bound() -> None:
    NightlyOptions, with_dcgm_time = nightly.NightlyOptions, nightly.with_dcgm_time  # noqa: N806
    site = load_site(REPO / "site.yaml")
    off = with_dcgm_time(NightlyOptions(), site)
    assert (off.time_limit, off.job_timeout_s) == ("00:30:00", 1800.0)
    dcgm = replace(site.health.dcgm, nightly_level=3, nightly_timeout_s=3600.0)
    on_site = replace(site, health=replace(site.health, dcgm=dcgm))
    on = with_dcgm_time(NightlyOptions(), on_site)
    assert (on.time_limit, on.job_timeout_s) == ("1:30:00", 5400.0)
    days = with_dcgm_time(NightlyOptions(time_limit="1-00:00:00"), on_site)
    assert days.time_limit == "1-01:00:00"
