"""A benchmark batch job: `BenchJobRequest.materialize()` is the exact sbatch script the nightly
sends for one node or one node pair, a sibling of `SubmitRequest` with the same rules.

It reuses request.py's validation, quoting and script head: every value is checked with the
same checks (`check_plain` refuses control characters, `check_words`/`check_time`/`check_env`
check names, times and variables), every word that reaches the script is `shlex.quote`d, and
the head (`script_head`) sorts the `#SBATCH` lines; unknown sbatch options are
refused with the list of valid ones. The only shell expansions in the script are our own fixed
templates: `--cpus-per-task="$SLURM_CPUS_ON_NODE"` for a step that spawns its own ranks, and
`BV_BENCH_PORT="$(PY -P -m bluevela.bench.dist)"` before a step whose ranks meet on a port.

Unlike `bv submit`'s torchrun job, a benchmark job pins its nodes (`--nodelist`), is
`--exclusive` (nothing else shares the node while it is measured), and runs several srun steps,
each to the end: a failed step is reported in the exit status but does not stop the next one.
"""

from __future__ import annotations

import logging
import shlex
from dataclasses import dataclass

from bluevela.errors import LaunchError, UnsafeValueError
from bluevela.launch.request import (
    _WORD,
    SBATCH_OPTIONS,
    _plain,
    check_env,
    check_plain,
    check_time,
    check_words,
    script_head,
)
from bluevela.util.fs import safe_node_name

PORT_ENV = "BV_BENCH_PORT"  # bluevela.bench.dist.PORT_ENV (that module imports the bench package)

logger = logging.getLogger(__name__)

BENCH_SBATCH_OPTIONS = tuple(sorted({*SBATCH_OPTIONS, "nodelist", "reservation"}))


@dataclass(frozen=True)
class BenchStep:
    """One `srun` step of a benchmark job.

    Args:
        argv: the program and its arguments (absolute interpreter path first).
        nodes: nodes of the step (1, or 2 for a pair).
        ntasks_per_node: ranks per node.
        mpi: srun's `--mpi` plugin (e.g. `pmix`) for an MPI step, else None.
        whole_node: give the single task every CPU of the node (it spawns its own ranks).
        gpus_per_node: GPUs the step asks for (0: none).
        rendezvous: the ranks meet on a TCP port (torch.distributed): the script draws one on
            the batch host, the step's first node, right before the step (BV_BENCH_PORT).
    """

    argv: tuple[str, ...]
    nodes: int = 1
    ntasks_per_node: int = 1
    mpi: str | None = None
    whole_node: bool = False
    gpus_per_node: int = 0
    rendezvous: bool = False

    def validate(self) -> None:
        if not self.argv:
            raise LaunchError("a benchmark step needs a program")
        for word in self.argv:
            _plain("step argument", word)
        if self.nodes < 1 or self.ntasks_per_node < 1 or self.gpus_per_node < 0:
            raise LaunchError(f"bad step shape: nodes={self.nodes} "
                              f"ntasks_per_node={self.ntasks_per_node}")
        if self.mpi is not None and not _WORD.match(self.mpi):
            raise LaunchError(f"--mpi {self.mpi!r} is not a plain name")

    def srun_words(self) -> list[str]:
        """The step's command line as shell words (quoted; fixed templates only)."""
        opts = [f"--nodes={self.nodes}", f"--ntasks-per-node={self.ntasks_per_node}",
                "--kill-on-bad-exit=1", "--export=ALL"]
        if self.mpi:
            opts.append(f"--mpi={self.mpi}")
        if self.gpus_per_node:
            opts.append(f"--gpus-per-node={self.gpus_per_node}")
        words = [shlex.quote(w) for w in ("srun", *opts)]
        if self.rendezvous:
            # A fixed template: the step's own interpreter prints a port free on this node.
            draw = " ".join(shlex.quote(w) for w in (self.argv[0], "-P", "-m", "bluevela.bench.dist"))
            words.insert(0, f'{PORT_ENV}="$({draw})"')
        if self.whole_node:
            words.append('--cpus-per-task="$SLURM_CPUS_ON_NODE"')
        return words + [shlex.quote(w) for w in self.argv]


@dataclass(frozen=True)
class BenchJobRequest:
    """A batch job that runs benchmark steps on named nodes."""

    steps: tuple[BenchStep, ...]
    nodelist: tuple[str, ...]
    partition: str | None = None
    time: str | None = None
    job_name: str = "bv-bench"
    comment: str | None = None
    gpus_per_node: int = 0
    output: str = "bv-bench-%j.out"
    chdir: str | None = None
    env: tuple[tuple[str, str], ...] = ()
    exclusive: bool = True
    qos: str | None = None  # so backfill does not take the nodes first (docs/install.md 4.3)
    reservation: str | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise LaunchError on any value that is out of range or cannot be made safe."""
        if not self.steps:
            raise LaunchError("a benchmark job needs at least one step")
        if not self.nodelist:
            raise LaunchError("a benchmark job needs its nodes named")
        for node in self.nodelist:
            try:
                safe_node_name(node)
            except UnsafeValueError as exc:
                raise LaunchError(str(exc)) from exc
        if len(set(self.nodelist)) != len(self.nodelist):
            raise LaunchError(f"node named twice in {list(self.nodelist)}")
        for step in self.steps:
            step.validate()
            if step.nodes > len(self.nodelist):
                raise LaunchError(f"a step wants {step.nodes} nodes of {len(self.nodelist)}")
        check_plain((("job name", self.job_name), ("comment", self.comment),
                     ("output", self.output), ("chdir", self.chdir)))
        check_words((("partition", self.partition), ("qos", self.qos),
                     ("reservation", self.reservation)))
        check_time(self.time)
        if self.gpus_per_node < 0:
            raise LaunchError("gpus per node must be >= 0")
        check_env(self.env, "environment")

    def sbatch_options(self) -> dict[str, str | None]:
        """The `#SBATCH` options (None: a flag without value)."""
        opts: dict[str, str | None] = {
            "nodes": str(len(self.nodelist)),
            "nodelist": ",".join(self.nodelist),
            "ntasks-per-node": str(max(s.ntasks_per_node for s in self.steps)),
            "output": self.output,
            "job-name": self.job_name,
            "no-requeue": None,  # a benchmark is rerun by the next night, not by Slurm
        }
        if self.exclusive:
            opts["exclusive"] = None
        if self.gpus_per_node:
            opts["gpus-per-node"] = str(self.gpus_per_node)
        for key, value in (("partition", self.partition), ("time", self.time),
                           ("comment", self.comment), ("chdir", self.chdir), ("qos", self.qos),
                           ("reservation", self.reservation)):
            if value is not None:
                opts[key] = value
        unknown = set(opts) - set(BENCH_SBATCH_OPTIONS)
        if unknown:  # a programming error, but say it the same way submit does
            raise LaunchError(f"unknown sbatch option(s) {sorted(unknown)}; valid: "
                              f"{', '.join(BENCH_SBATCH_OPTIONS)}")
        return opts

    def materialize(self) -> str:
        """The exact batch script. Deterministic: same request, same bytes."""
        lines = script_head(
            self.sbatch_options(), command="bv bench nightly",
            about=("Every step runs to its", "end; the job fails when any step failed."),
            # no -e: a failed step must not stop the next one
            set_options="-uo pipefail", env=self.env)
        lines += ['echo "bv: bench job $SLURM_JOB_ID on $SLURM_JOB_NODELIST" >&2', "rc=0"]
        for step in self.steps:
            lines.append(" ".join(step.srun_words()) + " || rc=$?")
        lines.append("exit $rc")
        return "\n".join(lines) + "\n"
