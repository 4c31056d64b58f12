"""A submit request whose `materialize()` is the exact sbatch script `bv submit` sends.

Every value that reaches the script is either validated against a strict pattern or quoted with
`shlex.quote`; a value that cannot be made safe (a newline or NUL that would add an `#SBATCH`
line or a command) is refused with LaunchError. `#SBATCH` lines are sorted.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field

from bluevela import __version__
from bluevela.errors import LaunchError

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_TIME = re.compile(r"^(\d+|\d+:\d{2}|\d+:\d{2}:\d{2}|\d+-\d+|\d+-\d+:\d{2}|\d+-\d+:\d{2}:\d{2}|UNLIMITED|INFINITE)$")
_WORD = re.compile(r"^[A-Za-z0-9_.+-]+$")
# What sbatch itself accepts for the free-text values we pass.
SBATCH_OPTIONS = (
    "account", "comment", "gpus-per-node", "job-name", "nodes", "ntasks-per-node", "output",
    "partition", "qos", "requeue", "no-requeue", "time", "exclusive", "chdir", "hold",
)


def _plain(name: str, value: str) -> str:
    """Refuse NUL, newlines and other control characters but tab (they would forge lines)."""
    if any((ord(c) < 0x20 and c != "\t") or ord(c) == 0x7F for c in value):
        raise LaunchError(f"{name} contains a newline or control character; refusing {value!r}")
    return value


_SBATCH_BARE = re.compile(r"[A-Za-z0-9_@%+=:,./-]+")


def sbatch_quote(value: str) -> str:
    """`value` as sbatch's own `#SBATCH` parser reads it back, byte for byte.

    That parser (sbatch/opt.c `_get_argument`) is not a shell: a backslash escapes the next
    character even inside single quotes, an unquoted `#` ends the line, whitespace ends the
    word. So `shlex.quote` is wrong there (`'x\\'` leaves a quote open). Plain words stay bare;
    anything else is single-quoted with every backslash and single quote backslash-escaped.
    Newlines and control characters were refused earlier (`_plain`).
    """
    if _SBATCH_BARE.fullmatch(value):
        return value
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def sbatch_lines(options: dict[str, str | None]) -> list[str]:
    """`#SBATCH` lines, sorted, every value quoted for sbatch's parser (`sbatch_quote`)."""
    return [f"#SBATCH --{key}" if value is None else f"#SBATCH --{key}={sbatch_quote(value)}"
            for key, value in sorted(options.items())]


def export_lines(env: tuple[tuple[str, str], ...]) -> list[str]:
    """`export KEY=value` lines; names were validated, values are quoted."""
    return [f"export {key}={shlex.quote(value)}" for key, value in env]


@dataclass(frozen=True)
class SubmitRequest:
    """A distributed PyTorch job: one srun task per node, each running torchrun."""

    script: str
    args: tuple[str, ...] = ()
    nodes: int = 1
    gpus_per_node: int = 0
    procs_per_node: int | None = None
    partition: str | None = None
    time: str | None = None
    job_name: str | None = None
    comment: str | None = None
    account: str | None = None
    qos: str | None = None
    env: tuple[tuple[str, str], ...] = ()
    max_restarts: int = 0
    requeue: bool = True
    rdzv_port: int = 29500
    torchrun: tuple[str, ...] = ("torchrun",)
    output: str = "bv-%j.out"
    chdir: str | None = None
    hold: bool = False
    extra_sbatch: tuple[tuple[str, str], ...] = field(default=())

    def __post_init__(self) -> None:
        self.validate()

    @property
    def nproc_per_node(self) -> int:
        """torchrun's --nproc-per-node: explicit, else one per GPU, else 1."""
        if self.procs_per_node is not None:
            return self.procs_per_node
        return self.gpus_per_node or 1

    def validate(self) -> None:
        """Raise LaunchError on any value that is out of range or cannot be made safe."""
        if self.nodes < 1:
            raise LaunchError(f"--nodes must be at least 1, not {self.nodes}")
        if self.gpus_per_node < 0:
            raise LaunchError("--gpus-per-node must be >= 0")
        if self.procs_per_node is not None and self.procs_per_node < 1:
            raise LaunchError("--procs-per-node must be at least 1")
        if self.max_restarts < 0:
            raise LaunchError("--max-restarts must be >= 0")
        if not 1024 <= self.rdzv_port <= 65535:
            raise LaunchError(f"rendezvous port {self.rdzv_port} out of range 1024-65535")
        if not self.script:
            raise LaunchError("no training script given")
        for name, value in (
            ("script", self.script), ("job name", self.job_name), ("comment", self.comment),
            ("output", self.output), ("chdir", self.chdir),
            *(("argument", a) for a in self.args), *(("torchrun", t) for t in self.torchrun),
        ):
            if value is not None:
                _plain(name, value)
        for name, value in (("partition", self.partition), ("account", self.account),
                            ("qos", self.qos)):
            if value is not None and not _WORD.match(value):
                raise LaunchError(f"{name} {value!r} is not a plain name")
        if self.time is not None and not _TIME.match(self.time):
            raise LaunchError(f"--time {self.time!r} is not a Slurm time (MM, HH:MM:SS, D-HH, ...)")
        for key, value in self.env:
            if not _ENV_NAME.match(key):
                raise LaunchError(f"--env name {key!r} is not a valid variable name")
            _plain(f"--env {key}", value)
        for key, value in self.extra_sbatch:
            if key not in SBATCH_OPTIONS:
                raise LaunchError(
                    f"unknown sbatch option {key!r}; valid: {', '.join(sorted(SBATCH_OPTIONS))}"
                )
            _plain(key, value)

    def sbatch_options(self) -> dict[str, str | None]:
        """The `#SBATCH` options (None: a flag without value)."""
        opts: dict[str, str | None] = {
            "nodes": str(self.nodes),
            "ntasks-per-node": "1",
            "output": self.output,
            "requeue" if self.requeue else "no-requeue": None,
        }
        if self.gpus_per_node:
            opts["gpus-per-node"] = str(self.gpus_per_node)
        if self.hold:
            opts["hold"] = None
        for key, value in (("partition", self.partition), ("time", self.time),
                           ("job-name", self.job_name), ("comment", self.comment),
                           ("account", self.account), ("qos", self.qos), ("chdir", self.chdir)):
            if value is not None:
                opts[key] = value
        for key, value in self.extra_sbatch:
            opts[key] = value
        return opts

    def torchrun_argv(self) -> list[str]:
        """torchrun's argv; `$head` and Slurm variables are expanded by the batch shell."""
        return [
            *self.torchrun,
            "--nnodes=$SLURM_JOB_NUM_NODES",
            f"--nproc-per-node={self.nproc_per_node}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=$head:{self.rdzv_port}",
            "--rdzv-id=$SLURM_JOB_ID",
            f"--max-restarts={self.max_restarts}",
            self.script,
            *self.args,
        ]

    def materialize(self) -> str:
        """The exact batch script. Deterministic: same request, same bytes."""
        lines = ["#!/bin/bash", *sbatch_lines(self.sbatch_options())]
        lines += [
            f"# Generated by bluevela {__version__} (bv submit). One srun task per node runs",
            "# torchrun; the c10d rendezvous is on the first node of SLURM_JOB_NODELIST.",
            "set -euo pipefail",
            *export_lines(self.env),
        ]
        lines += [
            'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
            'echo "bv: job $SLURM_JOB_ID on $SLURM_JOB_NODELIST, rendezvous $head:'
            f'{self.rdzv_port}" >&2',
        ]
        srun = ["srun", "--ntasks-per-node=1", "--kill-on-bad-exit=1", "--export=ALL"]
        words = [shlex.quote(w) for w in srun]
        for word in self.torchrun_argv():
            # Only our own fixed templates carry shell expansions; user words are quoted.
            if word.startswith(("--nnodes=$", "--rdzv-endpoint=$", "--rdzv-id=$")):
                key, _, rest = word.partition("=")
                words.append(f'{key}="{rest}"')
            else:
                words.append(shlex.quote(word))
        lines.append("exec " + " ".join(words))
        return "\n".join(lines) + "\n"
