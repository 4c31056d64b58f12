"""The spool of node reports and the HDF5 run archive (docs/archive.md).

`spool` (report format; writing, reading, quarantine), `ingest` (spool -> archive),
`store` (segment files, manifest, writer lock, compaction), `schema` (dtypes and checker),
`tables` (rows <-> reports), `query` (the read API under `bv archive`), `series` (the time
series files), `sample` (synthetic reports for tests and benchmarks). Storage only: the
EpilogSlurmctld entry point is `bluevela.hooks.slurmctld`, the analyses and pages over the
archive are in `bluevela.report`.
Only `spool` is imported on the hooks' path; the rest imports numpy/h5py lazily.
"""
