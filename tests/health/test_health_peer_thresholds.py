"""Thresholds learned from peer health checkers (docs/peers.md, "Thresholds learned").

- XID 62 (internal micro-controller halt) and 80 (corrupted data sent to the GPU): aznhc, Imbue
  and gpud treat them as hardware; bluevela's table used to leave them at WARNING (unknown).
- `excessive_buffer_overrun_errors`: a lossless fabric overran a receive buffer; NVSentinel's
  design treats any as fatal, bluevela used to warn only at a rate of 1/h.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

from bluevela.health.checks import get_check
from bluevela.health.context import ProbeContext
from bluevela.health.result import Status
from bluevela.health.state import IB_COUNTERS
from bluevela.site import NodeClass, load_site
from tests.fixture_trees import materialized

REPO = Path(__file__).resolve().parents[2]
HEALTH = materialized()


@pytest.fixture(scope="module")
def h100() -> NodeClass:
    return load_site(REPO / "site.yaml").node_class(name="h100")


@pytest.mark.parametrize(("code", "meaning", "status"), [
    (62, "internal micro-controller halt", Status.CRITICAL),
    # NVIDIA's XID catalog: RESTART_APP, an application error (issue 16 §5).
    (80, "corrupted data sent to the GPU", Status.WARNING),
])
def test_xid_62_drains_and_80_warns_in_the_window(h100: NodeClass, tmp_path: Path, code: int,
                                                  meaning: str, status: Status) -> None:
    # The recent-XID-79 snapshot (388 s before the reading) with the code swapped.
    snap = json.loads((HEALTH / "h100-gpu-xid79-recent" / "nvml.json").read_text())
    lines = snap["kmsg"]
    assert any("Xid (PCI:0000:5d:00): 79," in line for line in lines)
    snap["kmsg"] = [line.replace("Xid (PCI:0000:5d:00): 79,", f"Xid (PCI:0000:5d:00): {code},")
                    for line in lines]
    path = tmp_path / "nvml.json"
    path.write_text(json.dumps(snap))
    ctx = ProbeContext(h100, "h100", root=HEALTH / "h100-healthy" / "root", nvml_snapshot=path,
                       phase="prolog")
    r = get_check("gpu").run_once(ctx)
    assert r.status is status, r
    assert f"XID {code} on GPU3 (PCI 0000:5d:00): {meaning}" in r.summary, r.summary


def test_any_buffer_overrun_rise_is_critical(h100: NodeClass, tmp_path: Path) -> None:
    root = tmp_path / "root"
    shutil.copytree(HEALTH / "h100-healthy" / "root", root)
    state = tmp_path / "state"
    state.mkdir()
    ctx = ProbeContext(h100, "h100", root=root, state_dir=state, phase="healthcheck")
    assert get_check("ib").run_once(ctx).status is Status.OK  # the baseline
    counter = root / "sys/class/infiniband/mlx5_1/ports/1/counters/excessive_buffer_overrun_errors"
    counter.write_text(f"{int(counter.read_text()) + 1}\n")
    stored = json.loads((state / IB_COUNTERS).read_text())
    stored["time"] = time.time() - 600
    (state / IB_COUNTERS).write_text(json.dumps(stored))
    r = get_check("ib").run_once(ctx)
    assert r.status is Status.CRITICAL, r
    assert "mlx5_1/1 excessive_buffer_overrun_errors +1 in 10 min" in r.summary, r.summary
