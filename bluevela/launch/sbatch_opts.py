"""sbatch's long options, shipped as a list: asking the installed sbatch (`--help`, `--usage`)
on every submit costs a process start and needs a slurm.conf, which the submit path cannot
afford. tests/launch/test_submit_options.py compares these sets with the installed sbatch.

Every option of sbatch 22.05's `--help` and `--usage` is in exactly one of three sets:
- MANAGED: bv renders it itself (own `bv submit` option, or part of the launch model);
- REFUSED: does not fit a bv job (reason given to the user);
- PASSTHROUGH: allowed as `bv submit --sbatch-arg=--NAME[=VALUE]`.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

# The Slurm release whose sbatch these sets classify completely. On another release an option
# that is in none of the sets is refused by `--sbatch-arg` (unknown to bv), never passed on.
CLASSIFIED_FOR = "22.05"

# bv option (or fixed rendering) that replaces each managed sbatch option.
MANAGED: dict[str, str] = {
    "account": "--account",
    "chdir": "the submit directory",
    "comment": "--comment",
    "constraint": "--constraint",
    "cpus-per-task": "--cpus-per-task",
    "dependency": "--dependency",
    "exclude": "--exclude",
    "exclusive": "--exclusive",
    "gpus-per-node": "--gpus-per-node / --class",
    "hold": "--hold",
    "job-name": "--job-name",
    "mem": "--mem",
    "no-kill": "the supervisor (fixed)",
    "no-requeue": "--no-requeue",
    "nodes": "--nodes / --spare-nodes",
    "ntasks-per-node": "the launch model (one srun task per node)",
    "open-mode": "the launch model (append: every attempt's output is kept)",
    "output": "--output (default: site.yaml launch.output)",
    "partition": "--partition",
    "qos": "--qos",
    "requeue": "--requeue",
    "signal": "--signal-before",
    "time": "--time",
}

REFUSED: dict[str, str] = {
    "array": "job arrays are not supported: bv follows, requeues and reads logs by one job id "
             "per torchrun run; submit one bv job per configuration",
    "error": "stderr must stay in the --output file, which keeps every attempt's banner",
    "export": "the job's environment comes from --env and site.yaml launch.env",
    "export-file": "the job's environment comes from --env and site.yaml launch.env",
    "gid": "bv does not submit on behalf of other groups",
    "help": "not a job option",
    "input": "a torchrun job reads no batch stdin",
    "ntasks": "the launch model runs one srun task per node (torchrun spawns the ranks)",
    "ntasks-per-core": "the launch model runs one srun task per node",
    "ntasks-per-socket": "the launch model runs one srun task per node",
    "parsable": "bv parses sbatch's answer itself",
    "uid": "bv does not submit on behalf of other users",
    "usage": "not a job option",
    "version": "not a job option",
    "wait": "use bv submit --wait (it follows requeues)",
    "wrap": "bv writes the batch script",
}

PASSTHROUGH: frozenset[str] = frozenset({
    "bb", "bbf", "begin", "cluster-constraint", "clusters", "container", "contiguous",
    "core-spec", "cores-per-socket", "cpu-freq", "cpus-per-gpu", "deadline", "delay-boot",
    "distribution", "extra-node-info", "get-user-env", "gpu-bind", "gpu-freq", "gpus",
    "gpus-per-socket", "gpus-per-task", "gres", "gres-flags", "ignore-pbs", "licenses",
    "mail-type", "mail-user", "mcs-label", "mem-bind", "mem-per-cpu", "mem-per-gpu", "mincpus",
    "network", "nice", "nodefile", "nodelist", "overcommit", "oversubscribe", "power",
    "priority", "profile", "propagate", "quiet", "reboot", "reservation", "sockets-per-node",
    "spread-job", "switches", "thread-spec", "threads-per-core", "time-min", "tmp",
    "use-min-nodes", "verbose", "wckey",
})


# `--requeue[=MODE]`: sbatch's --requeue takes an optional value from Slurm 25.11 on
# (`--requeue=expedite`: a requeued job is immediately eligible and goes to the top of the
# queue; slurm.conf SlurmctldParameters=enable_expedited_requeue must allow it).
REQUEUE_MODES = ("expedite",)
# What an expedited requeue does to bv's own recovery, as measured on 25.11.7 (docs/install.md
# 4.7): said at every submit that asks for it, until the supervisor takes it into account.
EXPEDITE_CAVEAT = (
    "--requeue=expedite does not fit bv's recovery yet (measured on Slurm 25.11): after bv "
    "lets go of a lost node and requeues, Slurm restarts the job at once on its old nodes, "
    "the dead one included, until it declares that node DOWN; and a job that ends with a "
    "non-zero exit is requeued held (REQUEUE_HOLD), not FAILED (docs/install.md 4.7)")


def take_requeue_value(args: Sequence[str], value_options: Collection[str]
                       ) -> tuple[list[str], str | None]:
    """`bv submit`'s argv with `--requeue=MODE` made a plain `--requeue`, and MODE (the last
    one given; None: none). Only bv's own options are looked at: the scan stops at the first
    word that is neither an option nor the value of one (SCRIPT: what follows is the
    script's), or at `--`. `value_options`: the option strings that take a separate value
    (`-N 2`, `--time 1:00:00`), so a value is never taken for SCRIPT."""
    out: list[str] = []
    mode: str | None = None
    i = 0
    while i < len(args):
        word = args[i]
        if word == "--" or not word.startswith("-") or word == "-":
            out.extend(args[i:])
            break
        name, eq, value = word.partition("=")
        if name == "--requeue" and eq:
            mode = value
            out.append("--requeue")
        else:
            out.append(word)
            if not eq and word in value_options and i + 1 < len(args):
                i += 1
                out.append(args[i])
        i += 1
    return out, mode


def requeue_mode_problem(mode: str, requeue: bool | None) -> str | None:
    """Why `--requeue=MODE` (with the final --requeue/--no-requeue, None: not given) cannot
    be asked for, None when it can (the running Slurm is asked by
    `bluevela.slurm.releases.expedite_problem_here`)."""
    if mode not in REQUEUE_MODES:
        return (f"--requeue={mode}: the only value is expedite (Slurm 25.11 and later), "
                "or give --requeue alone")
    if requeue is False:
        return f"--requeue={mode} and --no-requeue contradict each other: give one"
    return None

