"""What `bv submit --dry-run` loads on a login node (issue 28 §5): with the site's validated
cache warm, neither YAML nor pydantic, nor Slurm's client (a dry run talks to no Slurm), nor
OpenSSL's hashlib (the cache file's name is a CRC of its path). 9058adc loaded the last two on
every call: `bv submit --dry-run` cost 2.06x a bare `import click` (benchmarks/bench_cli.py
measures the ratio; goal <= 2.0)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

PROBE = """
import json, sys
sys.argv = ["bv", "submit", "--dry-run", "-N", "2", sys.argv[1]]
from bluevela.cli import main
try:
    main()
except SystemExit as exc:
    assert not exc.code, exc.code
print(json.dumps(sorted(sys.modules)))
"""


def _modules(tmp_path: Path) -> set[str]:
    env = {k: v for k, v in os.environ.items() if k != "BV_SITE"}
    env.update(BV_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=str(REPO))
    p = subprocess.run([sys.executable, "-c", PROBE, str(REPO / "examples" / "train_ddp.py")],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120,
                       check=False)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "#SBATCH" in p.stdout
    return set(json.loads(p.stdout.strip().splitlines()[-1]))


def test_a_dry_run_with_a_warm_site_cache_loads_only_what_it_needs(tmp_path: Path) -> None:
    (tmp_path / "site.yaml").write_bytes((REPO / "site.yaml").read_bytes())
    first = _modules(tmp_path)  # parses and validates site.yaml, fills the cache
    assert "pydantic" in first and list((tmp_path / "cache").glob("site-*.json"))
    warm = _modules(tmp_path)
    for heavy in ("yaml", "pydantic", "annotated_types", "bluevela.slurm.client", "_hashlib",
                  "torch", "numpy", "h5py"):
        assert heavy not in warm, heavy
    assert "bluevela.site" in warm and "bluevela.launch.request" in warm
