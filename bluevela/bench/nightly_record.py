"""A night's outcome as its HDF5 record (`bench.store.NightRecord`): one row per figure,
result, node and pair. Apart from the orchestration in `bench/nightly.py` (which calls it and
names it `nightly.to_record`); it needs that module's types for type checking only.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from bluevela.bench.result import Status
from bluevela.bench.store import FigureRow, NightRecord, NodeRow, PairRow, ResultRow

if TYPE_CHECKING:
    from bluevela.bench.nightly import NightlyOutcome, SubjectResult
    from bluevela.site import Site


def to_record(out: NightlyOutcome, site: Site) -> NightRecord:
    """The night as an HDF5 record (rows for every figure, result, node and pair)."""
    rec = NightRecord(night=out.night, cluster=site.cluster, started_utc=out.started_utc,
                      finished_utc=out.finished_utc)
    subjects: list[tuple[str, SubjectResult]] = [("node", s) for s in out.singles.values()]
    subjects += [("pair", p) for p in out.pairs]
    for scope, subj in subjects:
        node = subj.nodes[0]
        peer = subj.nodes[1] if len(subj.nodes) > 1 else ""
        for r in subj.results:
            facts = r.facts
            rec.results.append(ResultRow(scope, node, peer, r.measurement, int(r.status),
                                         r.applicable, bool(facts and facts.ran), r.message,
                                         facts.note if facts else "", subj.job_id, subj.round))
            verdicts = {v.name: v for v in r.verdicts}
            for f in facts.figures if facts else ():
                v = verdicts.get(f.name) if f.headline else None
                rec.figures.append(FigureRow(
                    scope, node, peer, r.measurement, f.name, f.value, f.unit, f.device, f.size,
                    f.headline, int(v.status) if v else 0, v.limit if v else 0.0,
                    v.baseline if v else math.nan, subj.job_id, subj.round))
    drained = {d.node: d for d in out.drains}
    for node, single in out.singles.items():
        d = drained.get(node)
        reason = out.culprits.get(node, "")
        if d is not None:
            reason = d.reason if d.drained else f"{reason} [not drained: {d.why_not}]"
        status = single.status
        if node in out.culprits:
            status = Status.CRITICAL
        rec.nodes.append(NodeRow(node, out.classes.get(node, ""), int(status),
                                 bool(d and d.drained), node in out.culprits, reason))
    for p in out.pairs:
        def head(name: str, p: SubjectResult = p) -> float:
            for r in p.results:
                if r.facts:
                    value = r.facts.headline(name)
                    if value is not None:
                        return value
            return math.nan
        rec.pairs.append(PairRow(p.nodes[0], p.nodes[1], p.round, int(p.status),
                                 any(r.status is Status.CRITICAL for r in p.results),
                                 head("pair_busbw_gbs"), head("mpi_bw_gbs"), p.job_id))
    if out.verdict:
        rec.link_faults = list(out.verdict.link_faults)
        rec.unresolved = list(out.verdict.unresolved)
    return rec
