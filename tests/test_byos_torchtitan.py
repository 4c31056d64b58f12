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

torchtitan is not a test extra (installing it moves datasets, huggingface_hub and fsspec
versions the rest of the suite uses: docs/byos.md), so these tests skip unless it is
installed; run them in a virtualenv that has it (docs/byos.md, "torchtitan").
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path
from types import ModuleType

import pytest

from bluevela import integrations
from bluevela.runtime.world import training_env
from tests.conftest import REPO

NEED = ("torchtitan is not installed here (it is not a test extra: see docs/byos.md, "
        "'torchtitan'; run this file in a virtualenv with `pip install torchtitan triton`)")

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


def _need_trainer() -> None:
    pytest.importorskip("torchtitan", reason=NEED)
    if importlib.util.find_spec("triton") is None:
        pytest.skip("torchtitan.trainer imports triton (its models' kernels): not installed")


def _torchrun(tmp_path: Path, nproc: int, *args: str) -> str:
    """`torchrun --nproc-per-node=nproc LOOP args` with bv's training environment; its output."""
    script = tmp_path / "loop.py"
    script.write_text(LOOP)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "BV_", "PL_"))}
    base["PYTHONPATH"] = str(REPO)  # this tree's bv (the start-up hook goes in front of it)
    base.update({"SLURM_JOB_ID": "7", "SLURM_JOB_NAME": "t", "BV_STEP_NODELIST": "node1",
                 "BV_STEP_NUM_NODES": "1", "SLURM_JOB_NUM_NODES": "2",
                 "SLURM_JOB_NODELIST": "node[1-2]", "OMP_NUM_THREADS": "1"})
    argv = ["torchrun", f"--nproc-per-node={nproc}", "--standalone", str(script), *args]
    env = training_env(base, argv)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", *argv[1:]], env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=400,
                          check=False)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text
    assert "Traceback" not in text, text
    return text


def _seen(text: str, rank: int, name: str) -> str | None:
    found = re.search(rf"^rank{rank} .*\b{name}=(\S+)", text, re.M)
    return found.group(1) if found else None


def _steps(folder: Path) -> list[str]:
    """The complete ``step-<N>`` checkpoints (torchtitan's own test: a ``.metadata`` file)."""
    return sorted(p.name for p in folder.iterdir() if (p / ".metadata").is_file())


@pytest.mark.timeout(900)
def test_ranks_agree_save_at_the_signal_and_torchtitan_resumes_there(tmp_path: Path) -> None:
    """Two ranks; SIGUSR1 to rank 1 only during step 3: both stop after step 3, torchtitan's
    ``step-3`` holds both ranks' shards, exit 0. The next run resumes at 3 by torchtitan's own
    load; SIGUSR1 to rank 0 during step 4, a step its interval (2) saves: it stops there without
    a second save. A third run finishes at 6, and its weights are those of a run that was never
    stopped."""
    _need_trainer()
    out = tmp_path / "out"
    first = _torchrun(tmp_path, 2, str(out), "100", "1", "1", "3")
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

    second = _torchrun(tmp_path, 2, str(out), "2", "1", "0", "4")
    for rank in (0, 1):
        assert _seen(second, rank, "start_step") == "3", second  # torchtitan's own resume
        assert _seen(second, rank, "end_step") == "4", second
    assert "bv: checkpoint requested (SIGUSR1): step 4 saved by its interval" in second, second
    assert _steps(ckpt) == ["step-3", "step-4"]

    third = _torchrun(tmp_path, 2, str(out), "100", "1", "0", "99")
    assert _seen(third, 0, "start_step") == "4" and _seen(third, 0, "end_step") == "6", third
    assert _seen(third, 0, "stopped_at") == "None"
    assert "bv: checkpoint requested" not in third

    straight = _torchrun(tmp_path, 2, str(tmp_path / "straight"), "100", "1", "0", "99")
    assert _seen(straight, 0, "weight") == _seen(third, 0, "weight"), (straight, third)


@pytest.mark.timeout(600)
def test_checkpointing_off_installs_nothing_and_never_stops(tmp_path: Path) -> None:
    """``checkpoint.enable`` off: armed (the Trainer is wrapped) but no handler is installed, so
    bv's node agent gives the job torchrun's SIGTERM stop instead; the loop runs to its end."""
    _need_trainer()
    text = _torchrun(tmp_path, 1, str(tmp_path / "out"), "100", "0", "0", "99")
    assert _seen(text, 0, "patched") == "True", text
    assert _seen(text, 0, "handler") == "False", text
    assert _seen(text, 0, "end_step") == "6", text
    assert not (tmp_path / "out" / "checkpoint").exists()


def test_unknown_torchtitan_is_one_warning_and_no_integration(
        monkeypatch: pytest.MonkeyPatch) -> None:
    torchtitan = pytest.importorskip("torchtitan", reason=NEED)
    from bluevela.integrations import torchtitan as bv_torchtitan

    class Trainer:  # stands for a reshaped torchtitan Trainer: no loop condition
        def __init__(self, config: object) -> None: ...
        def train(self) -> None: ...

    module = ModuleType("torchtitan.trainer")
    module.Trainer = Trainer  # type: ignore[attr-defined]
    integrations._warned.discard("torchtitan")
    integrations._warned.discard("torchtitan.trainer")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        monkeypatch.setattr(torchtitan, "__version__", "0.4.0")
        assert not bv_torchtitan.patch(module)
        monkeypatch.setattr(torchtitan, "__version__", integrations.TESTED["torchtitan"])
        assert not bv_torchtitan.patch(module)
        assert not bv_torchtitan.patch(module)
    messages = [str(w.message) for w in caught]
    assert len(messages) == 2, messages
    assert "torchtitan 0.4.0 is not a version" in messages[0]
    assert "has no should_continue_training" in messages[1]
    assert not hasattr(Trainer, "_bv_patched")


def test_torchtitan_version_range() -> None:
    integrations._warned.discard("torchtitan")
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        assert integrations.supported("torchtitan", integrations.TESTED["torchtitan"])
        assert integrations.supported("torchtitan", "0.3.1.dev20261101")
        assert not integrations.supported("torchtitan", "0.2.2")
        assert not integrations.supported("torchtitan", "0.4.0")
        assert not integrations.supported("torchtitan", "0.0.0+unknown")  # no package metadata
