"""The sbatch script `bv submit` builds: golden files, quoting of hostile values, refusals.

Regenerate the golden files after an intended change with:
    BV_REGEN_GOLDEN=1 python -m pytest tests/launch/test_launch_script.py
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bluevela.errors import LaunchError
from bluevela.launch.request import SubmitRequest
from bluevela.launch.submit import build_request
from bluevela.site import load_site
from tests.conftest import DATA, HOSTILE, REPO

GOLDEN = DATA / "golden"
SITE = load_site(REPO / "site.yaml")

CASES: dict[str, dict[str, object]] = {
    "minimal": {"script": "train.py"},
    "two_nodes_cpu": {"script": "examples/train_ddp.py", "args": ("--steps", "10"), "nodes": 2,
                      "procs_per_node": 2, "job_name": "ddp", "time_limit": "00:10:00"},
    "h100_full": {"script": "/shared/proj/train.py", "args": ("--config", "cfg a.yaml"),
                  "nodes": 16, "node_class": "h100", "partition": "gpu", "account": "ml",
                  "qos": "high", "comment": "ticket 42", "env": ("NCCL_IB_HCA=mlx5",),
                  "max_restarts": 3, "requeue": False},
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_golden(name: str) -> None:
    kw = dict(CASES[name])
    req = build_request(SITE, kw.pop("script"), kw.pop("args", ()), **kw)  # type: ignore[arg-type]
    text = req.materialize()
    path = GOLDEN / f"{name}.sbatch"
    old = path.read_text() if path.exists() else None
    if os.environ.get("BV_REGEN_GOLDEN"):
        # Compared before writing: a regenerated file is never compared with itself.
        if text != old:
            path.write_text(text)
            pytest.fail(f"{path} regenerated: review the diff and run again without "
                        "BV_REGEN_GOLDEN")
    assert text == old, f"{path} differs; regenerate with BV_REGEN_GOLDEN=1"


def test_sbatch_lines_sorted_and_torchrun_shape() -> None:
    req = build_request(SITE, "t.py", nodes=2, procs_per_node=2, comment="c", job_name="j")
    lines = req.materialize().splitlines()
    sb = [ln for ln in lines if ln.startswith("#SBATCH")]
    assert sb == sorted(sb)
    run = lines[-1]
    # The in-job supervisor is the job's main process; it adds the rendezvous flags per step.
    assert run.startswith("exec python3 -P -m bluevela.launch.supervisor --nodes=2 ")
    assert run.endswith(" -- torchrun --nproc-per-node=2 --max-restarts=0 t.py")


def test_procs_default_to_gpus() -> None:
    assert build_request(SITE, "t.py", node_class="h100").nproc_per_node == 8
    assert build_request(SITE, "t.py").nproc_per_node == 1


@pytest.mark.parametrize("value", HOSTILE)
def test_hostile_values_run_nothing(value: str, tmp_path: Path) -> None:
    """Every hostile value, in every free-text slot, reaches bash as data only.

    The script is run by real bash with srun/scontrol replaced by recorders, then the argv
    that srun received is compared with what we asked for.
    """
    for f in ("/tmp/bv-pwned-semicolon", "/tmp/bv-pwned-subst", "/tmp/bv-pwned-backtick"):
        Path(f).unlink(missing_ok=True)
    req = build_request(SITE, f"dir {value}/train.py", (value, "--x", value), job_name=value,
                        comment=value, env=(f"BV_TEST={value}",))
    script = tmp_path / "job.sh"
    script.write_text(req.materialize())
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "scontrol").write_text("#!/bin/sh\necho node1\n")
    # The batch script execs `python3 -P -m bluevela.launch.supervisor`: this interpreter.
    (bindir / "python3").write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    # Records argv NUL-separated, and the env value it saw.
    (bindir / "srun").write_text('#!/bin/sh\nprintf "%s\\0" "$@" > "$OUT"\nprintf "%s" "$BV_TEST" > "$OUT.env"\n')
    for f in bindir.iterdir():
        f.chmod(0o755)
    out = tmp_path / "argv"
    env = {"PATH": f"{bindir}:/usr/bin:/bin", "OUT": str(out), "SLURM_JOB_NODELIST": "node[1-2]",
           "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_ID": "77"}
    subprocess.run(["bash", str(script)], env=env, check=True, cwd=tmp_path, timeout=30)
    argv = out.read_bytes().decode().split("\0")[:-1]
    tail = argv[argv.index(f"dir {value}/train.py"):]
    assert tail == [f"dir {value}/train.py", value, "--x", value]
    # torch's static rendezvous (issue 37; --max-restarts 0); nothing that names the store
    # (id, endpoint, its node) on srun's argv: those go in the environment (issue 23).
    assert "--rdzv-backend=static" in argv and "77" not in argv
    assert not any(a.startswith(("--rdzv-endpoint", "--rdzv-id", "--rdzv-node")) for a in argv)
    assert "-P" in argv[:argv.index("bluevela.launch.agent")]
    assert Path(f"{out}.env").read_text() == value
    for f in ("/tmp/bv-pwned-semicolon", "/tmp/bv-pwned-subst", "/tmp/bv-pwned-backtick"):
        assert not Path(f).exists(), f"hostile value executed: {f}"


@pytest.mark.parametrize("field", ["job_name", "comment"])
@pytest.mark.parametrize("bad", ["a\n#SBATCH --uid=0", "nul\0byte", "cr\rreturn"])
def test_unsafe_values_refused(field: str, bad: str) -> None:
    with pytest.raises(LaunchError, match="newline or control"):
        build_request(SITE, "t.py", **{field: bad})  # type: ignore[arg-type]


@pytest.mark.parametrize(("kw", "msg"), [
    ({"partition": "a b"}, "not a plain name"),
    ({"time_limit": "soon"}, "not a Slurm time"),
    ({"env": ("1BAD=x",)}, "not a valid variable name"),
    ({"env": ("NOEQUALS",)}, "not KEY=VALUE"),
])
def test_invalid_options_refused(kw: dict[str, object], msg: str) -> None:
    with pytest.raises(LaunchError, match=msg):
        build_request(SITE, "t.py", **kw)  # type: ignore[arg-type]


def test_unknown_sbatch_option_lists_valid_ones() -> None:
    with pytest.raises(LaunchError, match="valid: .*account"):
        SubmitRequest(script="t.py", extra_sbatch=(("uid", "0"),))


def test_materialize_is_deterministic() -> None:
    a = build_request(SITE, "t.py", nodes=3).materialize()
    b = build_request(SITE, "t.py", nodes=3).materialize()
    assert a == b


def test_class_without_a_site_is_refused() -> None:
    with pytest.raises(LaunchError, match="--class h100 needs a site file"):
        build_request(None, "t.py", node_class="h100")


@pytest.mark.parametrize(("value", "rendered"), [
    ("x\\", "'x\\\\'"),  # shlex.quote gave 'x\' : sbatch reads \' as a quote, then "Unmatched '"
    ("it's", "'it\\'s'"),
    ("back\\slash it's", "'back\\\\slash it\\'s'"),
    ("#not-a-comment", "'#not-a-comment'"),
    ("plain-1.2_x", "plain-1.2_x"),
    ("", "''"),
])
def test_sbatch_values_are_quoted_for_sbatchs_own_parser(value: str, rendered: str) -> None:
    """`#SBATCH` lines are read by sbatch (backslash escapes even inside quotes), not by bash.
    tests/launch/test_sbatch_quoting_cluster.py checks the same values through real sbatch."""
    lines = build_request(SITE, "t.py", job_name=value).materialize().splitlines()
    assert f"#SBATCH --job-name={rendered}" in lines
