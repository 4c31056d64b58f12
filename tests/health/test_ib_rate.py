"""Issue 24: an IB error counter's rise is judged as a rate over the real interval since the
last reading when that reading is older than `ib_limits.increase_window_s` (1 h).

Recorded fixture trees (tests/data/health, tests/fixture_trees.py): `h100-ib-link-downed-rising`
(mlx5_2/1 link_downed 0 -> 3 since its stored reading) and copies of `h100-healthy` whose
counters are raised as the kernel would show them. On 9058adc every one of these was CRITICAL,
whatever the age of the last reading: after a days-long job, one switch reboot drained every
attached node (up to the fleet breaker).
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

from bluevela.health.checks import get_check
from bluevela.health.checks.ib import judge_increase
from bluevela.health.context import ProbeContext
from bluevela.health.result import Status
from bluevela.health.state import IB_COUNTERS
from bluevela.site import NodeClass, load_site
from tests.fixture_trees import materialized

REPO = Path(__file__).resolve().parents[2]
FIXTURES = materialized()
DAY = 86400.0


@pytest.fixture(scope="module")
def h100() -> NodeClass:
    return load_site(REPO / "site.yaml").node_class(name="h100")


def _ctx(cls: NodeClass, root: Path, state: Path) -> ProbeContext:
    return ProbeContext(cls, "h100", root=root, state_dir=state, phase="epilog")


def _baseline(state: Path, fixture: str, age_s: float) -> None:
    """The fixture's stored reading, taken `age_s` ago."""
    state.mkdir(parents=True, exist_ok=True)
    data = json.loads((FIXTURES / fixture / "state" / IB_COUNTERS).read_text())
    data["time"] = time.time() - age_s
    (state / IB_COUNTERS).write_text(json.dumps(data))


def test_a_burst_after_a_days_old_reading_is_judged_as_a_rate(h100: NodeClass,
                                                              tmp_path: Path) -> None:
    """link_downed +3 since a reading 3 days old (a switch reboot during a long job): a
    WARNING that names the rate, not a drain."""
    _baseline(tmp_path / "state", "h100-ib-link-downed-rising", 3 * DAY)
    r = get_check("ib").run_once(_ctx(h100, FIXTURES / "h100-ib-link-downed-rising" / "root",
                                      tmp_path / "state"))
    assert r.status is Status.WARNING, r.summary
    assert r.summary.startswith("mlx5_2/1 link_downed +3 in 3 d (0 -> 3, allowed +0 per 60 min; "
                                "over 3 d that is 0.0417/h, under 1 per 60 min: not a drain)"), \
        r.summary
    assert r.metrics["baseline_age_s"] == pytest.approx(3 * DAY, abs=60)


def test_the_same_rise_within_the_window_still_drains(h100: NodeClass, tmp_path: Path) -> None:
    _baseline(tmp_path / "state", "h100-ib-link-downed-rising", 40 * 60)
    r = get_check("ib").run_once(_ctx(h100, FIXTURES / "h100-ib-link-downed-rising" / "root",
                                      tmp_path / "state"))
    assert r.status is Status.CRITICAL
    assert r.summary.startswith("mlx5_2/1 link_downed +3 in 40 min (0 -> 3, allowed +0)"), r.summary


@pytest.mark.parametrize(("counter", "rise", "age_s", "status"), [
    ("link_downed", 100, 2 * DAY, Status.CRITICAL),  # 2.1 per hour for 2 days: flapping
    ("link_downed", 40, 2 * DAY, Status.WARNING),  # 0.83 per hour on average
    ("symbol_error", 30, 3 * DAY, Status.WARNING),  # allowed +10: 0.42 per hour
    ("symbol_error", 300, DAY, Status.CRITICAL),  # 12.5 per hour >= 11
])
def test_a_rate_over_days(h100: NodeClass, tmp_path: Path, counter: str, rise: int,
                          age_s: float, status: Status) -> None:
    root = tmp_path / "root"
    shutil.copytree(FIXTURES / "h100-healthy" / "root", root)
    state = tmp_path / "state"
    ctx = _ctx(h100, root, state)
    assert get_check("ib").run_once(ctx).status is Status.OK  # writes the baseline
    path = root / "sys/class/infiniband/mlx5_4/ports/1/counters" / counter
    path.write_text(f"{int(path.read_text()) + rise}\n")
    data = json.loads((state / IB_COUNTERS).read_text())
    data["time"] = time.time() - age_s
    (state / IB_COUNTERS).write_text(json.dumps(data))
    r = get_check("ib").run_once(ctx)
    assert r.status is status, r.summary
    assert f"mlx5_4/1 {counter} +{rise} in " in r.summary, r.summary


def test_judge_increase_by_hand() -> None:
    """The arithmetic on numbers worked by hand: window 1 h, allowed +0."""
    assert judge_increase("p", "link_downed", 0, 1, 0, None, 3600.0)[0] is Status.CRITICAL
    assert judge_increase("p", "link_downed", 0, 1, 0, 3600.0, 3600.0)[0] is Status.CRITICAL
    # +1 over 2 h: 0.5 per hour < 1: a burst, not a flapping link.
    assert judge_increase("p", "link_downed", 0, 1, 0, 7200.0, 3600.0)[0] is Status.WARNING
    # +2 over 2 h: 1 per hour on average: CRITICAL.
    status, text = judge_increase("p", "link_downed", 5, 7, 0, 7200.0, 3600.0)
    assert status is Status.CRITICAL
    assert text == "p link_downed +2 in 2.0 h (5 -> 7, allowed +0 per 60 min; 1 per 60 min on average, 1/h)"
