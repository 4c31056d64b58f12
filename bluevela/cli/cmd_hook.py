"""`bv hook prolog|epilog|healthcheck`: the Slurm hook entry (same as `python -m bluevela.hooks`)."""

from __future__ import annotations

import sys

import click

from bluevela.hooks import HOOK_PHASES


@click.command()
@click.argument("phase", type=click.Choice(HOOK_PHASES))
def command(phase: str) -> None:
    """Run the Slurm PHASE hook on this node (Slurm calls prolog_epilog/<phase>, which runs
    `python -m bluevela.hooks <phase>`: the same code, without loading the CLI)."""
    from bluevela.hooks.phases import run_hook

    sys.exit(run_hook(phase))
