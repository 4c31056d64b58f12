"""A submit request whose `materialize()` is the exact sbatch script `bv submit` sends.

Every value that reaches the script is either validated against a strict pattern or quoted with
`shlex.quote`; a value that cannot be made safe (a newline or NUL that would add an `#SBATCH`
line or a command) is refused with LaunchError. `#SBATCH` lines are sorted.
"""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Iterable
from dataclasses import dataclass, field

from bluevela import __version__
from bluevela.errors import LaunchError
from bluevela.launch.rdzv_guard import GUARD_ENV
from bluevela.launch.warm import PREIMPORT_ENV, WARM_ENV

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_TIME = re.compile(r"^(\d+|\d+:\d{2}|\d+:\d{2}:\d{2}|\d+-\d+|\d+-\d+:\d{2}|\d+-\d+:\d{2}:\d{2}|UNLIMITED|INFINITE)$")
_WORD = re.compile(r"^[A-Za-z0-9_.+-]+$")
_MEM = re.compile(r"^\d+[KMGT]?$")
# Feature expressions (`a&b`, `[a|b]`, `a*2`) and host lists (`n[1-4],m7`): sbatch's own syntax
# characters only, so nothing else can hide in them.
_CONSTRAINT = re.compile(r"^[A-Za-z0-9_.&|\[\]()*!:,-]+$")
_HOSTLIST = re.compile(r"^[A-Za-z0-9_.,\[\]-]+$")
_DEP_TYPE = re.compile(
    r"^(after|afterany|afterok|afternotok|aftercorr|afterburstbuffer)(:\d+(_\d+)?(\+\d+)?)+$"
    r"|^(singleton|expand:\d+)$"
)
_OPT_NAME = re.compile(r"^[a-z][a-z0-9-]*$")
_MODULE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
_RANK_LIST = re.compile(r"^\d{1,4}(,\d{1,4}){0,1023}$")
# torchrun's --nproc-per-node words besides a number: one per GPU of the node, or per GPU
# else per CPU core.
PROCS_WORDS = ("gpu", "auto")
# Slurm may deliver a time-limit signal up to this much earlier than asked (its time-limit
# check runs periodically): the margin is checked with this slack on top.
SIGNAL_EARLY_S = 60
# The least work time an attempt must keep after the worst-case early signal.
MIN_WORK_S = 0
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


def check_plain(fields: Iterable[tuple[str, str | None]]) -> None:
    """`_plain` on each (name, value) given; a None value was not given."""
    for name, value in fields:
        if value is not None:
            _plain(name, value)


def check_words(fields: Iterable[tuple[str, str | None]]) -> None:
    """Refuse a given (name, value) whose value is not a plain name (`_WORD`)."""
    for name, value in fields:
        if value is not None and not _WORD.match(value):
            raise LaunchError(f"{name} {value!r} is not a plain name")


def check_time(value: str | None) -> None:
    """Refuse a given time limit that is not a Slurm time."""
    if value is not None and not _TIME.match(value):
        raise LaunchError(f"--time {value!r} is not a Slurm time (MM, HH:MM:SS, D-HH, ...)")


def check_env(env: Iterable[tuple[str, str]], what: str) -> None:
    """Refuse a variable name that is not one, or a value with control characters (`what`:
    how the user gave them, e.g. `--env`)."""
    for key, value in env:
        if not _ENV_NAME.match(key):
            raise LaunchError(f"{what} name {key!r} is not a valid variable name")
        _plain(f"{what} {key}", value)


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


def script_head(options: dict[str, str | None], *, command: str, about: tuple[str, str],
                set_options: str, env: tuple[tuple[str, str], ...]) -> list[str]:
    """The head of every batch script bv writes: the shebang, the `#SBATCH` lines
    (`sbatch_lines`), two comment lines naming bv's version and `command` then saying what
    the job does (`about`: the first line's end, the second line), `set <set_options>` and the
    job's exports (`export_lines`)."""
    return [
        "#!/bin/bash", *sbatch_lines(options),
        f"# Generated by bluevela {__version__} ({command}). {about[0]}", f"# {about[1]}",
        f"set {set_options}", *export_lines(env),
    ]


RDZV_FLAGS = ("--rdzv-id", "--rdzv_id", "--rdzv-endpoint", "--rdzv_endpoint", "--rdzv-backend",
              "--rdzv_backend", "--standalone", "--nnodes",
              # torch's static rendezvous (issue 37): bv names each node's rank and the store
              "--node-rank", "--node_rank", "--master-addr", "--master_addr", "--master-port",
              "--master_port")


def rdzv_flag(word: str) -> bool:
    """Whether `word` of the torchrun command sets the rendezvous: one of `RDZV_FLAGS`, or an
    abbreviation argparse would take for one (torchrun's parser allows them: ``--node-r=1``)."""
    name = word.split("=", 1)[0]
    return name.startswith(RDZV_FLAGS) or (
        len(name) > 3 and name.startswith("--") and any(f.startswith(name) for f in RDZV_FLAGS))


@dataclass(frozen=True)
class SubmitRequest:
    """A distributed PyTorch job: one srun task per node, each running torchrun."""

    script: str
    args: tuple[str, ...] = ()
    nodes: int = 1
    gpus_per_node: int = 0
    procs_per_node: int | str | None = None  # a number, or torchrun's `gpu` / `auto`
    module: bool = False  # `script` is a module: torchrun -m (python -m)
    partition: str | None = None
    time: str | None = None
    job_name: str | None = None
    comment: str | None = None
    account: str | None = None
    qos: str | None = None
    env: tuple[tuple[str, str], ...] = ()
    max_restarts: int = 0
    requeue: bool = True
    torchrun: tuple[str, ...] = ("torchrun",)
    # The interpreter of the batch script's `exec` line (and so of the agents: they run the
    # supervisor's own sys.executable): a name looked up on the job's PATH, or a path.
    python: str = "python3"
    output: str = "bv-%j.out"
    chdir: str | None = None
    hold: bool = False
    extra_sbatch: tuple[tuple[str, str], ...] = field(default=())
    signal_before: int = 0  # seconds before the time limit for SIGUSR1; 0: no signal
    spare_nodes: int = 0  # hot spares inside the allocation (the supervisor's)
    min_nodes: int | None = None  # elastic shrink floor (data parallel); None: fixed size
    hang_timeout: float = 0.0  # seconds without progress from any rank; 0: no watchdog
    grow_deadline: float = 0.0  # seconds to wait for a node grown in place of a lost one; 0: off
    rdzv_guard: str = "required"  # site.yaml launch.rdzv_guard: "optional" lets torchrun run unguarded
    warm_start: bool = False  # site.yaml launch.warm_start: ranks forked by warm parents
    warm_preimport: tuple[str, ...] = ()  # site.yaml launch.warm_preimport; (): warm.py's default
    cpus_per_task: int | None = None
    mem: str | None = None
    exclusive: bool = False
    constraint: str | None = None
    exclude: str | None = None
    dependency: str | None = None
    no_kill: bool = False
    # `--sbatch-arg=--NAME[=VALUE]` pass-through, validated against sbatch's option list.
    sbatch_args: tuple[tuple[str, str | None], ...] = field(default=())
    # torchrun's console filter (local ranks whose output reaches the job's output file) and
    # per-rank log files (torchrun --log-dir DIR --tee 3: every rank's stdout/stderr in a file).
    local_ranks_filter: str | None = None
    rank_log_dir: str | None = None
    # Options the site's SPANK plugins add to sbatch (site.yaml launch.spank_options, e.g.
    # pyxis' container-image): accepted by `--sbatch-arg` besides sbatch's own.
    spank_options: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        self.validate()

    @property
    def nproc_per_node(self) -> int | str:
        """torchrun's --nproc-per-node: explicit (a number, `gpu`, `auto`), else one per GPU,
        else 1."""
        if self.procs_per_node is not None:
            return self.procs_per_node
        return self.gpus_per_node or 1

    def validate(self) -> None:
        """Raise LaunchError on any value that is out of range or cannot be made safe."""
        self._validate_job()
        self._validate_text()
        self._validate_resilience()
        self._validate_resources()
        for key, value in self.sbatch_args:
            check_sbatch_arg(key, value, self.spank_options)

    def _validate_job(self) -> None:
        """What runs: the counts, the script or module, the ranks filter, the interpreter."""
        if self.nodes < 1:
            raise LaunchError(f"--nodes must be at least 1, not {self.nodes}")
        if self.gpus_per_node < 0:
            raise LaunchError("--gpus-per-node must be >= 0")
        if isinstance(self.procs_per_node, str):
            if self.procs_per_node not in PROCS_WORDS:
                raise LaunchError(f"--procs-per-node {self.procs_per_node!r} is not a number, "
                                  f"{' or '.join(PROCS_WORDS)}")
            if self.procs_per_node == "gpu" and not self.gpus_per_node:
                raise LaunchError("--procs-per-node gpu needs GPUs: give --gpus-per-node or "
                                  "--class (the job asks for none)")
        elif self.procs_per_node is not None and self.procs_per_node < 1:
            raise LaunchError("--procs-per-node must be at least 1")
        if self.module and not _MODULE.match(self.script):
            raise LaunchError(f"-m {self.script!r} is not a module name (e.g. pkg.train)")
        if self.local_ranks_filter is not None and not _RANK_LIST.match(self.local_ranks_filter):
            raise LaunchError(f"--local-ranks-filter {self.local_ranks_filter!r} is not a list "
                              "of local ranks (e.g. 0 or 0,1)")
        if self.max_restarts < 0:
            raise LaunchError("--max-restarts must be >= 0")
        if not self.script:
            raise LaunchError("no training script given")
        if self.rdzv_guard not in ("required", "optional"):
            raise LaunchError(f"rdzv_guard must be required or optional, not {self.rdzv_guard!r}")
        _plain("--python", self.python)
        if not (os.path.isabs(self.python) or _WORD.match(self.python)):
            raise LaunchError(f"--python {self.python!r} is neither a command name (python3) "
                              "nor an absolute path")

    def _validate_text(self) -> None:
        """The free text that reaches the script: no control characters, plain names, a Slurm
        time, variable names, known sbatch options, no rendezvous flag in the torchrun command."""
        check_plain((
            ("script", self.script), ("job name", self.job_name), ("comment", self.comment),
            ("output", self.output), ("chdir", self.chdir),
            ("rank log dir", self.rank_log_dir),
            *(("argument", a) for a in self.args), *(("torchrun", t) for t in self.torchrun),
        ))
        check_words((("partition", self.partition), ("account", self.account),
                     ("qos", self.qos)))
        check_time(self.time)
        check_env(self.env, "--env")
        for key, value in self.extra_sbatch:
            if key not in SBATCH_OPTIONS:
                raise LaunchError(
                    f"unknown sbatch option {key!r}; valid: {', '.join(sorted(SBATCH_OPTIONS))}"
                )
            _plain(key, value)
        for word in self.torchrun:
            # bv hands the rendezvous to torchrun per step, in the environment; a flag here
            # would override it (and put the store's name back on a world-readable argv).
            if rdzv_flag(word):
                raise LaunchError(f"the torchrun command (site.yaml launch.torchrun) must not "
                                  f"set {word.split('=', 1)[0]}: bv sets the rendezvous per step")

    def _validate_resilience(self) -> None:
        if self.spare_nodes < 0:
            raise LaunchError("--spare-nodes must be >= 0")
        if self.min_nodes is not None and not 1 <= self.min_nodes <= self.nodes:
            raise LaunchError(f"--min-nodes must be between 1 and --nodes ({self.nodes})")
        # `not (0 <= x < inf)`: nan fails every comparison, so a plain `x < 0` let it through
        # to the job, whose supervisor then refused to start (issue 33).
        if not 0 <= self.hang_timeout < float("inf"):
            raise LaunchError("--hang-timeout must be >= 0 and finite (0: off)")
        if not 0 <= self.grow_deadline <= 3600:
            raise LaunchError("the grow deadline (site.yaml launch.grow_deadline_s) must be "
                              "between 0 and 3600 s")
        if self.signal_before < 0:
            raise LaunchError("--signal-before must be >= 0 (0: no checkpoint signal)")
        if self.signal_before > 65535:
            raise LaunchError("--signal-before must be at most 65535 s (Slurm's limit)")
        limit = self.time_limit_s
        if self.signal_before and limit is not None:
            problem = signal_margin_problem(self.signal_before, limit)
            if problem:
                raise LaunchError(problem)

    def _validate_resources(self) -> None:
        if self.cpus_per_task is not None and self.cpus_per_task < 1:
            raise LaunchError("--cpus-per-task must be at least 1")
        if self.mem is not None and not _MEM.match(self.mem):
            raise LaunchError(f"--mem {self.mem!r} is not a size (e.g. 200G, 512000M, 0 for all)")
        if self.constraint is not None and not _CONSTRAINT.match(self.constraint):
            raise LaunchError(f"--constraint {self.constraint!r} is not a feature expression "
                              "(names joined by & | , with [] () * !)")
        if self.exclude is not None and not _HOSTLIST.match(self.exclude):
            raise LaunchError(f"--exclude {self.exclude!r} is not a host list (e.g. gpu[001-004],gpu9)")
        if self.dependency is not None:
            parts = re.split(r"[,?]", self.dependency)
            if not self.dependency or not all(_DEP_TYPE.match(p) for p in parts) or (
                    "," in self.dependency and "?" in self.dependency):
                raise LaunchError(f"--dependency {self.dependency!r} is not a Slurm dependency "
                                  "(e.g. afterok:123, afterany:12:13, singleton)")

    @property
    def needs_no_kill(self) -> bool:
        """Spares or elastic shrink: the supervisor relaunches inside the allocation, so Slurm
        must not end the job when it declares a lost node DOWN."""
        shrink = self.min_nodes is not None and self.min_nodes < self.nodes
        return self.no_kill or self.spare_nodes > 0 or shrink

    @property
    def time_limit_s(self) -> int | None:
        """The time limit in seconds (None: none given or unlimited)."""
        return time_limit_seconds(self.time) if self.time is not None else None

    def sbatch_options(self) -> dict[str, str | None]:
        """The `#SBATCH` options (None: a flag without value)."""
        opts: dict[str, str | None] = {
            "nodes": str(self.nodes + self.spare_nodes),
            "ntasks-per-node": "1",
            "output": self.output,
            # A requeued job appends: every attempt's output (and its banner) is kept.
            "open-mode": "append",
            "requeue" if self.requeue else "no-requeue": None,
        }
        if self.signal_before:
            # B: the batch shell only, which is bv's supervisor (exec'd); it forwards the
            # signal to the torchrun workers (the agent dies on signals it does not handle).
            opts["signal"] = f"B:USR1@{self.signal_before}"
        if self.needs_no_kill:
            opts["no-kill"] = None
        if self.cpus_per_task is not None:
            opts["cpus-per-task"] = str(self.cpus_per_task)
        if self.exclusive:
            opts["exclusive"] = None
        for key, value in (("mem", self.mem), ("constraint", self.constraint),
                           ("exclude", self.exclude), ("dependency", self.dependency)):
            if value is not None:
                opts[key] = value
        for key, value in self.sbatch_args:
            opts[key] = value
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
        """torchrun's argv as the supervisor receives it; it adds --nnodes and the rendezvous
        backend per step (static; c10d with --max-restarts above 0: supervisor
        torchrun_step_argv), the store on the step's first node (which may be a spare)."""
        argv = [
            *self.torchrun,
            f"--nproc-per-node={self.nproc_per_node}",
            f"--max-restarts={self.max_restarts}",
        ]
        if self.local_ranks_filter is not None:
            argv.append(f"--local-ranks-filter={self.local_ranks_filter}")
        if self.rank_log_dir is not None:
            argv += [f"--log-dir={self.rank_log_dir}", "--tee=3"]
        if self.module:
            argv.append("-m")
        return [*argv, self.script, *self.args]

    def supervisor_argv(self) -> list[str]:
        """The in-job supervisor (bluevela/launch/supervisor.py) the batch shell execs: it runs
        the srun+torchrun step, forwards the checkpoint signal to the workers, relaunches on
        spare/remaining nodes after a node loss, and requeues (docs/resilience.md)."""
        # -P: the job's working directory (the user's submit directory) is not put on the
        # import path; a module planted there (e.g. select.py) must not run in the supervisor.
        argv = [self.python, "-P", "-m", "bluevela.launch.supervisor", f"--nodes={self.nodes}"]
        if self.spare_nodes:
            argv.append(f"--spare-nodes={self.spare_nodes}")
        if self.min_nodes is not None and self.min_nodes < self.nodes:
            argv.append(f"--min-nodes={self.min_nodes}")
        if self.hang_timeout:
            argv.append(f"--hang-timeout={self.hang_timeout:g}")
        if self.grow_deadline:
            argv.append(f"--grow-deadline={self.grow_deadline:g}")
        return [*argv, "--", *self.torchrun_argv()]

    def materialize(self) -> str:
        """The exact batch script. Deterministic: same request, same bytes."""
        lines = script_head(
            self.sbatch_options(), command="bv submit", about=(
                "One srun task per node runs",
                "torchrun; the c10d rendezvous is on the first node of SLURM_JOB_NODELIST."),
            set_options="-euo pipefail", env=self.env)
        # The site's word, after the job's own: an unguarded torchrun fails the step unless
        # the site allows it (bluevela/launch/rdzv_guard.py).
        lines.append(f"export {GUARD_ENV}={self.rdzv_guard}")
        if self.warm_start:  # the site's word: ranks forked by warm parents (launch/warm.py)
            lines.append(f"export {WARM_ENV}=1")
            if self.warm_preimport:  # the job's own BV_WARM_PREIMPORT (--env) wins
                mods = ",".join(self.warm_preimport)
                if not re.fullmatch(r"[A-Za-z0-9_.,]+", mods):
                    raise LaunchError(f"launch.warm_preimport: not module names: {mods!r}")
                lines.append(f'export {PREIMPORT_ENV}="${{{PREIMPORT_ENV}:-{mods}}}"')
        # The supervisor is the job's main process (it receives --signal=B:USR1): exec.
        lines.append("exec " + " ".join(shlex.quote(w) for w in self.supervisor_argv()))
        return "\n".join(lines) + "\n"


def time_limit_seconds(value: str) -> int | None:
    """A Slurm time (`MM`, `MM:SS`, `HH:MM:SS`, `D-HH`, `D-HH:MM`, `D-HH:MM:SS`) in seconds;
    None for UNLIMITED/INFINITE. Raises LaunchError on anything else."""
    check_time(value)
    if value in ("UNLIMITED", "INFINITE"):
        return None
    days = 0
    if "-" in value:
        d, _, value = value.partition("-")
        days = int(d)
        parts = [int(p) for p in value.split(":")]
        hms = (parts + [0, 0])[:3]  # D-HH, D-HH:MM, D-HH:MM:SS
    else:
        parts = [int(p) for p in value.split(":")]
        hms = {1: [0, parts[0], 0], 2: [0, *parts], 3: parts}[len(parts)]  # MM, MM:SS, H:M:S
    return days * 86400 + hms[0] * 3600 + hms[1] * 60 + hms[2]


def signal_margin_problem(signal_before: int, limit_s: int) -> str | None:
    """Why a checkpoint-signal margin does not fit a time limit, or None when it does.

    Slurm may deliver the signal up to SIGNAL_EARLY_S (60 s) before the margin asked for, so
    an attempt is only sure to work `limit - signal_before - 60` seconds. A margin that leaves
    no sure work time makes every attempt checkpoint and requeue without progress (what
    submitit's 90 s default does to a 2-minute job: "timed out too many times").
    """
    work = limit_s - signal_before - SIGNAL_EARLY_S
    if work >= MIN_WORK_S and signal_before < limit_s:
        return None
    return (f"--signal-before {signal_before} s leaves {max(0, limit_s - signal_before)} s of a "
            f"{limit_s} s time limit, and Slurm may signal up to {SIGNAL_EARLY_S} s early: "
            f"no work time is sure per attempt; use at most "
            f"{max(0, limit_s - SIGNAL_EARLY_S - MIN_WORK_S)} s or a longer --time")


def output_dir_problem(output: str, cwd: str) -> str | None:
    """Why the job's output file cannot be created (its directory is missing: sbatch does not
    make it, and the job then fails with no output at all), or None."""
    parent = os.path.dirname(output)
    if not parent or "%" in parent:
        return None
    where = parent if os.path.isabs(parent) else os.path.join(cwd, parent)
    if os.path.isdir(where):
        return None
    return (f"--output {output}: the directory {parent} does not exist (Slurm does not create "
            "it, and the job would fail with no output); create it first")


def check_sbatch_arg(key: str, value: str | None, spank: tuple[str, ...] = ()) -> None:
    """Refuse a pass-through option that is not sbatch's (nor one of the site's SPANK plugins'
    options, `spank`), that bv sets itself, or that does not fit a bv job; refuse control
    characters in its value."""
    from bluevela.launch.sbatch_opts import MANAGED, PASSTHROUGH, REFUSED

    if not _OPT_NAME.match(key):
        raise LaunchError(f"--sbatch-arg: {key!r} is not a long sbatch option name")
    if key in MANAGED:
        raise LaunchError(f"--sbatch-arg --{key}: bv sets it; use {MANAGED[key]}")
    if key in REFUSED:
        raise LaunchError(f"--sbatch-arg --{key}: {REFUSED[key]}")
    if key not in PASSTHROUGH and key not in spank:
        site = (f"; the site's plugin options: {', '.join(spank)}" if spank else
                "; a SPANK plugin's option (pyxis' container-image) must be listed in "
                "site.yaml launch.spank_options")
        raise LaunchError(f"--sbatch-arg --{key}: not an sbatch option; valid: "
                          f"{', '.join(sorted(PASSTHROUGH))}{site}")
    if value is not None:
        _plain(f"--sbatch-arg --{key}", value)


def parse_sbatch_arg(text: str, spank: tuple[str, ...] = ()) -> tuple[str, str | None]:
    """`--name=value` or `--name` (as given to `--sbatch-arg`) to (name, value), validated
    (`spank`: the site's SPANK plugin options, allowed too)."""
    _plain("--sbatch-arg", text)
    if not text.startswith("--") or text == "--":
        raise LaunchError(f"--sbatch-arg {text!r}: give a long option, e.g. --sbatch-arg=--nice=10")
    name, sep, value = text[2:].partition("=")
    result = (name, value if sep else None)
    check_sbatch_arg(*result, spank)
    return result
