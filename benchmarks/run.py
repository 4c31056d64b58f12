#!/usr/bin/env python3
"""The benchmark runner: prints one line per figure — name, value, unit, goal, verdict.

Each `benchmarks/bench_<topic>.py` defines `figures(args) -> Iterable[Figure]`. Run all with
`python benchmarks/run.py`, or some with `python benchmarks/run.py cli archive`. Figures that
need the dev cluster bring it up through `slurm/devcluster` (BV_DEVCLUSTER_ID selects which).
These are measurements that print, not timed tests: nothing here fails CI.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))



def _modules(names: list[str]) -> list[Path]:
    found = sorted(HERE.glob("bench_*.py"))
    if names:
        found = [p for p in found if p.stem.removeprefix("bench_") in names]
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("topics", nargs="*", help="bench_<topic>.py to run (default: all)")
    parser.add_argument("--json", action="store_true", help="one JSON object per figure")
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    args = parser.parse_args()
    failed = 0
    for path in _modules(args.topics):
        spec = importlib.util.spec_from_file_location(path.stem, path)
        assert spec and spec.loader
        mod = importlib.util.module_from_spec(spec)
        sys.modules[path.stem] = mod  # dataclasses (bench_recovery) look their module up
        try:
            spec.loader.exec_module(mod)
            for fig in mod.figures(args):
                print(json.dumps(fig.as_dict()) if args.json else fig.line(), flush=True)
        except Exception:  # noqa: BLE001 - one broken benchmark must not hide the others
            failed += 1
            print(f"{path.stem}: ERROR", file=sys.stderr)
            traceback.print_exc()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
