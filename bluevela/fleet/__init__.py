"""Operating the cluster: what acts on many nodes through Slurm.

`nodestate` drains and resumes (bluevela's own drains only) and holds the fleet breaker; `api`
is the operator's view (`bv health nodes`, `--versions`, resume with a recheck, DCGM before
resume). This package may use the checks in `bluevela.health`; the checks never use it.
"""
