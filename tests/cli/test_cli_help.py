"""`bv --help` and every subcommand's --help work, and never import torch, h5py or numpy.

Click's lazy loading hides import errors until a command is used: these tests walk every
command (and every subcommand of groups) so a broken import shows here.
"""

from __future__ import annotations

import json
import subprocess
import sys

import click
import pytest

from bluevela.cli import cli
from tests.conftest import REPO

HEAVY = ("torch", "h5py", "numpy", "pynvml", "mpi4py")


def _all_commands() -> list[list[str]]:
    paths: list[list[str]] = [[]]
    ctx = click.Context(cli)
    for name in cli.list_commands(ctx):
        cmd = cli.get_command(ctx, name)
        assert cmd is not None, name
        paths.append([name])
        if isinstance(cmd, click.Group):
            sub_ctx = click.Context(cmd)
            paths.extend([name, sub] for sub in cmd.list_commands(sub_ctx))
    return paths


def _loaded_after(argv: list[str]) -> tuple[int, str, list[str]]:
    code = (
        "import sys, json\n"
        "from bluevela.cli import main\n"
        "try:\n"
        f"    main({argv!r})\n"
        "except SystemExit as e:\n"
        "    rc = e.code or 0\n"
        "else:\n"
        "    rc = 0\n"
        f"print('\\n@@' + json.dumps([m for m in {list(HEAVY)!r} if m in sys.modules]))\n"
        "sys.exit(rc)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=REPO, timeout=60)
    out, _, mods = proc.stdout.rpartition("\n@@")
    return proc.returncode, out + proc.stderr, json.loads(mods)


def test_there_are_commands() -> None:
    names = {p[0] for p in _all_commands() if p}
    assert {"submit", "status", "cancel", "logs", "site"} <= names


@pytest.mark.parametrize("path", _all_commands(), ids=lambda p: " ".join(p) or "bv")
def test_help_is_light(path: list[str]) -> None:
    rc, out, heavy = _loaded_after([*path, "--help"])
    assert rc == 0, out
    assert "Usage:" in out
    assert heavy == [], f"bv {' '.join(path)} --help imported {heavy}"


@pytest.mark.parametrize(("path", "options"), [
    (["install"], ["--root", "--dry-run", "--uninstall", "--force", "--json"]),
    (["site", "validate"], ["--cluster", "--json"]),
])
def test_deploy_commands_help(path: list[str], options: list[str]) -> None:
    """issue 24: `bv install` and `bv site validate --cluster` are listed and light."""
    rc, out, heavy = _loaded_after([*path, "--help"])
    assert rc == 0 and heavy == [], out
    assert all(o in out for o in options), out


def test_dry_run_is_light_and_needs_no_slurm() -> None:
    rc, out, heavy = _loaded_after(["submit", "--dry-run", "-N", "2", "examples/train_ddp.py"])
    assert rc == 0, out
    assert out.startswith("#!/bin/bash")
    assert heavy == []


def test_submit_without_wait_does_not_import_heavy_modules(monkeypatch: pytest.MonkeyPatch) -> None:
    """The submit path up to sbatch (request, quoting, client) stays light."""
    code = (
        "import sys\n"
        "from bluevela.launch.submit import build_request, submit\n"
        "from bluevela.slurm.connect import get_client\n"
        "from bluevela.site import load_site\n"
        "build_request(load_site('site.yaml'), 't.py', nodes=2).materialize()\n"
        f"print([m for m in {list(HEAVY)!r} if m in sys.modules])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                         check=True).stdout
    assert out.strip() == "[]"


def test_bad_site_is_one_line_per_problem(tmp_path: object) -> None:
    from pathlib import Path

    bad = Path(str(tmp_path)) / "site.yaml"
    bad.write_text("cluster: x\nnode_classes:\n  a:\n    nodes: 'n[1-'\n    gpus: -2\n")
    proc = subprocess.run([sys.executable, "-m", "bluevela", "site", "validate", str(bad)],
                          capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert lines == [
        f"{bad}:4: node_classes.a.nodes: bad hostlist 'n[1-': unbalanced brackets",
        f"{bad}:5: node_classes.a.gpus: Input should be greater than or equal to 0",
    ]
    assert "Traceback" not in proc.stderr


def test_yaml_syntax_error_has_line(tmp_path: object) -> None:
    from pathlib import Path

    bad = Path(str(tmp_path)) / "s.yaml"
    bad.write_text("cluster: x\nnode_classes: [\n  a: 1\n")
    proc = subprocess.run([sys.executable, "-m", "bluevela", "--site", str(bad), "site",
                           "validate"], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 1
    assert proc.stderr.startswith(f"{bad}:") and "YAML syntax error" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_site_search_order(tmp_path: object, monkeypatch: pytest.MonkeyPatch) -> None:
    from pathlib import Path

    from bluevela.site_file import find_site_path

    d = Path(str(tmp_path))
    monkeypatch.chdir(d)
    monkeypatch.delenv("BV_SITE", raising=False)
    (d / "site.yaml").write_text("x")
    assert find_site_path() == Path("site.yaml")
    monkeypatch.setenv("BV_SITE", "/env/site.yaml")
    assert find_site_path() == Path("/env/site.yaml")
    assert find_site_path("/explicit.yaml") == Path("/explicit.yaml")


def test_repo_site_validates() -> None:
    from bluevela.site import load_site

    site = load_site(REPO / "site.yaml")
    h100 = site.node_class(name="h100")
    assert h100.gpus == 8 and h100.ib.rate_gbps == 400
    assert h100.ib.ports == [f"mlx5_{i}/1" for i in range(8)]
    assert site.class_name_for("node2") == "cpu" and site.class_name_for("gpu017") == "h100"


def test_usage_errors_exit_2_without_traceback() -> None:
    proc = subprocess.run([sys.executable, "-m", "bluevela", "submit", "--nodes", "0", "x.py"],
                          capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
