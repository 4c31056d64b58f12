"""bv's torchtitan integration against torchtitan's real classes, without the cluster.

Real torchrun ranks (gloo, CPU) with the environment bv's node agent gives them
(bluevela/runtime/world.py), so bv's start-up hook arms the integration as in a job; each rank
runs torchtitan's own ``Trainer.train`` loop with its real ``CheckpointManager``,
``OptimizersContainer`` and ``LRSchedulersContainer`` on a tiny model, a real SIGUSR1 to one
rank mid-training, torchtitan's own ``step-<N>`` checkpoint and its own resume in the next run.

torchtitan's ``Trainer.__init__`` cannot run here: its device layer has no CPU path
(``device_type`` falls back to ``"cuda"``) and its models need triton, its data assets its
source tree. The script therefore builds the loop's parts itself (what ``__init__`` would) and
replaces the loop's two accelerator-bound pieces: ``train_step`` (a real AdamW step of a
4x1 linear model on CPU) and ``dist_utils.set_pg_timeouts`` (a barrier on the current CUDA
device after the first step). It still calls the wrapped ``__init__`` once, to see bv's
handler installed before torchtitan's own build runs.

Which Python runs torchtitan: torchtitan 0.3.0 is not a test extra (its requirements would move
huggingface_hub, fsspec and datasets under the rest of the suite: docs/byos.md, "torchtitan"),
so slurm/install-deps builds a virtualenv apart, over the system's site-packages
(/opt/bluevela-ci/torchtitan-venv, the set in slurm/torchtitan-venv.txt), and the torchrun
ranks and the version-gate script run in its Python. In order: this Python when it has
torchtitan and triton; else ``$BV_TORCHTITAN_PYTHON`` (tests/run sets it to the virtualenv's:
set, it must have them, or the tests fail); else that virtualenv when it exists; else the
tests that need torchtitan skip, saying so. The version range needs none.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from bluevela import integrations
from bluevela.runtime.world import training_env
from tests.conftest import REPO

# slurm/install-deps builds it (BV_TORCHTITAN_VENV elsewhere; tests/run passes its Python on).
VENV_PYTHON = Path("/opt/bluevela-ci/torchtitan-venv/bin/python")
NEED = ("torchtitan is not installed here (not a test extra) and there is no torchtitan "
        f"virtualenv ({VENV_PYTHON}: `slurm/install-deps` builds it as root, or point "
        "BV_TORCHTITAN_PYTHON at a Python with torchtitan 0.3 and triton; docs/byos.md, "
        "'torchtitan')")
HAS = ("import importlib.util as u, sys; "
       "sys.exit(not all(u.find_spec(m) for m in ('torchtitan', 'triton')))")

LOOP = """
import os, signal, sys, torch
import torch.distributed as dist
from torchtitan import trainer as tt
from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
from torchtitan.config import TrainingConfig
from torchtitan.tools import utils

folder, interval, enable, signal_rank, signal_step = sys.argv[1:6]
dist.init_process_group("gloo")  # env://, as torchrun gives it
rank = dist.get_rank()
say = lambda text: os.write(1, f"rank{rank} {text}\\n".encode())  # one write: ranks share stdout
say(f"patched={getattr(tt.Trainer, '_bv_patched', False)}")
# The loop's one CUDA-bound call: after the first step, a barrier on the current CUDA device
# before it shortens the process groups' timeouts.
tt.dist_utils.set_pg_timeouts = lambda timeout, parallel_dims: None
steps = 6
config = tt.Trainer.Config(
    dump_folder=folder, training=TrainingConfig(steps=steps, local_batch_size=4, seq_len=8),
    optimizer=default_adamw(lr=0.01, implementation="for-loop"),
    lr_scheduler=LRSchedulersContainer.Config(warmup_steps=1),
    checkpoint=CheckpointManager.Config(enable=enable == "1", interval=int(interval),
                                        last_save_model_only=False, keep_latest_k=0))
config.validator.enable = False
trainer = tt.Trainer.__new__(tt.Trainer)
try:
    tt.Trainer.__init__(trainer, config)  # bv's wrapper, then torchtitan's own (fails on CPU)
except Exception as exc:
    say(f"init_failed={type(exc).__name__}")
say(f"handler={signal.getsignal(signal.SIGUSR1) not in (signal.SIG_DFL, None)}")
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
trainer.config, trainer.step, trainer.ntokens_seen = config, 0, 0
trainer.model_parts, trainer.dataloader, trainer.parallel_dims = [model], None, None
trainer.gc_handler = utils.GarbageCollection(gc_freq=1000)
trainer.optimizers = config.optimizer.build(model_parts=[model])
trainer.lr_schedulers = config.lr_scheduler.build(optimizers=trainer.optimizers,
                                                  training_steps=steps)
trainer.checkpointer = config.checkpoint.build(
    dataloader=None, model_parts=[model], optimizers=trainer.optimizers,
    lr_schedulers=trainer.lr_schedulers, states={"train_state": trainer}, sd_adapter=None,
    base_folder=folder)
started = []
def train_step(data_iterator):
    if not started:
        started.append(trainer.step - 1)
        say(f"start_step={started[0]}")
    if trainer.step == int(signal_step) and rank == int(signal_rank):
        os.kill(os.getpid(), signal.SIGUSR1)  # what bv's node agent sends
    loss = torch.nn.functional.mse_loss(model(torch.full((4, 4), trainer.step / steps)),
                                        torch.ones(4, 1))
    loss.backward()
    trainer.optimizers.step()
    trainer.optimizers.zero_grad()
    trainer.lr_schedulers.step()
trainer.train_step = train_step
trainer.train()
say(f"end_step={trainer.step} stopped_at={getattr(trainer, '_bv_stopped_at', None)} "
    f"weight={model.weight.sum().item():.6f}")
trainer.close()
dist.destroy_process_group()
"""

# The version gate on a Trainer without the loop condition, in torchtitan's Python (a fresh
# interpreter: no warning given before, no start-up hook).
UNKNOWN = """
import json, warnings, torchtitan
from types import ModuleType
from bluevela import integrations
from bluevela.integrations import torchtitan as bv_torchtitan

class Trainer:  # stands for a reshaped torchtitan Trainer: no loop condition
    def __init__(self, config): ...
    def train(self): ...

module = ModuleType("torchtitan.trainer")
module.Trainer = Trainer
installed = torchtitan.__version__
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    torchtitan.__version__ = "0.4.0"
    results = [bv_torchtitan.patch(module)]
    torchtitan.__version__ = integrations.TESTED["torchtitan"]
    results += [bv_torchtitan.patch(module), bv_torchtitan.patch(module)]
print(json.dumps({"installed": installed, "patched": results,
                  "messages": [str(w.message) for w in caught],
                  "marked": hasattr(Trainer, "_bv_patched")}))
"""


def _has_torchtitan(python: str) -> bool:
    return subprocess.run([python, "-c", HAS], capture_output=True, timeout=60,
                          check=False).returncode == 0


@pytest.fixture(scope="module")
def titan_python() -> str:
    """The Python that has torchtitan and triton (the module docstring's order), or a skip."""
    if all(importlib.util.find_spec(m) for m in ("torchtitan", "triton")):
        return sys.executable
    named = os.environ.get("BV_TORCHTITAN_PYTHON")
    if named:
        assert Path(named).is_file() and _has_torchtitan(named), (
            f"BV_TORCHTITAN_PYTHON={named}: no torchtitan and triton there (slurm/install-deps)")
        return named
    if VENV_PYTHON.is_file() and _has_torchtitan(str(VENV_PYTHON)):
        return str(VENV_PYTHON)
    pytest.skip(NEED)


def _run(python: str, argv: list[str], env: dict[str, str], cwd: Path) -> str:
    proc = subprocess.run([python, *argv], env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=400, check=False)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text
    assert "Traceback" not in text, text
    return text


def _torchrun(python: str, tmp_path: Path, nproc: int, *args: str) -> str:
    """`torchrun --nproc-per-node=nproc LOOP args` in `python`, with bv's training
    environment; its output."""
    script = tmp_path / "loop.py"
    script.write_text(LOOP)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "BV_", "PL_"))}
    base["PYTHONPATH"] = str(REPO)  # this tree's bv (the start-up hook goes in front of it)
    base.update({"SLURM_JOB_ID": "7", "SLURM_JOB_NAME": "t", "BV_STEP_NODELIST": "node1",
                 "BV_STEP_NUM_NODES": "1", "SLURM_JOB_NUM_NODES": "2",
                 "SLURM_JOB_NODELIST": "node[1-2]", "OMP_NUM_THREADS": "1"})
    argv = ["torchrun", f"--nproc-per-node={nproc}", "--standalone", str(script), *args]
    env = training_env(base, argv)
    # torchrun starts its ranks with its own interpreter: `python`'s.
    return _run(python, ["-m", "torch.distributed.run", *argv[1:]], env, tmp_path)


def _seen(text: str, rank: int, name: str) -> str | None:
    found = re.search(rf"^rank{rank} .*\b{name}=(\S+)", text, re.M)
    return found.group(1) if found else None


def _steps(folder: Path) -> list[str]:
    """The complete ``step-<N>`` checkpoints (torchtitan's own test: a ``.metadata`` file)."""
    return sorted(p.name for p in folder.iterdir() if (p / ".metadata").is_file())


@pytest.mark.timeout(1500)
def test_ranks_agree_save_at_the_signal_and_torchtitan_resumes_there(
        titan_python: str, tmp_path: Path) -> None:
    """Four torchruns (each costs its ranks' torchtitan import, so the cases share them).
    1: SIGUSR1 to rank 1 only during step 3: both stop after step 3, torchtitan's ``step-3``
    holds both ranks' shards, exit 0. 2: resumes at 3 by torchtitan's own load; SIGUSR1 to
    rank 0 during step 4, a step its interval (2) saves: it stops there without a second save.
    3: resumes at 4, armed and never signalled: runs to 6 and bv never stops it. 4: one rank,
    ``checkpoint.enable`` off: armed (the Trainer is wrapped) but no handler installed (so bv's
    node agent gives the job torchrun's SIGTERM stop instead), no checkpoint written, the loop
    runs to its end; its weights, never stopped, are those of 1-3, stopped twice."""
    out = tmp_path / "out"
    first = _torchrun(titan_python, tmp_path, 2, str(out), "100", "1", "1", "3")
    for rank in (0, 1):
        assert _seen(first, rank, "patched") == "True", first
        assert _seen(first, rank, "handler") == "True", first  # before torchtitan's __init__
        assert _seen(first, rank, "start_step") == "0", first
        assert _seen(first, rank, "end_step") == "3", first
        assert _seen(first, rank, "stopped_at") == "3", first
    # Rank 0 prints; only rank 1 had the signal: the all-reduce told rank 0.
    assert "bv: checkpoint requested (on another rank): saved step 3 in " in first, first
    ckpt = out / "checkpoint"
    assert _steps(ckpt) == ["step-3"]
    assert sorted(p.name for p in (ckpt / "step-3").glob("*.distcp")) == [
        "__0_0.distcp", "__1_0.distcp"]

    second = _torchrun(titan_python, tmp_path, 2, str(out), "2", "1", "0", "4")
    for rank in (0, 1):
        assert _seen(second, rank, "start_step") == "3", second  # torchtitan's own resume
        assert _seen(second, rank, "end_step") == "4", second
    assert "bv: checkpoint requested (SIGUSR1): step 4 saved by its interval" in second, second
    assert _steps(ckpt) == ["step-3", "step-4"]

    third = _torchrun(titan_python, tmp_path, 2, str(out), "100", "1", "0", "99")
    for rank in (0, 1):
        assert _seen(third, rank, "handler") == "True", third
        assert _seen(third, rank, "start_step") == "4", third
        assert _seen(third, rank, "end_step") == "6", third
        assert _seen(third, rank, "stopped_at") == "None", third
    assert "bv: checkpoint requested" not in third

    straight = tmp_path / "straight"
    # One rank: no collective in this loop, so one rank's weights are each rank's.
    off = _torchrun(titan_python, tmp_path, 1, str(straight), "100", "0", "0", "99")
    assert _seen(off, 0, "patched") == "True", off
    assert _seen(off, 0, "handler") == "False", off
    assert _seen(off, 0, "start_step") == "0", off
    assert _seen(off, 0, "end_step") == "6", off
    assert _seen(off, 0, "stopped_at") == "None", off
    assert "bv: checkpoint requested" not in off
    assert not (straight / "checkpoint").exists()
    weight = _seen(third, 0, "weight")
    assert weight is not None and _seen(off, 0, "weight") == weight, (off, third)


def test_unknown_torchtitan_is_one_warning_and_no_integration(
        titan_python: str, tmp_path: Path) -> None:
    """torchtitan 0.4.0: one warning, no integration; the tested version with a Trainer that
    has no ``should_continue_training``: one warning (not one per call), no integration."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    got = json.loads(_run(titan_python, ["-c", UNKNOWN], env, tmp_path).splitlines()[-1])
    assert got["installed"] == integrations.TESTED["torchtitan"], got  # the tested version ran
    assert got["patched"] == [False, False, False], got
    messages = got["messages"]
    assert len(messages) == 2, messages
    assert "torchtitan 0.4.0 is not a version" in messages[0]
    assert "has no should_continue_training" in messages[1]
    assert not got["marked"]


def test_torchtitan_version_range() -> None:
    integrations._warned.discard("torchtitan")
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        assert integrations.supported("torchtitan", integrations.TESTED["torchtitan"])
        assert integrations.supported("torchtitan", "0.3.1.dev20261101")
        assert not integrations.supported("torchtitan", "0.2.2")
        assert not integrations.supported("torchtitan", "0.4.0")
        assert not integrations.supported("torchtitan", "0.0.0+unknown")  # no package metadata
