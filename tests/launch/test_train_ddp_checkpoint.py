"""examples/train_ddp.py saves its checkpoint without writing through a planted link (issue 16 §4).

The example once wrote `<ckpt_dir>/.ckpt.pt.tmp.<pid>` with open(..., "wb"): in a checkpoint
directory others can write (a shared project dir), a symlink planted at that name made the save
overwrite whatever it pointed at. The save and load run for real (torch on CPU) in a child
process whose pid the test plants names for.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytest.importorskip("torch")

# Imports the example as a module (its main() is not run), saves twice, loads once.
CHILD = """
import importlib.util, os, sys, time
from pathlib import Path
ready, go = sys.argv[1], sys.argv[2]
ckpt = Path(sys.argv[3])
spec = importlib.util.spec_from_file_location("train_ddp", sys.argv[4])
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
import torch
from torch import nn
model = nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
Path(ready).write_text(str(os.getpid()))
while not Path(go).exists():
    time.sleep(0.01)
mod._save(ckpt, model, opt, 7)
mod._save(ckpt, model, opt, 9)
model2 = nn.Linear(4, 1)
opt2 = torch.optim.SGD(model2.parameters(), lr=0.1)
print("step", mod._load(ckpt, model2, opt2))
print("same", bool(torch.equal(model.weight, model2.weight)))
"""


def test_a_symlink_planted_at_the_temporary_name_is_not_written_through(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    victim = tmp_path / "victim"
    victim.write_text("someone else's file\n")
    ready, go = tmp_path / "ready", tmp_path / "go"
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(ready), str(go), str(ckpt),
                              str(REPO / "examples" / "train_ddp.py")],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(600):
            if ready.exists() and ready.read_text():
                break
            if child.poll() is not None:
                break
            time.sleep(0.1)
        pid = int(ready.read_text())
        # The names a writer with this pid would use (the old one and a few like it).
        planted = [f".ckpt.pt.tmp.{pid}", f".ckpt.pt.{pid}.tmp", "ckpt.pt.tmp"]
        for name in planted:
            (ckpt / name).symlink_to(victim)
        go.write_text("")
        out, err = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == 0, err[-2000:]
    assert victim.read_bytes() == b"someone else's file\n"  # 6c9e5ca: overwritten by torch.save
    assert "step 9" in out and "same True" in out, out
    assert sorted(os.listdir(ckpt)) == sorted(planted + ["ckpt.pt"])  # no temporary left
    assert not (ckpt / "ckpt.pt").is_symlink()


def test_a_symlink_planted_at_ckpt_pt_is_not_loaded(tmp_path: Path) -> None:
    """The next attempt loads `ckpt.pt` without following a link to another file."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    other = tmp_path / "other.pt"
    code = (
        "import importlib.util, sys\n"
        "spec = importlib.util.spec_from_file_location('t', sys.argv[1])\n"
        "mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)\n"
        "import torch\nfrom pathlib import Path\n"
        "m = torch.nn.Linear(4, 1); o = torch.optim.SGD(m.parameters(), lr=0.1)\n"
        "torch.save({'model': m.state_dict(), 'opt': o.state_dict(), 'step': 5}, sys.argv[2])\n"
        "(Path(sys.argv[3]) / 'ckpt.pt').symlink_to(sys.argv[2])\n"
        "try:\n    print('loaded', mod._load(Path(sys.argv[3]), m, o))\n"
        "except OSError as e:\n    print('refused', e.errno)\n")
    p = subprocess.run([sys.executable, "-c", code, str(REPO / "examples" / "train_ddp.py"),
                        str(other), str(ckpt)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.strip() == "refused 40", p.stdout  # ELOOP; 6c9e5ca: "loaded 5"
