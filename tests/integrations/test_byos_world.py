"""Bring your own script, without the cluster: the training world torchrun's ranks see
(bluevela/runtime/world.py), bv's start-up hook in a real interpreter (a chained
sitecustomize, per-rank names), the version gate, and the node agent's stop for a worker that
handles no checkpoint signal (a real agent, a stand-in torchrun, real signals)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

from bluevela import integrations
from bluevela.protocol.keys import SECRET_ENV
from bluevela.runtime.world import boot_dir, nproc_from_argv, rank_env, training_env
from tests.conftest import REPO
from tests.supervisor_standins import AgentLine

# What srun gives the node agent of a 2-node step in a 3-node allocation (one spare).
SRUN_ENV = {
    "SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "node[1-3]", "SLURM_JOB_NUM_NODES": "3",
    "SLURM_NODELIST": "node[1-2]", "SLURM_NNODES": "2", "SLURM_NTASKS": "2",
    "SLURM_NPROCS": "2", "SLURM_TASKS_PER_NODE": "1(x2)", "SLURM_PROCID": "1",
    "SLURM_LOCALID": "0", "SLURM_NODEID": "1", "SLURM_STEP_NODELIST": "node[1-2]",
    "BV_STEP_NODELIST": "node[1,3]", "BV_STEP_NUM_NODES": "2", "PATH": os.environ["PATH"],
}


def test_nproc_from_torchrun_argv() -> None:
    assert nproc_from_argv(["torchrun", "--nproc-per-node=4", "x.py"]) == 4
    assert nproc_from_argv(["torchrun", "--nproc_per_node", "2", "x.py"]) == 2
    assert nproc_from_argv(["torchrun", "--nproc-per-node=gpu", "x.py"]) is None
    assert nproc_from_argv(["torchrun", "x.py", "--nproc-per-node=0"]) is None
    assert nproc_from_argv(["torchrun", "x.py"]) is None


def test_training_env_describes_the_step_not_the_allocation() -> None:
    before = dict(SRUN_ENV)
    env = training_env(SRUN_ENV, ["torchrun", "--nproc-per-node=4", "train.py"])
    assert SRUN_ENV == before  # srun's (the agent's) environment is not changed
    for name in ("SLURM_JOB_NODELIST", "SLURM_NODELIST", "SLURM_STEP_NODELIST"):
        assert env[name] == "node[1,3]"  # the spare's replacement, not the allocation
    for name in ("SLURM_JOB_NUM_NODES", "SLURM_NNODES", "SLURM_STEP_NUM_NODES"):
        assert env[name] == "2"
    assert env["SLURM_NTASKS"] == env["SLURM_NPROCS"] == env["SLURM_STEP_NUM_TASKS"] == "8"
    assert env["SLURM_NTASKS_PER_NODE"] == "4" and env["SLURM_TASKS_PER_NODE"] == "4(x2)"
    assert env["PL_TRAINER_NUM_NODES"] == "2" and env["PL_TRAINER_DEVICES"] == "4"
    assert env["BV_ALLOC_NODELIST"] == "node[1-3]" and env["BV_ALLOC_NUM_NODES"] == "3"
    # srun's per-task names are the agent's: each rank sets its own (rank_env).
    assert not {"SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID"} & set(env)
    assert env["BV_INTEGRATIONS"] == "1"
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(boot_dir())
    assert (boot_dir() / "sitecustomize.py").is_file()


def test_training_env_keeps_what_the_job_set() -> None:
    env = training_env({**SRUN_ENV, "PL_TRAINER_DEVICES": "1", "PYTHONPATH": "/mine",
                        "BV_INTEGRATIONS": "0"}, ["torchrun", "--nproc-per-node=gpu", "t.py"])
    assert env["PL_TRAINER_DEVICES"] == "1"  # bv submit --env wins
    assert env["PYTHONPATH"] == "/mine" and env["BV_INTEGRATIONS"] == "0"  # opted out
    # --nproc-per-node=gpu: the counts are not known here; each rank sets them.
    assert "SLURM_NTASKS" not in env and "SLURM_TASKS_PER_NODE" not in env
    assert env["SLURM_JOB_NUM_NODES"] == "2"


def test_rank_env_from_torchrun() -> None:
    got = rank_env({"RANK": "5", "LOCAL_RANK": "1", "GROUP_RANK": "2", "WORLD_SIZE": "6",
                    "LOCAL_WORLD_SIZE": "2"})
    assert got["SLURM_PROCID"] == "5" and got["SLURM_LOCALID"] == "1"
    assert got["SLURM_NODEID"] == "2" and got["SLURM_NTASKS"] == "6"
    assert got["SLURM_TASKS_PER_NODE"] == "2(x3)" and got["PL_TRAINER_DEVICES"] == "2"
    assert rank_env({"RANK": "0"}) == {}  # not a torchrun rank


PROBE = ("import json, os, sys; print(json.dumps({k: os.environ.get(k) for k in "
         "('SLURM_PROCID', 'SLURM_LOCALID', 'SLURM_NODEID', 'SLURM_NTASKS', 'CHAINED')}));"
         "print(json.dumps([type(f).__name__ for f in sys.meta_path]))")


def _probe(env: dict[str, str]) -> tuple[dict[str, str | None], list[str]]:
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True,
                         text=True, check=True, cwd="/")
    assert "Traceback" not in out.stderr and "bv:" not in out.stderr, out.stderr
    lines = out.stdout.splitlines()
    return json.loads(lines[0]), json.loads(lines[1])


def test_boot_hook_in_a_real_rank_and_the_chained_sitecustomize(tmp_path: Path) -> None:
    """A fresh interpreter with the training environment: as a rank (LOCAL_RANK set) it gets
    its own Slurm names and bv's import hook; the sitecustomize that bv's shadows still runs;
    torchrun itself (no LOCAL_RANK) and an opted-out job get nothing of bv."""
    own = tmp_path / "site"
    own.mkdir()
    (own / "sitecustomize.py").write_text("import os\nos.environ['CHAINED'] = 'yes'\n")
    base = {**SRUN_ENV, "PYTHONPATH": f"{own}{os.pathsep}{REPO}"}
    env = training_env(base, ["torchrun", "--nproc-per-node=2", "t.py"])
    rank = {**env, "RANK": "3", "LOCAL_RANK": "1", "GROUP_RANK": "1", "WORLD_SIZE": "4",
            "LOCAL_WORLD_SIZE": "2"}
    seen, finders = _probe(rank)
    assert seen == {"SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
                    "SLURM_NTASKS": "4", "CHAINED": "yes"}
    assert finders[0] == "AfterImport"
    seen, finders = _probe(env)  # torchrun itself
    assert seen["SLURM_PROCID"] is None and seen["CHAINED"] == "yes"
    assert "AfterImport" not in finders
    off = training_env({**base, "BV_INTEGRATIONS": "0"}, ["torchrun", "t.py"])
    seen, finders = _probe({**off, "RANK": "3", "LOCAL_RANK": "1", "GROUP_RANK": "1",
                            "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"})
    assert seen["SLURM_PROCID"] is None and "AfterImport" not in finders


def test_unknown_framework_version_is_one_warning_and_no_integration() -> None:
    integrations._warned.discard("transformers")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert not integrations.supported("transformers", "99.1.0")
        assert not integrations.supported("transformers", "99.1.0")
    assert len(caught) == 1 and "99.1.0" in str(caught[0].message)
    assert integrations.supported("transformers", integrations.TESTED["transformers"])
    assert integrations.supported("lightning", "2.6.6")
    integrations._warned.discard("lightning")
    with pytest.warns(UserWarning, match="lightning 3.0.0rc1 is not a version"):
        assert not integrations.supported("lightning", "3.0.0rc1")


# A stand-in torchrun: records its environment and the signals it gets; its one worker never
# installs a SIGUSR1 handler (a plain script with no checkpoint code).
FAKE_TORCHRUN = """
import json, os, signal, subprocess, sys, time
out = sys.argv[-1]
keep = ("SLURM_JOB_NUM_NODES", "SLURM_NTASKS", "SLURM_JOB_NODELIST", "SLURM_PROCID",
        "BV_INTEGRATIONS", "PL_TRAINER_NUM_NODES")
open(os.path.join(out, "torchrun.env"), "w").write(json.dumps({k: os.environ.get(k) for k in keep}))
worker = subprocess.Popen([sys.executable, "-c", "import time\\nwhile True: time.sleep(0.05)"],
                          env={**os.environ, "LOCAL_RANK": "0"})
def term(*_):  # as torchrun does: pass the stop on to the workers
    open(os.path.join(out, "torchrun.sigterm"), "w").close()
    os.kill(worker.pid, signal.SIGTERM)
signal.signal(signal.SIGTERM, term)
open(os.path.join(out, "ready"), "w").close()
sys.exit(1 if worker.wait() else 0)
"""


def _kill_running(program: Path) -> None:
    """SIGKILL every process whose command line runs `program` (this test's stand-in only)."""
    want = str(program).encode()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if want in argv[:2]:
            try:
                os.kill(int(proc.name), signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.mark.parametrize(("env_wait", "left_s", "wait"), [
    ("1", None, 1),  # the job's BV_USR1_WAIT_S
    (None, 47, 2),  # the time limit near: 47 s left, 45 s of them for the stop path
])
def test_agent_stops_a_worker_without_a_handler_with_sigterm(
        tmp_path: Path, env_wait: str | None, left_s: int | None, wait: int) -> None:
    """bv's checkpoint signal to a node whose worker never handles SIGUSR1: after the wait
    (BV_USR1_WAIT_S, else what the request's time left allows, else 30 s) torchrun gets
    SIGTERM (it stops its workers, as at a Slurm stop), the worker is never sent SIGUSR1 (its
    default action would kill it), and the agent's exit message counts it and says the wait;
    torchrun got the training world in its environment."""
    line = AgentLine()
    torchrun = tmp_path / "torchrun"
    torchrun.write_text(f"#!{sys.executable}\n{FAKE_TORCHRUN}")
    torchrun.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "LOCAL_RANK"}
    env.update(SRUN_ENV, BV_SUPERVISOR=line.address,
               SLURMD_NODENAME="node1", BV_RDZV_NODE="node1", BV_RDZV_GUARD="optional",
               PYTHONPATH=str(REPO), **{SECRET_ENV: line.secret})
    env.pop("BV_USR1_WAIT_S", None)
    if env_wait is not None:
        env["BV_USR1_WAIT_S"] = env_wait
    agent = subprocess.Popen([sys.executable, "-P", "-m", "bluevela.launch.agent",
                              "--", str(torchrun), "--nproc-per-node=1", str(tmp_path)],
                             env=env, cwd=REPO)
    try:
        line.accept()
        hello = line.next()
        line.send({"t": "go", "port": hello["port"]})
        deadline = time.monotonic() + 20
        while not (tmp_path / "ready").exists():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        asked = time.monotonic()
        line.send({"t": "usr1", **({} if left_s is None else {"left_s": left_s})})
        msg = line.until("exit")
        took = time.monotonic() - asked
    finally:
        if agent.poll() is None:
            agent.send_signal(signal.SIGKILL)
        agent.wait(timeout=20)
        line.close()
        _kill_running(torchrun)  # torchrun leads its own session: a failed run must not leak it
    assert msg["termed"] == 1 and msg["signalled"] == 0 and msg["waited"] == wait, msg
    assert (tmp_path / "torchrun.sigterm").exists()
    assert wait <= took < wait + 9, took
    seen = json.loads((tmp_path / "torchrun.env").read_text())
    assert seen == {"SLURM_JOB_NUM_NODES": "2", "SLURM_NTASKS": "2",
                    "SLURM_JOB_NODELIST": "node[1,3]", "SLURM_PROCID": None,
                    "BV_INTEGRATIONS": "1", "PL_TRAINER_NUM_NODES": "2"}


def test_supervisor_end_line_names_the_sigterm_stop() -> None:
    from bluevela.launch.step import signal_result

    result = signal_result(signal.SIGUSR1, {"node1": 1}, 1, termed=2)
    assert result.kind == "signal"
    assert "2 worker(s) had no handler for it after 30 s" in result.cause
    waited = signal_result(signal.SIGUSR1, {"node1": 1}, 1, termed=2, waited=15)
    assert "had no handler for it after 15 s" in waited.cause  # the agents' wait, said
    assert "stopped with SIGTERM through torchrun" in result.cause


def test_point_last_names_the_hpc_checkpoint_in_one_rename(tmp_path: Path) -> None:
    """bv's `last.ckpt` for Lightning's "last": a relative link to the HPC file in place of the
    callback's older file (a sharded strategy's folder too); the link's target keeps the data
    when the callback later writes its own file over the name, as Lightning's atomic save
    does (a rename)."""
    from bluevela.integrations.lightning import point_last

    root = tmp_path / "root"
    (root / "checkpoints").mkdir(parents=True)
    hpc, last = root / "hpc_ckpt_1.ckpt", root / "checkpoints" / "last.ckpt"
    hpc.write_bytes(b"step 3")
    last.write_bytes(b"step 2")
    point_last(str(hpc), str(last))
    assert last.is_symlink() and os.readlink(last) == "../hpc_ckpt_1.ckpt"
    assert last.read_bytes() == b"step 3" and sorted(os.listdir(last.parent)) == ["last.ckpt"]
    (last.parent / "tmp").write_bytes(b"step 6")
    os.replace(last.parent / "tmp", last)
    assert hpc.read_bytes() == b"step 3" and last.read_bytes() == b"step 6"
    shard = root / "hpc_ckpt_2.ckpt"
    shard.mkdir()
    (shard / "0.distcp").write_bytes(b"rank 0")
    last.unlink()
    last.mkdir()
    (last / "0.distcp").write_bytes(b"old")
    point_last(str(shard), str(last))
    assert last.is_symlink() and (last / "0.distcp").read_bytes() == b"rank 0"
