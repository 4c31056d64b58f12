"""The Slurm Prolog / Epilog / HealthCheckProgram entry points.

`prolog_epilog/{prolog,epilog,healthcheck}` are thin shell shims that run
`bluevela.hooks.phases.run_hook(<phase>)` with `python -I -c` and fail open: only run_hook's
deliberate exit 1 (the prolog keeping a job off a failing node) reaches Slurm, as 100 -> 1;
a package that does not import, a crash or a missing interpreter exits 0 with one syslog line
(docs/health.md, "A broken install cannot drain the fleet"). `python -m bluevela.hooks
<phase>` and `bv hook <phase>` are the same entry, with run_hook's own exit code. This package
stays light (no click, no torch, no pynvml at import): the prolog's quick path is timed.
"""

from __future__ import annotations

HOOK_PHASES = ("prolog", "epilog", "healthcheck")

__all__ = ["HOOK_PHASES", "main"]


def main(argv: list[str] | None = None) -> int:
    """`python -m bluevela.hooks prolog|epilog|healthcheck`; returns the exit code for Slurm."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0] not in HOOK_PHASES:
        print(f"usage: python -m bluevela.hooks {{{'|'.join(HOOK_PHASES)}}}", file=sys.stderr)
        return 2
    from bluevela.hooks.phases import run_hook

    return run_hook(args[0])
