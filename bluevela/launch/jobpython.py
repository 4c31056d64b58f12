"""The job's Python, checked at `bv submit` before the job waits in the queue.

The batch script runs `<python> -P -m bluevela.launch.supervisor` (`python3` unless `--python`
or site.yaml `launch.python` says otherwise) with the environment the job gets: the submitter's
own (bv refuses `--export`), then the script's `export` lines (site.yaml `launch.env` and
`--env`). A Python older than 3.11 fails there with `Unknown option: -P`, one without bluevela
with `No module named 'bluevela'`, both only once the job has its nodes. So `bv submit`
resolves the interpreter the same way (the job's PATH), runs it once with the job's
environment, and refuses the submit with one line when it is too old, imports no bluevela, has
no torch (bv runs torch's torchrun in that interpreter), or imports a bluevela of another
release series.

What it cannot see: a PATH that the compute node changes (a TaskProlog, a module loaded by the
job itself). `--no-python-check` skips the check for those sites (docs/byos.md).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass

from bluevela import __version__
from bluevela.errors import LaunchError

logger = logging.getLogger(__name__)

MIN_PYTHON = (3, 11)  # `-P` (3.11) and the supervisor's own code
PROBE_TIMEOUT_S = 30.0  # a cold NFS-mounted venv may take seconds to import

# Runs under any Python the job may find (2.7 included): print the version first, then the
# import the supervisor needs, without the working directory on the path (the job runs -P).
_PROBE = r"""
import sys
sys.stdout.write("python %d.%d.%d\n" % tuple(sys.version_info[:3]))
sys.stdout.flush()
if sys.path and sys.path[0] == "":
    del sys.path[0]
try:
    import bluevela
    import bluevela.launch
except BaseException:
    e = sys.exc_info()[1]
    sys.stdout.write("error %s: %s\n" % (type(e).__name__, str(e).replace("\n", " ")[:200]))
else:
    sys.stdout.write("bluevela %s\n" % getattr(bluevela, "__version__", "?"))
    import importlib.util
    # found, not imported: importing torch costs seconds
    sys.stdout.write("torch %s\n" % ("yes" if importlib.util.find_spec("torch") else "no"))
"""
_PYTHON_LINE = re.compile(r"^python (\d+)\.(\d+)\.(\d+)$", re.M)
_BV_LINE = re.compile(r"^bluevela (\S{1,64})$", re.M)
_ERROR_LINE = re.compile(r"^error (.{1,300})$", re.M)
_TORCH_LINE = re.compile(r"^torch (yes|no)$", re.M)
# How to fix any of the refusals below: the tail of each message.
_FIX = ("put a Python >= 3.11 with bluevela first on PATH (activate the training env, "
        "`module load`), or give --python /path/to/venv/bin/python3 (docs/byos.md)")


@dataclass(frozen=True)
class JobPython:
    """What the job's interpreter is: its path, version and the bluevela it imports."""

    path: str
    version: tuple[int, int, int]
    bluevela: str

    def describe(self) -> str:
        return (f"the job's Python: {self.path} (Python {'.'.join(map(str, self.version))}, "
                f"bluevela {self.bluevela})")


def job_environment(exports: tuple[tuple[str, str], ...],
                    environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment the batch script's `exec` line sees: the submitter's (sbatch's default
    `--export=ALL`), then the script's `export` lines in order."""
    env = dict(os.environ if environ is None else environ)
    env.update(dict(exports))
    return env


def resolve(python: str, env: Mapping[str, str], cwd: str) -> str | None:
    """The file `python` names in the job: a path as given (relative to the job's working
    directory), a bare name looked up on the job's PATH as bash's `exec` does; None when
    there is none."""
    if "/" in python:
        path = python if os.path.isabs(python) else os.path.join(cwd, python)
        return path if os.path.isfile(path) and os.access(path, os.X_OK) else None
    return shutil.which(python, path=env.get("PATH", os.defpath))


def series(version: str) -> tuple[str, ...]:
    """A release series: major.minor (`0.1.0` and `0.1.3` are one series; `0.2.0` is not)."""
    return tuple(version.split("+")[0].split(".")[:2])


def check_job_python(python: str, exports: tuple[tuple[str, str], ...], *,
                     cwd: str | None = None, environ: Mapping[str, str] | None = None,
                     timeout_s: float = PROBE_TIMEOUT_S, need_torch: bool = True) -> JobPython:
    """Run the job's Python once as the job will and return what it is.

    Args:
        python: the interpreter of the batch script's `exec` line (`python3`, or a path).
        exports: the script's `export` lines (site.yaml launch.env, then --env).
        cwd: the job's working directory (the submit directory).
        environ: the submitter's environment (default: this process's).
        timeout_s: bound on the probe.
        need_torch: torch must be importable there (bv runs torch's torchrun in it through the
            rendezvous guard; site.yaml `launch.rdzv_guard: optional` lets another torchrun run).

    Raises:
        LaunchError: one line saying what the job would have failed on, and how to fix it.
    """
    cwd = cwd or os.getcwd()
    env = job_environment(exports, environ)
    path = _locate(python, env, cwd)
    proc = _probe(path, env, cwd, timeout_s)
    version = _python_version(python, path, proc)
    theirs = _job_bluevela(path, proc, version, need_torch=need_torch)
    return JobPython(path=path, version=version, bluevela=theirs)


def _locate(python: str, env: Mapping[str, str], cwd: str) -> str:
    """The file the job's `exec` line would run, found the job's way (`resolve`).

    Raises:
        LaunchError: there is none; the message shows the job's PATH, since that is what a
            user has to fix.
    """
    where = f"{python!r} on the job's PATH" if "/" not in python else repr(python)
    path = resolve(python, env, cwd)
    if path is None:
        raise LaunchError(f"the job runs `{python} -P -m bluevela.launch.supervisor`, but there "
                          f"is no {where} (PATH={env.get('PATH', '')}): {_FIX}")
    return path


def _probe(path: str, env: Mapping[str, str], cwd: str,
           timeout_s: float) -> subprocess.CompletedProcess[str]:
    """Run `_PROBE` once in the job's Python with the job's environment, bounded in time.

    Only starting it can fail here; what it printed (or did not) is judged by the callers, so
    that a Python that starts but is unfit gets a message saying what is wrong with it.

    Raises:
        LaunchError: the interpreter hung past `timeout_s` or could not be executed.
    """
    try:
        return subprocess.run([path, "-c", _PROBE], env=env, cwd=cwd, capture_output=True,
                              text=True, errors="replace", timeout=timeout_s, check=False,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as exc:
        raise LaunchError(f"the job's Python {path} did not answer within {timeout_s:g} s "
                          f"(a hung file system?); --no-python-check skips this check") from exc
    except OSError as exc:
        raise LaunchError(f"the job's Python {path} cannot run: {exc.strerror}; {_FIX}") from exc


def _python_version(python: str, path: str,
                    proc: subprocess.CompletedProcess[str]) -> tuple[int, int, int]:
    """The probed interpreter's version, which must be new enough for the supervisor.

    The probe prints its version before anything else, so even a Python 2 answers this.

    Raises:
        LaunchError: the probe printed no version (it did not run) or the Python is too old.
    """
    found = _PYTHON_LINE.search(proc.stdout)
    if found is None:
        raise LaunchError(f"the job's Python {path} did not run (exit {proc.returncode}); {_FIX}")
    version = (int(found[1]), int(found[2]), int(found[3]))
    if version[:2] < MIN_PYTHON:
        raise LaunchError(f"the job's Python {path} is Python {_shown(version)}; the job needs "
                          f"Python >= {'.'.join(map(str, MIN_PYTHON))} with bluevela (it runs "
                          f"`{python} -P -m bluevela.launch.supervisor`): {_FIX}")
    return version


def _job_bluevela(path: str, proc: subprocess.CompletedProcess[str],
                  version: tuple[int, int, int], *, need_torch: bool) -> str:
    """The version of the bluevela the job's Python imports, checked against this bv's.

    The job must import a bluevela of this bv's release series (this bv writes the batch
    script that the job's supervisor reads), and, when `need_torch`, find torch beside it.

    Raises:
        LaunchError: no bluevela (with the import error the probe saw), another release
            series, or no torch.
    """
    bv = _BV_LINE.search(proc.stdout)
    if bv is None:
        err = _ERROR_LINE.search(proc.stdout)
        why = err[1] if err else f"exit {proc.returncode}"
        raise LaunchError(f"the job's Python {path} (Python {_shown(version)}) cannot import "
                          f"bluevela ({why}): install bluevela {__version__} there, or {_FIX}")
    theirs = bv[1]
    if series(theirs) != series(__version__):
        raise LaunchError(f"the job's Python {path} imports bluevela {theirs}, this bv is "
                          f"{__version__}: the job's bluevela must be the same release series "
                          f"({'.'.join(series(__version__))}.x) as the bv that writes its "
                          f"batch script; {_FIX}")
    torch = _TORCH_LINE.search(proc.stdout)
    if need_torch and torch is not None and torch[1] == "no":
        raise LaunchError(f"the job's Python {path} has bluevela {theirs} but no torch: it also "
                          f"runs torchrun and the ranks (bv starts torch's torchrun in it); "
                          f"install bluevela into the training env that holds torch, or {_FIX}")
    return theirs


def _shown(version: tuple[int, int, int]) -> str:
    return ".".join(map(str, version))
