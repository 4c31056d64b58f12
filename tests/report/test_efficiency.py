"""Job efficiency and straggler detection (`bluevela.report.efficiency`) on synthetic series.

Each series is written with `write_series` (the archive's layout) and read back through
`efficiency_of_file` (the path `bv archive show --efficiency` takes), so the block-wise reader is
exercised too. The healthy jobs carry realistic noise; a straggler must be named with its evidence
and the healthy nodes must not be.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from bluevela.archive.series_layout import JobSeries, write_series
from bluevela.errors import ArchiveError
from bluevela.report.efficiency import analyze, efficiency_of_file
from bluevela.report.efficiency_model import Thresholds

T0 = 1_790_000_000.0


def make_series(nodes: int = 8, gpus: int = 4, samples: int = 120, *, interval: float = 10.0,
                seed: int = 1, ramp: int = 3) -> SimpleNamespace:
    """A healthy synchronous job: util ~95 %, power ~690 W, clock ~1980 MHz, with noise; a
    ramp-up of `ramp` samples at the start and the end."""
    rng = np.random.default_rng(seed)
    shape = (nodes, gpus, samples)
    level = np.ones(samples)
    level[:ramp] = np.linspace(0.05, 0.35, ramp)
    level[samples - ramp:] = np.linspace(0.35, 0.05, ramp)
    util = np.clip(95 * level + rng.normal(0, 3, shape), 0, 100)
    power = 90 + 600 * level + rng.normal(0, 15, shape)
    clock = 1980 + rng.normal(0, 15, shape)
    temp = 45 + 25 * level + rng.normal(0, 1.5, shape)
    reasons = np.where(rng.random(shape) < 0.3, 0x4, 0).astype(np.float64)  # SW power cap: normal
    ns = (nodes, samples)
    gpu = {"util_pct": util, "power_w": power, "sm_clock_mhz": clock, "temp_c": temp,
           "clocks_event_reasons": reasons,
           "mem_used_bytes": np.full(shape, 60e9), "xid_count": np.zeros(shape)}
    node = {"cpu_busy_pct": np.clip(35 * level + rng.normal(0, 3, ns), 0, 100),
            "cpu_throttled_pct": np.clip(rng.normal(0, 0.2, ns), 0, 100),
            "mem_used_bytes": np.full(ns, 2e11), "net_rx_bytes_per_s": np.full(ns, 1e6),
            "net_tx_bytes_per_s": np.full(ns, 1e6)}
    return SimpleNamespace(
        job_id=4242, interval_s=interval, time=T0 + interval * np.arange(samples),
        nodes=[f"gpu{i:03d}" for i in range(nodes)],
        gpu={k: v.astype(np.float32) for k, v in gpu.items()},
        node={k: v.astype(np.float32) for k, v in node.items()}, ib={})


def write_h5(path: Path, s: SimpleNamespace) -> Path:
    """The archive's layout, through H3's `write_series` (what ingest reads and writes)."""
    write_series(path, JobSeries(job_id=s.job_id, interval_s=s.interval_s, time=s.time,
                                 nodes=list(s.nodes), gpu=s.gpu, ib={}, node=s.node))
    return path


def run(tmp_path: Path, s: SimpleNamespace, job: dict[str, Any] | None = None,
        **kw: Any) -> Any:
    eff = efficiency_of_file(write_h5(tmp_path / "s.h5", s), job, block_nodes=3, **kw)
    json.dumps(eff.to_dict())  # the --json form must serialise
    return eff


def test_healthy_noisy_job_names_no_straggler(tmp_path: Path) -> None:
    for seed in range(4):
        eff = run(tmp_path, make_series(nodes=16, seed=seed))
        assert eff.stragglers == [], [s.evidence for s in eff.stragglers]
        assert eff.idle_gpus == [] and eff.missing == []
        assert eff.restarts["count"] == 0


def test_slow_gpu_named_with_util_and_clock(tmp_path: Path) -> None:
    s = make_series()
    s.gpu["util_pct"][5, 2, 3:-3] = 70 + np.random.default_rng(9).normal(0, 3, 114)
    s.gpu["sm_clock_mhz"][5, 2, 3:-3] = 1400
    eff = run(tmp_path, s)
    assert [(x.node, x.gpu) for x in eff.stragglers] == [("gpu005", 2)]
    ev = eff.stragglers[0].evidence
    assert re.fullmatch(r"gpu005 GPU 2: util 7\d% vs job median 9[45]%, "
                        r"SM clock 14\d\d MHz vs job median 19[78]\d MHz", ev), ev
    assert eff.per_node[5]["straggler"] and not eff.per_node[4]["straggler"]


def test_power_braked_gpu_named_with_share(tmp_path: Path) -> None:
    s = make_series(nodes=20, gpus=8)
    rng = np.random.default_rng(3)
    steady = slice(3, -3)
    s.gpu["power_w"][17, 3, steady] = 410 + rng.normal(0, 10, 114)
    brake = rng.random(114) < 0.38
    s.gpu["clocks_event_reasons"][17, 3, steady] = np.where(brake, 0x80 | 0x4, 0)
    eff = run(tmp_path, s)
    assert [(x.node, x.gpu) for x in eff.stragglers] == [("gpu017", 3)]
    ev = eff.stragglers[0].evidence
    assert re.match(r"gpu017 GPU 3: power 4[01]\d W vs job median 69\d W", ev), ev
    share = brake.mean()
    assert f"HW power brake {share:.0%} of samples (job median 0%)" in ev
    assert eff.stragglers[0].metrics["hw_power_brake"]["value"] == pytest.approx(share, abs=1e-3)


def test_whole_node_low_power_named_once(tmp_path: Path) -> None:
    s = make_series(nodes=10)
    s.gpu["power_w"][7, :, 3:-3] -= 250
    eff = run(tmp_path, s)
    assert [(x.node, x.gpu) for x in eff.stragglers] == [("gpu007", None)]
    assert re.fullmatch(r"gpu007 \(all 4 GPUs\): power 44\d W vs job median 6[89]\d W",
                        eff.stragglers[0].evidence), eff.stragglers[0].evidence


def test_thermal_throttle_on_one_gpu(tmp_path: Path) -> None:
    s = make_series()
    s.gpu["clocks_event_reasons"][2, 1, 40:100] = 0x40
    s.gpu["temp_c"][2, 1, 40:100] = 92
    eff = run(tmp_path, s)
    assert [(x.node, x.gpu) for x in eff.stragglers] == [("gpu002", 1)]
    assert "thermal slowdown 53% of samples (job median 0%)" in eff.stragglers[0].evidence


def test_cpu_throttled_node_named_with_others(tmp_path: Path) -> None:
    """The dev-cluster case: CPU nodes (no GPUs), one node's cgroup throttled."""
    s = make_series(nodes=3, gpus=0, samples=20, interval=2.0, ramp=2)
    s.node["cpu_throttled_pct"][1] = 0
    s.node["cpu_throttled_pct"][1, 3:20:] = 60  # 17 of 20 samples
    s.node["cpu_throttled_pct"][2, 5] = 8  # one blip on another node
    eff = run(tmp_path, s)
    assert eff.steady["basis"] == "CPU busy"
    assert eff.straggler_nodes == ["gpu001"]
    ev = eff.stragglers[0].evidence
    assert ev.startswith("gpu001: CPU throttled "), ev
    assert "(others ≤6%)" in ev  # 1 of 16 steady samples on gpu002


def test_cpu_busy_outlier(tmp_path: Path) -> None:
    s = make_series(nodes=6, gpus=0, samples=30)
    s.node["cpu_busy_pct"][4, 3:-3] = 5
    eff = run(tmp_path, s)
    assert [x.evidence for x in eff.stragglers] == ["gpu004: CPU busy 5% vs job median 35%"]


def test_nan_gaps_and_missing_node(tmp_path: Path) -> None:
    s = make_series(nodes=8)
    for m in s.gpu.values():
        m[3, :, 20:50] = np.nan  # a node's sampler restarted: 30 samples missing
        m[6] = np.nan  # a node that reported nothing at all
    for m in s.node.values():
        m[3, 20:50] = np.nan
        m[6] = np.nan
    job = {"nodelist": [*s.nodes, "gpu099"], "nodes": []}
    eff = run(tmp_path, s, job)
    assert eff.stragglers == []
    assert {m["node"] for m in eff.missing} == {"gpu006", "gpu099"}
    assert eff.per_node[3]["coverage"] == pytest.approx(84 / 114, abs=0.01)
    assert eff.idle_gpus == []


def test_idle_gpus_reported_not_stragglers(tmp_path: Path) -> None:
    s = make_series(nodes=6)
    s.gpu["util_pct"][2, 3] = 0
    s.gpu["power_w"][2, 3] = 60
    eff = run(tmp_path, s)
    assert eff.idle_gpus == [{"node": "gpu002", "gpu": 3, "idle_share": 1.0}]
    assert eff.stragglers == []


def test_figures_match_hand_computed(tmp_path: Path) -> None:
    """A 2-node x 1-GPU x 6-sample series whose figures are easy to compute by hand."""
    nan = np.nan
    util = np.array([[[0, 80, 90, 100, 90, 0]], [[0, 60, 70, 80, nan, 0]]], np.float32)
    power = np.array([[[100, 400, 500, 600, 500, 100]], [[100, 300, 300, 300, nan, 100]]],
                     np.float32)
    s = SimpleNamespace(job_id=7, interval_s=5.0, time=T0 + 5.0 * np.arange(6),
                        nodes=["a", "b"], gpu={"util_pct": util, "power_w": power}, node={},
                        ib={})
    job = {"nodelist": ["a", "b"], "nodes": [
        {"node": "a", "epilog": {"telemetry": {"gpu_energy_j": 11000.0}}},
        {"node": "b", "epilog": {"telemetry": {"gpu_energy_j": 6100.0}}}]}
    eff = analyze(s, job)
    # energy: sum(power) * 5 s: a 2200 W*samples -> 11000 J, b 1100 -> 5500 J
    assert eff.energy["series_j"] == 16500
    assert eff.energy["epilog_j"] == 17100
    assert [p["gpu_energy_j"] for p in eff.per_node] == [11000, 5500]
    # overall util: mean of the 11 valid samples
    assert eff.gpu["util_mean_pct"] == pytest.approx(round(570 / 11, 1))
    # job-wide activity per sample: 0, 70, 80, 90, 90, 0; p90 = 90; steady >= 45: samples 1-4
    assert eff.steady["samples"] == 4 and eff.steady["activity_p90"] == 90.0
    # steady util per GPU: a (80+90+100+90)/4 = 90, b (60+70+80)/3 = 70
    assert [p["gpu_util_pct"] for p in eff.per_node] == [90.0, 70.0]
    assert [p["gpu_power_w"] for p in eff.per_node] == [500.0, 300.0]
    assert eff.gpu["power_total_steady_kw"] == 0.8
    assert eff.restarts["startup_s"] == 5.0
    assert eff.stragglers == []  # two units: below min_peers, no comparison
    assert math.isclose(eff.duration_s, 30.0)


def test_restart_gap_measured(tmp_path: Path) -> None:
    s = make_series(nodes=4, samples=200)
    s.gpu["util_pct"][:, :, 100:130] = 0  # every GPU idle for 30 samples = 300 s
    s.gpu["power_w"][:, :, 100:130] = 80
    s.node["cpu_busy_pct"][:, 100:130] = 1
    s.gpu["util_pct"][:, :, 50:53] = 1  # a 30 s checkpoint: a stall, not a restart
    eff = run(tmp_path, s)
    assert eff.restarts["count"] == 1
    assert eff.restarts["lost_s"] == 300.0
    assert (eff.restarts["stalls"], eff.restarts["stalls_s"]) == (1, 30.0)
    assert eff.restarts["lost_unit_h"] == pytest.approx(300 * 16 / 3600, abs=0.01)
    assert eff.stragglers == []


def test_not_a_series_file(tmp_path: Path) -> None:
    import h5py

    p = tmp_path / "x.h5"
    with h5py.File(p, "w") as f:
        f["time"] = np.zeros(3)
    with pytest.raises(ArchiveError, match="not a bluevela job series"):
        efficiency_of_file(p)
    with h5py.File(p, "a") as f:  # the right label, a wrong shape
        f.attrs.update({"format": "bluevela-job-series", "job_id": 1, "interval_s": 10.0})
        f["nodes"] = np.array([b"a", b"b"])
        f["gpu/util_pct"] = np.zeros((2, 3), np.float32)
    with pytest.raises(ArchiveError, match=r"/gpu/util_pct has shape \(2, 3\), expected"):
        efficiency_of_file(p)
    (tmp_path / "junk.h5").write_bytes(b"not hdf5")
    with pytest.raises(ArchiveError, match="cannot open"):
        efficiency_of_file(tmp_path / "junk.h5")


def test_thresholds_are_honoured(tmp_path: Path) -> None:
    s = make_series()
    s.gpu["util_pct"][5, 2, 3:-3] -= 12  # 12 points low: flagged at 10, not at 15
    assert [(x.node, x.gpu) for x in run(tmp_path, s).stragglers] == [("gpu005", 2)]
    strict = Thresholds(util_min_drop_pct=15.0)
    assert run(tmp_path, s, thresholds=strict).stragglers == []
