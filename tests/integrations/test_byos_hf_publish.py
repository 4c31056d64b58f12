"""A Hugging Face Trainer save that is cut short is never the one HF's resume loads.

HF writes ``checkpoint-N`` in place and ``get_last_checkpoint`` takes the highest such folder
whatever it holds. bv's integration (bluevela/integrations/hf.py) has each save written in a
staging folder and published by a rename once every rank wrote its part. Here the cut is real:
a rank SIGKILLs itself in the middle of HF's own save (after the model and optimizer, before
its RNG state and the trainer state), in a fresh interpreter with bv's start-up hook, as in a
rank whose node died mid-save (the CI failure of stop 39: a survivor's lone save after its
peer was lost became the newest checkpoint). Without the cluster; skipped where transformers
is not installed.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bluevela.bench.dist import free_port
from bluevela.integrations.publish import STAGING
from tests.integrations.test_byos_frameworks import HF_MODEL, rank_env

pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                reason="transformers is not installed "
                                       "(pip install -e '.[frameworks]')")

# Saves every 2 steps, 6 steps. argv: output_dir, the rank that dies ("-": none), the step at
# whose save it dies.
SCRIPT = """
import os, signal, sys, torch
from torch import nn
import transformers.trainer as T
from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint
out, who, at = sys.argv[1], sys.argv[2], int(sys.argv[3])
rng = T.Trainer._save_rng_state
def dying(self, folder):
    if str(self.args.process_index) == who and self.state.global_step == at:
        os.kill(os.getpid(), signal.SIGKILL)  # mid-save: model and optimizer written
    return rng(self, folder)
T.Trainer._save_rng_state = dying
""" + HF_MODEL + """class Say(TrainerCallback):
    def on_train_begin(self, args, state, control, **kw):
        print(f"rank={args.process_index} start_step={state.global_step}", flush=True)
args = TrainingArguments(output_dir=out, max_steps=6, save_steps=2, report_to=[], use_cpu=True,
                         ddp_backend="gloo", ddp_timeout=60, disable_tqdm=True,
                         per_device_train_batch_size=4, dataloader_num_workers=0)
t = Trainer(model=M(), args=args, train_dataset=D(), callbacks=[Say()])
last = get_last_checkpoint(out) if os.path.isdir(out) else None
t.train(resume_from_checkpoint=last)
print(f"rank={args.process_index} end_step={t.state.global_step}", flush=True)
"""


def _env(rank: int, world: int, port: int) -> dict[str, str]:
    return rank_env({"RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0",
                     "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world),
                     "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "SLURM_JOB_ID": "7",
                     "BV_STEP_NODELIST": "node1", "BV_STEP_NUM_NODES": "1"}, world)


def _ranks(out: Path, world: int, who: str, at: int) -> list[tuple[int, str]]:
    """Run the script on `world` ranks: each rank's exit status and output."""
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-c", SCRIPT, str(out), who, str(at)],
                              env=_env(rank, world, port), cwd=out.parent,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank in range(world)]
    try:
        texts = [p.communicate(timeout=240)[0] for p in procs]
        return [(p.returncode, text) for p, text in zip(procs, texts, strict=True)]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def _checkpoints(out: Path) -> list[str]:
    return sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint-"))


@pytest.mark.timeout(600)
def test_a_save_killed_midway_is_not_resumed_from(tmp_path: Path) -> None:
    out = tmp_path / "out"
    # One rank, killed in its save of step 4: checkpoint-2 stays the newest.
    [(rc, text)] = _ranks(out, 1, "0", 4)
    assert rc == -9 and "start_step=0" in text, text
    assert _checkpoints(out) == ["checkpoint-2"], (sorted(os.listdir(out)), text)
    # The next run resumes there (not from a folder without trainer_state.json: HF's resume
    # failed there, every time), saves 4 and 6 whole, and leaves no staging folder behind.
    [(rc, text)] = _ranks(out, 1, "-", 0)
    assert rc == 0 and "rank=0 start_step=2" in text and "rank=0 end_step=6" in text, text
    assert _checkpoints(out) == ["checkpoint-2", "checkpoint-4", "checkpoint-6"], text
    assert not (out / STAGING).exists()
    assert (out / "checkpoint-4" / "trainer_state.json").is_file()


@pytest.mark.timeout(600)
def test_a_peer_lost_during_the_save_leaves_the_older_checkpoint_the_newest(
        tmp_path: Path) -> None:
    out = tmp_path / "out"
    # Two ranks (gloo); rank 1 dies in the save of step 4 after rank 0 wrote its whole part
    # (model, optimizer, RNG, trainer state): rank 0 alone does not publish it.
    results = _ranks(out, 2, "1", 4)
    assert results[1][0] == -9, results
    assert results[0][0] != 0, results  # its barrier found the peer gone
    assert _checkpoints(out) == ["checkpoint-2"], (sorted(os.listdir(out)), results)
    assert {"rng_state_0.pth", "rng_state_1.pth", "trainer_state.json"} <= set(
        os.listdir(out / "checkpoint-2"))


# Accelerate as its docs show automatic checkpoint naming (total_limit 2), a save every 2 of 6
# steps. argv: project_dir, the step at whose save the process dies (0: none).
ACCELERATE = """
import os, signal, sys, torch
import accelerate.accelerator as A
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration
from torch import nn
out, at = sys.argv[1], int(sys.argv[2])
custom = A.save_custom_state
def dying(obj, path, *args, **kwargs):
    if obj.done == at:
        os.kill(os.getpid(), signal.SIGKILL)  # mid-save: model, optimizer, RNG written
    return custom(obj, path, *args, **kwargs)
A.save_custom_state = dying
class Steps:
    done = 0
    def state_dict(self): return {"done": self.done}
    def load_state_dict(self, state): self.done = state["done"]
acc = Accelerator(cpu=True, project_config=ProjectConfiguration(
    project_dir=out, automatic_checkpoint_naming=True, total_limit=2))
model = nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
model, opt = acc.prepare(model, opt)
steps = Steps()
acc.register_for_checkpointing(steps)
if os.path.isdir(os.path.join(out, "checkpoints")):
    acc.load_state()
print(f"start_step={steps.done}", flush=True)
while steps.done < 6:
    loss = nn.functional.mse_loss(model(torch.randn(4, 4)), torch.randn(4, 1))
    acc.backward(loss); opt.step(); opt.zero_grad()
    steps.done += 1
    if steps.done % 2 == 0:
        acc.save_state()
print(f"end_step={steps.done}", flush=True)
"""


@pytest.mark.timeout(600)
@pytest.mark.skipif(importlib.util.find_spec("accelerate") is None,
                    reason="accelerate is not installed (pip install -e '.[frameworks]')")
def test_an_accelerate_save_killed_midway_is_not_loaded(tmp_path: Path) -> None:
    out = tmp_path / "out"

    def run(at: int) -> tuple[int, str]:
        proc = subprocess.run([sys.executable, "-c", ACCELERATE, str(out), str(at)],
                              env=_env(0, 1, free_port()), cwd=tmp_path, capture_output=True,
                              text=True, timeout=240, check=False)
        return proc.returncode, proc.stdout + proc.stderr

    rc, text = run(4)  # killed in the save of step 4 (checkpoint_1)
    assert rc == -9, text
    assert sorted(os.listdir(out / "checkpoints")) == ["checkpoint_0"], text
    # The resume loads step 2 (not a folder without its custom state: Accelerate's load_state
    # fails there on every attempt), saves 4 and 6 whole; total_limit keeps the last two.
    rc, text = run(0)
    assert rc == 0 and "start_step=2" in text and "end_step=6" in text, text
    assert sorted(os.listdir(out / "checkpoints")) == ["checkpoint_1", "checkpoint_2"], text
    assert not (out / STAGING).exists()


def test_accelerate_total_limit_counts_as_accelerate_does() -> None:
    """After the publish, the older checkpoints removed are those Accelerate's own
    `save_state()` removes before a save (``len(older) + 1 - total_limit``, lowest first): the
    one just saved is always kept, `total_limit` 0 or 1 included."""
    from bluevela.integrations.accelerate import to_rotate

    assert to_rotate([0, 1, 2, 3], 3, 2) == [0, 1]
    assert to_rotate([3, 1, 0, 2], 3, 1) == [0, 1, 2]
    assert to_rotate([0, 1, 2, 3], 3, 0) == [0, 1, 2]
    assert to_rotate([0, 1, 2, 3], 3, 4) == []
    assert to_rotate([0, 1, 2, 3], 3, 9) == []
    assert to_rotate([3], 3, 1) == []
