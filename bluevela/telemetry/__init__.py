"""Node telemetry: the sampler daemon's loop (`sampler`), its readers (`gpu`, `host`), its
segment store (`store`), the on-disk format (`format`) and the epilog's cut of a job's window
(`window`).

docs/install.md says how the sampler runs on a node; docs/archive.md where a job's window of
samples ends up.
"""
