"""The nightly HDF5 record: round trip, atomic replace, history, and a full disk.

Records are built from recorded dev-cluster figures (tests/data/bench/) judged by the real
evaluation, the way the nightly builds them.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bluevela.bench import pairing
from bluevela.bench.catalog import get
from bluevela.bench.evaluate import evaluate
from bluevela.bench.nightly import NightlyOutcome, SubjectResult, to_record
from bluevela.bench.result import Facts
from bluevela.bench.runner import facts_from_document
from bluevela.bench.store import (
    NightRecord,
    history,
    list_nights,
    night_path,
    read_night,
    series,
    write_night,
)
from bluevela.errors import ArchiveError
from bluevela.fleet.nodestate import DrainOutcome
from bluevela.site import Site, load_site
from tests.conftest import DATA, REPO, small_tmpfs

BENCH = DATA / "bench"
NODES = ("node1", "node2", "node3")


def _site() -> Site:
    return load_site(REPO / "site.yaml")


def _pair_facts(throttled: bool) -> list[Facts]:
    suffix = "_throttled" if throttled else ""
    return [Facts.from_dict(json.loads((BENCH / f"cpu_pair_{m}{suffix}.json").read_text()))
            for m in ("allreduce", "mpi")]


def sample_outcome(night: str = "2026-11-20", slow: str | None = "node3",
                   scale: float = 1.0) -> NightlyOutcome:
    """A 3-node night from recorded figures: node1's run stands in for every node (scaled),
    the healthy pair figures for healthy pairs and the throttled ones for pairs with `slow`."""
    site = _site()
    th = site.node_class(name="cpu").bench
    node_doc = json.loads((BENCH / "cpu_node1_run.json").read_text())
    out = NightlyOutcome(night, list(NODES), {}, dict.fromkeys(NODES, "cpu"),
                         started_utc=f"{night}T01:00:00Z", finished_utc=f"{night}T01:01:00Z")
    for i, node in enumerate(NODES):
        facts = []
        for f in facts_from_document(node_doc):
            figs = tuple(type(x)(x.name, x.value * scale, x.unit, x.device, x.size)
                         for x in f.figures)
            facts.append(Facts(f.measurement, figs, f.applicable, f.ran, f.note, (node,)))
        out.singles[node] = SubjectResult((node,), [evaluate(get(f.measurement), f, th)
                                                    for f in facts], 100 + i)
    plan = [("node1", "node2"), ("node1", "node3")]
    if slow:
        plan.append(("node2", "node3"))
    obs = []
    for rnd, p in enumerate(plan, start=1):
        bad = slow in p if slow else False
        results = [evaluate(get(f.measurement), f, th) for f in _pair_facts(bad)]
        out.pairs.append(SubjectResult(p, results, 200 + rnd, rnd))
        obs.append(pairing.Observation(p, bad))
    out.verdict = pairing.verdict(obs)
    for node, partners in out.verdict.culprits.items():
        out.culprits[node] = f"nightly {night}: pairwise bandwidth slow with {', '.join(partners)}"
        out.drains.append(DrainOutcome(node, True, "bv: " + out.culprits[node]))
    return out


def sample_record(night: str = "2026-11-20", slow: str | None = "node3",
                  scale: float = 1.0) -> NightRecord:
    return to_record(sample_outcome(night, slow, scale), _site())


# Four healthy nights before the judged one (the pages' history).
NIGHTS = ("2026-11-16", "2026-11-17", "2026-11-18", "2026-11-19")


def write_sample_nights(root: Path) -> Path:
    """`NIGHTS` (each 5 % faster than the one before) and 2026-11-20, whose node3 is slow,
    written under `root`; `root`."""
    for i, night in enumerate(NIGHTS):
        write_night(root, sample_record(night, slow=None, scale=1.0 + 0.05 * i))
    write_night(root, sample_record("2026-11-20", slow="node3"))
    return root


def _same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b


def test_round_trip_keeps_every_row(tmp_path: Path) -> None:
    rec = sample_record()
    path = write_night(tmp_path, rec)
    assert path == tmp_path / "2026-11-20.h5"
    back = read_night(path)
    assert (back.night, back.cluster, back.started_utc) == (rec.night, rec.cluster,
                                                            rec.started_utc)
    assert len(back.figures) == len(rec.figures) > 40
    for a, b in zip(rec.figures, back.figures, strict=True):
        assert (a.scope, a.node, a.peer, a.measurement, a.name, a.unit, a.device, a.size,
                a.headline, a.status, a.job_id, a.round) == (
            b.scope, b.node, b.peer, b.measurement, b.name, b.unit, b.device, b.size,
            b.headline, b.status, b.job_id, b.round)
        assert _same(a.value, b.value) and _same(a.baseline, b.baseline)
    assert back.results == rec.results
    assert back.nodes == rec.nodes and back.pairs[0].node == "node1"
    assert [n.node for n in back.nodes if n.drained] == ["node3"]
    # every node's and every pair's headline figures are there
    heads = {(f.node, f.peer, f.name) for f in back.figures if f.headline}
    for node in NODES:
        assert (node, "", "gemm_tflops") in heads and (node, "", "hbm_gbs") in heads
    for p in (("node1", "node2"), ("node1", "node3"), ("node2", "node3")):
        assert (*p, "pair_busbw_gbs") in heads and (*p, "mpi_bw_gbs") in heads


def test_the_layout_is_compound_datasets(tmp_path: Path) -> None:
    import h5py

    path = write_night(tmp_path, sample_record())
    with h5py.File(path, "r") as f:
        assert f.attrs["schema"] == 1
        assert set(f) == {"figures", "results", "nodes", "pairs"}
        assert f["figures"].dtype.names[:4] == ("scope", "node", "peer", "measurement")
        assert json.loads(f.attrs["link_faults"]) == []


def test_rewrite_replaces_atomically_and_leaves_no_temp(tmp_path: Path) -> None:
    write_night(tmp_path, sample_record(slow=None))
    write_night(tmp_path, sample_record(slow="node3"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["2026-11-20.h5"]
    assert read_night(tmp_path / "2026-11-20.h5").nodes[2].culprit


def test_history_is_per_node_and_pooled_for_pairs(tmp_path: Path) -> None:
    for day, scale in (("2026-11-17", 1.0), ("2026-11-18", 2.0), ("2026-11-19", 3.0)):
        write_night(tmp_path, sample_record(day, slow=None, scale=scale))
    assert list_nights(tmp_path) == ["2026-11-17", "2026-11-18", "2026-11-19"]
    hist = history(tmp_path, "2026-11-19", nights=7)  # strictly before the night judged
    gemm = series(hist, ["node1"], "gemm")["gemm_tflops"]
    assert len(gemm) == 2 and gemm[1] == pytest.approx(2 * gemm[0])
    pair = series(hist, ["node1", "node3"], "allreduce-pair")["pair_busbw_gbs"]
    assert len(pair) == 2  # one value per night (the median over both nodes' pairs)
    assert history(tmp_path, "2026-11-19", nights=1).keys()
    assert len(series(history(tmp_path, "2026-11-20", nights=1), ["node1"], "gemm")
               ["gemm_tflops"]) == 1


def test_bad_night_names_and_long_names_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ArchiveError):
        night_path(tmp_path, "../../etc/passwd")
    rec = sample_record()
    rec.nodes[0] = type(rec.nodes[0])("n" * 80, "cpu", 0, False, False, "")
    with pytest.raises(ArchiveError, match="longer than 64"):
        write_night(tmp_path, rec)
    assert list(tmp_path.iterdir()) == []


def test_full_disk_keeps_the_old_record(tmp_path: Path) -> None:
    with small_tmpfs(tmp_path / "full") as small:
        write_night(small, sample_record(slow=None))
        before = (small / "2026-11-20.h5").read_bytes()
        big = sample_record(slow="node3")
        big.figures.extend(big.figures * 30)  # far more than 64 KiB
        with pytest.raises(ArchiveError):
            write_night(small, big)
        assert (small / "2026-11-20.h5").read_bytes() == before
        assert sorted(p.name for p in small.iterdir()) == ["2026-11-20.h5"]
