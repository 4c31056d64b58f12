"""The batch scripts `bv submit` and the nightly write, byte for byte: the texts in
tests/data/batch_head/ were rendered by the code before the two requests shared one writer of
the script's head (shebang, sorted `#SBATCH` lines, banner, shell options, exports), from the
same inputs. Quote-heavy values on purpose: the head's quoting is what was moved.

Regenerate after an intended change with
`BV_REGEN_GOLDEN=1 python -m pytest tests/launch/test_batch_head.py`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from bluevela.errors import LaunchError
from bluevela.launch.bench_job import BenchJobRequest, BenchStep
from bluevela.launch.request import SubmitRequest
from bluevela.launch.submit import build_request
from bluevela.site import load_site

HERE = Path(__file__).resolve().parents[1]
EXPECTED = HERE / "data" / "batch_head"
PY = "/opt/bluevela/bin/python3"


def _minimal() -> str:
    return build_request(None, "train.py", ("--lr", "0.1")).materialize()


def _site_full() -> str:
    notes: list[str] = []
    req = build_request(
        load_site(HERE.parent / "site.yaml"), "/data/my runs/train.py", ("--tag", "it's $HOME"),
        nodes=2, node_class="h100", time_limit="1:00:00", signal_before=120, spare_nodes=1,
        min_nodes=1, hang_timeout=300, env=("A=b c", "NCCL_DEBUG=INFO", "Q=x'y\\z"),
        sbatch_args=("--nice=10", "--mail-type=END"), job_name="my job", comment="a # b\\c 'd'",
        account="proj1", qos="high", partition="gpu", mem="200G", constraint="a&[b|c]",
        exclude="n[1-2],m7", dependency="afterok:12:13", exclusive=True, hold=True,
        cpus_per_task=8, output="logs/%x-%j.out", notes=notes)
    return req.materialize()


def _module() -> str:
    return build_request(None, "-m", ("pkg.train", "--x", "a b"), procs_per_node="auto",
                         local_ranks_filter="0,1", rank_log_dir="/tmp/rank logs",
                         time_limit="2-00:00:00", requeue=False, max_restarts=2).materialize()


def _direct() -> str:
    return SubmitRequest(
        script="t.py", nodes=4, gpus_per_node=8, procs_per_node="gpu", warm_start=True,
        rdzv_guard="optional", extra_sbatch=(("chdir", "/scratch/a b"),), grow_deadline=90.5,
        no_kill=True, python=PY, torchrun=("/opt/tr bin/torchrun", "--no-python-check"),
        env=(("EMPTY", ""), ("DOLLAR", "$(id)")), spank_options=("container-image",),
        sbatch_args=(("container-image", "nvcr.io#pytorch:24.01"),),
    ).materialize()


def _steps() -> tuple[BenchStep, ...]:
    return (
        BenchStep(argv=(PY, "-P", "-m", "bluevela.bench.gemm", "--out", "/w/n 1.json")),
        BenchStep(argv=(PY, "-P", "-m", "bluevela.bench.dist", "allreduce"), nodes=2,
                  ntasks_per_node=8, gpus_per_node=8, rendezvous=True, whole_node=True),
        BenchStep(argv=("/usr/bin/mpi bw", "-x"), nodes=2, mpi="pmix"),
    )


def _bench_pair() -> str:
    return BenchJobRequest(
        steps=_steps(), nodelist=("gpu001", "gpu002"), partition="debug", time="30:00",
        job_name="bv-bench pair", comment="night 2026-11-20 'round 2'", gpus_per_node=8,
        output="/w/runs/%j it's.out", chdir="/w/runs", env=(("BV_NIGHT", "2026-11-20"),
                                                            ("X", "a b$c")),
        qos="bench", reservation="nightly").materialize()


def _bench_node() -> str:
    return BenchJobRequest(steps=_steps()[:1], nodelist=("node1",),
                           exclusive=False).materialize()


CASES: dict[str, Callable[[], str]] = {
    "submit_minimal.sh": _minimal, "submit_site_full.sh": _site_full,
    "submit_module.sh": _module, "submit_direct.sh": _direct,
    "bench_pair.sh": _bench_pair, "bench_node.sh": _bench_node,
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_batch_script_unchanged(name: str) -> None:
    text = CASES[name]()
    path = EXPECTED / name
    if os.environ.get("BV_REGEN_GOLDEN"):
        path.write_text(text)
    assert text == path.read_text(), f"{name} changed; regenerate: BV_REGEN_GOLDEN=1 pytest {__file__}"


_STEP = (BenchStep(argv=(PY, "-x")),)
REFUSED: dict[str, tuple[Callable[[], object], str]] = {
    "submit env name": (lambda: SubmitRequest(script="t.py", env=(("1X", "v"),)),
                        "--env name '1X' is not a valid variable name"),
    "submit env value": (lambda: SubmitRequest(script="t.py", env=(("X", "a\nb"),)),
                         "--env X contains a newline or control character; refusing 'a\\nb'"),
    "submit time": (lambda: SubmitRequest(script="t.py", time="1h"),
                    "--time '1h' is not a Slurm time (MM, HH:MM:SS, D-HH, ...)"),
    "submit account": (lambda: SubmitRequest(script="t.py", account="a b"),
                       "account 'a b' is not a plain name"),
    "submit comment": (lambda: SubmitRequest(script="t.py", comment="x\ry"),
                       "comment contains a newline or control character; refusing 'x\\ry'"),
    # the first problem is the one said: a bad node count before a bad time
    "submit order": (lambda: SubmitRequest(script="t.py", nodes=0, time="1h"),
                     "--nodes must be at least 1, not 0"),
    "bench env name": (lambda: BenchJobRequest(_STEP, ("n1",), env=(("A-B", "v"),)),
                       "environment name 'A-B' is not a valid variable name"),
    "bench env value": (lambda: BenchJobRequest(_STEP, ("n1",), env=(("A", "\0"),)),
                        "environment A contains a newline or control character; refusing '\\x00'"),
    "bench time": (lambda: BenchJobRequest(_STEP, ("n1",), time="soon"),
                   "--time 'soon' is not a Slurm time (MM, HH:MM:SS, D-HH, ...)"),
    "bench reservation": (lambda: BenchJobRequest(_STEP, ("n1",), reservation="r;x"),
                          "reservation 'r;x' is not a plain name"),
    "bench job name": (lambda: BenchJobRequest(_STEP, ("n1",), job_name="a\nb"),
                       "job name contains a newline or control character; refusing 'a\\nb'"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_refusals_unchanged(case: str) -> None:
    """The shared value checks say what each request said before, in the same order."""
    make, message = REFUSED[case]
    with pytest.raises(LaunchError) as info:
        make()
    assert str(info.value) == message
