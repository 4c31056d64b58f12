"""The `bv` command: a thin click layer over the library.

Subcommands live in `bluevela/cli/cmd_<name>.py`, each exposing `command`; they are found and
imported lazily, so `bv --help` imports only click and those light modules (never torch, h5py,
numpy or pynvml: those are imported inside the library functions that need them).
"""

from __future__ import annotations

import importlib
import logging
import pkgutil
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import click

from bluevela import __version__
from bluevela.errors import BluevelaError, SiteConfigError
from bluevela.util.term import printable

if TYPE_CHECKING:
    from bluevela.site import Site
    from bluevela.slurm.client import SlurmClient


@dataclass
class State:
    """Per-invocation state carried in `ctx.obj`."""

    site_path: str | None = None
    verbose: int = 0
    _site: Site | None = field(default=None, repr=False)

    def site(self) -> Site:
        """The site model, loaded once (raises SiteConfigError)."""
        if self._site is None:
            from bluevela.site import load_site

            self._site = load_site(self.site_path)
        return self._site

    def site_or_none(self) -> Site | None:
        """The site when one can be found; None when there is no site file at all."""
        from bluevela.site_file import find_site_path

        try:
            find_site_path(self.site_path)
        except SiteConfigError:
            return None
        return self.site()

    def client(self, retry_s: float | None = None) -> SlurmClient:
        from bluevela.slurm.connect import get_client

        return get_client(retry_s=retry_s)


def _command_modules() -> dict[str, str]:
    import bluevela.cli as pkg

    return {
        m.name.removeprefix("cmd_").replace("_", "-"): f"bluevela.cli.{m.name}"
        for m in pkgutil.iter_modules(pkg.__path__)
        if m.name.startswith("cmd_")
    }


class LazyGroup(click.Group):
    """Imports `bluevela.cli.cmd_<name>` only when `<name>` is used (or listed by --help)."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(super().list_commands(ctx)) | set(_command_modules()))

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        found = super().get_command(ctx, cmd_name)
        if found is not None:
            return found
        module = _command_modules().get(cmd_name)
        if module is None:
            return None
        cmd = importlib.import_module(module).command
        if not isinstance(cmd, click.Command):
            raise TypeError(f"{module}.command is not a click command")
        return cmd


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--site", "site_path", metavar="PATH", envvar=None,
              help="site.yaml (default: $BV_SITE, /etc/bluevela/site.yaml, then ./site.yaml "
                   "where there is no system file).")
@click.option("-v", "--verbose", count=True, help="More log output (-vv for debug).")
@click.version_option(__version__, prog_name="bv")
@click.pass_context
def cli(ctx: click.Context, site_path: str | None, verbose: int) -> None:
    """bluevela: run a GPU supercomputer on Slurm.

    Submit distributed PyTorch jobs, check node health from the Slurm prolog/epilog, keep an
    HDF5 archive of every run, and run the nightly acceptance benchmarks.
    """
    level = logging.WARNING - 10 * min(verbose, 2)
    logging.basicConfig(level=level, format="bv: %(levelname)s: %(message)s")
    ctx.obj = State(site_path=site_path, verbose=verbose)


def main(argv: list[str] | None = None) -> Any:
    """Entry point: expected errors become one line on stderr and a non-zero exit."""
    try:
        return cli.main(args=argv, prog_name="bv", standalone_mode=False)
    except SiteConfigError as exc:
        lines = exc.problems or [str(exc)]
        for line in lines:
            click.echo(f"bv: {line}" if not exc.problems else line, err=True)
        sys.exit(exc.exit_code)
    except BluevelaError as exc:
        # One line even when the message carries a tool's stderr or another user's value.
        click.echo(f"bv: error: {printable(exc)}", err=True)
        sys.exit(exc.exit_code)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except click.UsageError as exc:
        # One line, like every other error; the usage block is one `--help` away.
        where = exc.ctx.command_path if exc.ctx is not None else "bv"
        click.echo(f"{where}: error: {printable(exc.format_message())} "
                   f"(see '{where} --help')", err=True)
        sys.exit(exc.exit_code)
    except click.ClickException as exc:
        click.echo(f"bv: error: {printable(exc.format_message())}", err=True)
        sys.exit(exc.exit_code)
    except click.Abort:
        click.echo("bv: aborted", err=True)
        sys.exit(130)
    except KeyboardInterrupt:
        click.echo("bv: interrupted", err=True)
        sys.exit(130)
    except BrokenPipeError:
        sys.exit(141)
