"""The first launch of a `bv submit` job, old checkout vs new, on the dev cluster (issue 23).

    python benchmarks/ab_launch.py --old <checkout of 9058adc> [--new <checkout>] [--pairs 10]

The recovery benchmark (bench_recovery.py, ``BV_BENCH_OLD``) gives "submit -> first rank line"
once per crash run (about 75 s each); this times only the launch, so that many more pairs fit
in the same time: `bv submit -N 2 --spare-nodes 1` of examples/train_ddp.py (the old checkout's,
for both sides), 3 steps, each side with its own hooks and its own `PYTHONPATH` as in
bench_recovery (`SideHooks`), the job left to end before the next. Figures per run, from `bv
submit` returning:

- job started: the attempt-1 banner (Slurm's scheduling and every node's prolog);
- first rank line: the first ``rank=R attempt=1 resumed_from_step=S`` line;
- the launch: job started -> first rank line (supervisor, srun, agents, torchrun's rendezvous,
  the ranks' imports and process group);
- CPU seconds by kind of process during the launch (`_procsample`): the dev cluster's nodes
  share this machine's cores, so a launch that costs more CPU is a slower launch here.

One job by each side first is not counted (the first launch after the cluster's start reads
cold caches: 3x slower). Pairs alternate the order (old first in even pairs); each ratio is the median of the per-pair
new/old ratios, with their range. A measurement that prints, not a test.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import PY, devcluster_env  # noqa: E402
from _procsample import ProcSampler  # noqa: E402
from bench_recovery import (  # noqa: E402
    DEVCLUSTER,
    ENDED,
    FIRST_RANK,
    SideHooks,
    Tail,
    _job_state,
)

TRAIN_ARGS = ["--steps", "3", "--step-s", "0.2", "--ckpt-every", "100"]


@dataclass
class Launch:
    """One job's first launch; times in seconds after `bv submit` returned."""

    job: str
    started: float  # the attempt-1 banner
    first: float  # the first rank line
    cpu: dict[str, float]  # role -> CPU seconds in the launch; "busy": all cores

    @property
    def launch(self) -> float:
        return self.first - self.started

    def figure(self, name: str) -> float:
        return {"job started": self.started, "first rank line": self.first,
                "launch": self.launch}[name]


FIGURES = ("job started", "first rank line", "launch")
RATIOS = ("first rank line", "launch")


def run_once(env: dict[str, str], checkout: Path, example: str) -> Launch:
    env = {**env, "PYTHONPATH": str(checkout)}
    if "BV_SITE" in env:
        env["BV_SITE"] = str(checkout / "site.yaml")
    with tempfile.TemporaryDirectory(prefix="bv-bench-launch-") as tmp, ProcSampler() as samp:
        work = Path(tmp)
        out = subprocess.run(
            [PY, "-m", "bluevela", "submit", "-N", "2", "--spare-nodes", "1",
             "--procs-per-node", "1", example, "--ckpt-dir", str(work / "ckpt"), *TRAIN_ARGS],
            capture_output=True, text=True, env=env, cwd=work, check=True).stdout
        submitted = time.monotonic()
        found = re.search(r"job (\d+)", out)
        if found is None:
            raise RuntimeError(f"no job id in bv submit's output: {out!r}")
        job = found.group(1)
        tail = Tail(work / f"bv-{job}.out")
        started = tail.wait(lambda s: s.startswith("==== bv attempt 1 job"), 120)
        first = tail.wait(lambda s: FIRST_RANK.match(s) is not None, 120)
        samp.stop()  # the window is over: the rest of the job is not measured
        deadline = time.monotonic() + 120
        while _job_state(env, job)[0] not in ENDED and time.monotonic() < deadline:
            time.sleep(0.3)
        if started is None or first is None:
            subprocess.run(["scancel", job], env=env, check=False)
            tail.poll()
            raise RuntimeError(f"job {job}: no banner or rank line: "
                               + " | ".join(line for _, line in tail.lines[-5:]))
    cpu = {**samp.cpu_by_role(started[0], first[0]), "busy": samp.busy(started[0], first[0])}
    return Launch(job, started[0] - submitted, first[0] - submitted, cpu)


def _quartiles(values: list[float]) -> str:
    return (" / ".join(f"{q:.2f}" for q in statistics.quantiles(values, n=4))
            if len(values) > 1 else "n/a")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--old", type=Path, required=True)
    parser.add_argument("--new", type=Path, default=Path(__file__).resolve().parent.parent)
    parser.add_argument("--pairs", type=int, default=10)
    args = parser.parse_args()
    checkouts = {"old": args.old, "new": args.new}
    hooks = SideHooks(checkouts)
    os.environ["BV_DEVCLUSTER_HOOKS"] = str(hooks.link)
    try:
        env = devcluster_env()
        if env is None:
            print("ab_launch: the dev cluster cannot be brought up (needs root)", file=sys.stderr)
            return 1
        os.environ["BV_DEVCLUSTER_DIR"] = env["BV_DEVCLUSTER_DIR"]
        example = str(args.old / "examples" / "train_ddp.py")
        runs: dict[str, list[Launch]] = {"old": [], "new": []}
        ratios: dict[str, list[float]] = {name: [] for name in RATIOS}
        for which in ("old", "new"):  # not counted: the first jobs after the cluster's start
            hooks.switch(which)
            try:
                run_once(env, checkouts[which], example)
            except (RuntimeError, subprocess.SubprocessError, OSError) as exc:
                print(f"ab_launch: warm-up {which}: {exc}", flush=True)
        for i in range(args.pairs):
            pair: dict[str, Launch] = {}
            for which in (("old", "new") if i % 2 == 0 else ("new", "old")):
                hooks.switch(which)
                try:
                    r = pair[which] = run_once(env, checkouts[which], example)
                except (RuntimeError, subprocess.SubprocessError, OSError) as exc:
                    print(f"ab_launch: pair {i + 1} {which}: {exc}", flush=True)
                    continue
                print(f"ab_launch: pair {i + 1} {which} job {r.job}: job started "
                      f"{r.started:.2f}, first rank line {r.first:.2f}, launch {r.launch:.2f} s;"
                      " CPU s " + ", ".join(f"{k} {v:.2f}" for k, v in
                                            sorted(r.cpu.items(), key=lambda kv: -kv[1])),
                      flush=True)
            if len(pair) == 2:
                for which, r in pair.items():
                    runs[which].append(r)
                for name in RATIOS:
                    ratios[name].append(pair["new"].figure(name) / pair["old"].figure(name))
        for which, done in runs.items():
            if not done:
                continue
            roles = sorted({k for r in done for k in r.cpu})
            print(f"ab_launch: {which} medians of {len(done)}: " + ", ".join(
                f"{name} {statistics.median(r.figure(name) for r in done):.2f} s"
                for name in FIGURES) + "; CPU s " + ", ".join(
                f"{k} {statistics.median(r.cpu.get(k, 0.0) for r in done):.2f}"
                for k in roles), flush=True)
        for name, values in ratios.items():
            if values:
                print(f"ab_launch: {name} new/old {statistics.median(values):.3f} over "
                      f"{len(values)} pairs (range {min(values):.2f}-{max(values):.2f}; "
                      f"quartiles {_quartiles(values)})", flush=True)
        return 0
    finally:
        os.environ.pop("BV_DEVCLUSTER_HOOKS", None)
        subprocess.run([PY, DEVCLUSTER, "up", "--nodes", "3"], capture_output=True, timeout=600,
                       check=False, env={**os.environ, "BV_PYTHON": PY})
        hooks.close()


if __name__ == "__main__":
    sys.exit(main())
