"""Node telemetry: the sampler daemon (`sampler`) and its on-disk format (`format`).

docs/install.md says how the sampler runs on a node; docs/archive.md where a job's window of
samples ends up.
"""
