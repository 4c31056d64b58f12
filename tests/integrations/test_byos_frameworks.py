"""bv's framework integrations in a real rank, without the cluster: a fresh interpreter with the
environment bv's node agent gives a rank (bluevela/runtime/world.py), a real SIGUSR1 to itself
mid-training, the framework's own checkpoint and stop, and the framework's own resume in the
next run. One process (the all-reduce is the identity there; the multi-rank agreement runs in
tests/integrations/test_byos_cluster.py). Skipped where the frameworks are not installed."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bluevela.launch.agent import free_port
from bluevela.runtime.world import training_env

RANK = {"RANK": "0", "LOCAL_RANK": "0", "GROUP_RANK": "0", "WORLD_SIZE": "1",
        "LOCAL_WORLD_SIZE": "1", "SLURM_JOB_ID": "7", "SLURM_JOB_NAME": "t",
        "BV_STEP_NODELIST": "node1", "BV_STEP_NUM_NODES": "1", "SLURM_JOB_NUM_NODES": "2",
        "SLURM_JOB_NODELIST": "node[1-2]"}

# A Lightning module that signals itself at step 2 (argv[2] "signal") as bv's node agent would,
# and its data: the head of both Lightning scripts below.
LIGHTNING_MODULE = """
import os, signal, sys, torch
import lightning as L
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
class M(L.LightningModule):
    def __init__(self):
        super().__init__(); self.net = nn.Linear(4, 1)
    def training_step(self, batch, i):
        if self.global_step == 2 and sys.argv[2] == "signal":
            os.kill(os.getpid(), signal.SIGUSR1)  # what bv's node agent sends
        return nn.functional.mse_loss(self.net(batch[0]), batch[1])
    def on_train_start(self):
        print(f"start_step={self.global_step}", flush=True)
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)
data = DataLoader(TensorDataset(torch.randn(256, 4), torch.randn(256, 1)), batch_size=4)
"""

LIGHTNING = LIGHTNING_MODULE + """
t = L.Trainer(accelerator=sys.argv[3], max_steps=6, default_root_dir=sys.argv[1], logger=False,
              enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
t.fit(M(), data)
print(f"device={t.strategy.root_device}", flush=True)
print(f"end_step={t.global_step} callbacks={[type(c).__name__ for c in t.callbacks]}", flush=True)
"""

# As Lightning's docs say to resume: a ModelCheckpoint with `save_last=True` saving every 2
# steps, and `fit(ckpt_path="last")` (argv[4] "last"), or the script's own explicit path to
# that callback's `last.ckpt` (argv[4] "explicit").
LIGHTNING_LAST = LIGHTNING_MODULE + """
from lightning.pytorch.callbacks import ModelCheckpoint
dirpath = os.path.join(sys.argv[1], "checkpoints")
t = L.Trainer(accelerator=sys.argv[3], max_steps=6, default_root_dir=sys.argv[1], logger=False,
              enable_progress_bar=False, enable_model_summary=False,
              callbacks=[ModelCheckpoint(dirpath=dirpath, save_last=True, every_n_train_steps=2)])
if sys.argv[4] == "last":
    ckpt_path = "last"
else:
    last = os.path.join(dirpath, "last.ckpt")
    ckpt_path = last if os.path.exists(last) else None
t.fit(M(), data, ckpt_path=ckpt_path)
print(f"end_step={t.global_step} callbacks={[type(c).__name__ for c in t.callbacks]}", flush=True)
"""

# A Trainer's model and data, after `import torch` and `from torch import nn`: the head of the
# HF scripts here and in tests/integrations/test_byos_hf_publish.py.
HF_MODEL = """
class M(nn.Module):
    def __init__(self):
        super().__init__(); self.net = nn.Linear(4, 1)
    def forward(self, x, labels):
        return {"loss": nn.functional.mse_loss(self.net(x), labels)}
class D(torch.utils.data.Dataset):
    def __len__(self): return 256
    def __getitem__(self, i): return {"x": torch.ones(4) * i / 256, "labels": torch.ones(1)}
"""

HF = """
import os, signal, sys, torch
from torch import nn
from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint
""" + HF_MODEL + """class Ask(TrainerCallback):
    def on_train_begin(self, args, state, control, **kw):
        print(f"start_step={state.global_step}", flush=True)
    def on_step_begin(self, args, state, control, **kw):
        if state.global_step == 2 and sys.argv[2] == "signal":
            os.kill(os.getpid(), signal.SIGUSR1)  # what bv's node agent sends
args = TrainingArguments(output_dir=sys.argv[1], max_steps=6, save_steps=1000, report_to=[],
                         use_cpu=sys.argv[3] == "cpu", disable_tqdm=True, per_device_train_batch_size=4)
# argv[5] "before": get_last_checkpoint() before the Trainer exists (HF's example scripts).
before = sys.argv[5:6] == ["before"]
early = get_last_checkpoint(sys.argv[1]) if before and os.path.isdir(sys.argv[1]) else None
t = Trainer(model=M(), args=args, train_dataset=D(), callbacks=[Ask()])
last = early if before else (get_last_checkpoint(sys.argv[1]) if os.path.isdir(sys.argv[1])
                             else None)
print(f"last={last and os.path.basename(last)}", flush=True)
# HF's two documented idioms: the path get_last_checkpoint() finds (its example scripts), or
# True (the Trainer looks for it in output_dir itself; it raises where there is none yet).
t.train(resume_from_checkpoint=(last is not None) if sys.argv[4] == "true" else last)
print(f"device={t.args.device}", flush=True)
print(f"end_step={t.state.global_step} callbacks="
      f"{[type(c).__name__ for c in t.callback_handler.callbacks]}", flush=True)
"""


# Accelerate as its docs show automatic checkpoint naming: `save_state()` into
# project_dir/checkpoints/checkpoint_<n>, `load_state()` of the newest at start; bv's one line
# turns the signal into Accelerate's trigger. argv[2]: the step the signal stops at (it comes
# during the one before), or "run".
ACCELERATE = """
import os, signal, sys, torch
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration
from torch import nn
from bluevela import runtime
class Steps:
    done = 0
    def state_dict(self): return {"done": self.done}
    def load_state_dict(self, state): self.done = state["done"]
acc = Accelerator(cpu=True, project_config=ProjectConfiguration(
    project_dir=sys.argv[1], automatic_checkpoint_naming=True))
model = nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
model, opt = acc.prepare(model, opt)
steps = Steps()
acc.register_for_checkpointing(steps)
if os.path.isdir(os.path.join(sys.argv[1], "checkpoints")):
    acc.load_state()
print(f"start_step={steps.done}", flush=True)
while steps.done < 6:
    loss = nn.functional.mse_loss(model(torch.randn(4, 4)), torch.randn(4, 1))
    acc.backward(loss); opt.step(); opt.zero_grad()
    steps.done += 1
    if runtime.checkpoint_requested(): acc.set_trigger()  # bv's one line
    if sys.argv[2] == str(steps.done + 1):  # once the line installed bv's handler
        os.kill(os.getpid(), signal.SIGUSR1)  # what bv's node agent sends
    if acc.check_trigger():
        acc.save_state()
        break
print(f"end_step={steps.done}", flush=True)
"""


def _run(code: str, out: Path, mode: str, env: dict[str, str], accel: str = "cpu",
         *extra: str) -> str:
    proc = subprocess.run([sys.executable, "-c", code, str(out), mode, accel, *extra], env=env,
                          cwd=out.parent, capture_output=True, text=True, timeout=240,
                          check=False)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text
    assert "Traceback" not in text, text
    return text


def rank_env(values: dict[str, str], nproc: int = 1) -> dict[str, str]:
    """What bv's node agent gives one of `nproc` local ranks: this environment without Slurm's,
    bv's and Lightning's variables, with `values` (RANK, WORLD_SIZE, ...)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "BV_", "PL_"))}
    base.pop("PYTHONPATH", None)  # bv as installed: its entry points are in its dist-info
    base.update(values)
    return training_env(base, ["torchrun", f"--nproc-per-node={nproc}", "x.py"])


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    return rank_env({**RANK, **extra})


def _need(module: str) -> None:
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed (pip install -e '.[frameworks]')")


# On a GPU (`pytest -m gpu` on a lent H100/H200): the same script on CUDA, the framework's
# checkpoint of CUDA tensors and its resume onto the GPU.
ACCELERATORS = ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)]


def _on(text: str, accel: str) -> None:
    """The script ran where it was asked to: on CUDA for "gpu"."""
    device = re.findall(r"^device=(\S+)$", text, re.M)
    assert device and all(d.startswith("cuda" if accel == "gpu" else "cpu") for d in device), (
        device, text)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("accel", ACCELERATORS)
def test_lightning_saves_at_the_signal_and_resumes_there(tmp_path: Path, accel: str) -> None:
    _need("lightning")
    root = tmp_path / "root"
    env = _env(tmp_path)
    first = _run(LIGHTNING, root, "signal", env, accel)
    _on(first, accel)
    assert re.search(r"^start_step=0$", first, re.M)
    stopped = re.search(r"^end_step=(\d+) callbacks=.*'BvCheckpoint'", first, re.M)
    assert stopped and stopped.group(1) == "3", first  # the step the signal came in
    assert sorted(p.name for p in root.iterdir()) == ["hpc_ckpt_1.ckpt"]
    second = _run(LIGHTNING, root, "run", env, accel)
    _on(second, accel)
    assert re.search(r"^start_step=3$", second, re.M), second  # Lightning's own HPC resume
    assert re.search(r"^end_step=6 ", second, re.M)
    # Off (BV_INTEGRATIONS=0): no callback, and the signal would be SIGUSR1's default.
    off = _run(LIGHTNING, tmp_path / "off", "run", _env(tmp_path, BV_INTEGRATIONS="0"), accel)
    assert "BvCheckpoint" not in off


def _global_step(path: Path) -> int:
    import torch

    return int(torch.load(path, map_location="cpu", weights_only=False)["global_step"])


@pytest.mark.timeout(600)
@pytest.mark.parametrize("resume", ["last", "explicit"])
def test_lightning_resume_from_last_finds_the_signal_checkpoint(tmp_path: Path,
                                                                 resume: str) -> None:
    """Lightning's documented resume, `ckpt_path="last"` (or the script's own path to
    ModelCheckpoint's `last.ckpt`), starts at the step bv's signal saved, not at the older
    `last.ckpt` of `every_n_train_steps` (issue 33: up to 24 steps lost per interruption)."""
    _need("lightning")
    root = tmp_path / "root"
    env = _env(tmp_path)
    first = _run(LIGHTNING_LAST, root, "signal", env, "cpu", resume)
    stopped = re.search(r"^end_step=(\d+) callbacks=.*'BvCheckpoint'", first, re.M)
    assert stopped and stopped.group(1) == "3", first  # the callback's own last.ckpt: step 2
    last = root / "checkpoints" / "last.ckpt"
    linked = last.is_symlink() and last.resolve() == root / "hpc_ckpt_1.ckpt"
    second = _run(LIGHTNING_LAST, root, "run", env, "cpu", resume)
    assert re.search(r"^start_step=3$", second, re.M), second  # 0 steps lost (before: 2)
    assert linked  # bv's save, written once
    assert re.search(r"^end_step=6 ", second, re.M), second
    # The resumed callback wrote its next last.ckpt in place of the link (the same name: its
    # state came with the checkpoint), never through it into bv's HPC file.
    assert not last.is_symlink() and _global_step(last) == 6
    assert _global_step(root / "hpc_ckpt_1.ckpt") == 3
    assert not list((root / "checkpoints").glob("last-v*")), list(root.rglob("*"))


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("accel", "resume"), [("cpu", "path"), ("cpu", "true"),
                                               pytest.param("gpu", "path", marks=pytest.mark.gpu)])
def test_hf_trainer_saves_at_the_signal_and_resumes_there(tmp_path: Path, accel: str,
                                                          resume: str) -> None:
    _need("transformers")
    out = tmp_path / "out"
    # As torchrun gives them: Accelerate (under the Trainer) joins a 1-rank group (gloo on a
    # CPU, NCCL on a GPU).
    env = _env(tmp_path, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    first = _run(HF, out, "signal", env, accel, resume)
    _on(first, accel)
    assert re.search(r"^start_step=0$", first, re.M)
    stopped = re.search(r"^end_step=(\d+) callbacks=.*'BvCheckpointCallback'", first, re.M)
    assert stopped and stopped.group(1) == "3", first
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint-")) == [
        "checkpoint-3"]
    second = _run(HF, out, "run", env, accel, resume)
    _on(second, accel)
    assert re.search(r"^start_step=3$", second, re.M), second  # get_last_checkpoint
    assert re.search(r"^end_step=6 ", second, re.M)


@pytest.mark.timeout(600)
def test_accelerate_automatic_naming_resumes_and_saves_again(tmp_path: Path) -> None:
    """Accelerate's automatic checkpoint naming across two of bv's signals: the resumed
    process's `save_state()` writes the next folder (on accelerate 1.15.0 without bv's wrap it
    raised "checkpoint_0 already exists": the second interruption lost everything since the
    first), and `load_state()` of the newest resumes at each signal's step."""
    _need("accelerate")
    project = tmp_path / "project"
    env = _env(tmp_path, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    starts, ends = [], []
    for mode in ("3", "5", "run"):
        text = _run(ACCELERATE, project, mode, env)
        starts += re.findall(r"^start_step=(\d+)$", text, re.M)
        ends += re.findall(r"^end_step=(\d+)$", text, re.M)
    assert (starts, ends) == (["0", "3", "5"], ["3", "5", "6"])
    assert sorted(p.name for p in (project / "checkpoints").iterdir()) == [
        "checkpoint_0", "checkpoint_1"]
