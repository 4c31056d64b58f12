"""Lightning, HF Trainer and Accelerate through the checkpoint store when the node-local tier is on
(bluevela/ckpt/lightning.py and folder.py, the integrations in bluevela/integrations/;
docs/checkpoints.md "Frameworks"): the same unchanged scripts as tests/integrations/test_byos_frameworks.py,
a real rank's environment with ``BV_CKPT_LOCAL_DIR`` (what a site's node class
`checkpoint.dir` gives), a real SIGUSR1 mid-training, the framework's own resume in the next
run. No cluster: one process (the partner copy and the spare are tests/ckpt/test_ckpt_cluster.py's)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from bluevela.launch.agent import free_port
from tests.integrations.test_byos_frameworks import ACCELERATE, HF, LIGHTNING, _env, _need, _run


def _shards(root: Path, name: str) -> list[str]:
    return sorted(p.parent.name for p in root.glob(f"**/{name}/**/rank-00000.bvck"))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("look", ["after", "before"])
def test_hf_trainer_saves_to_the_node_local_tier_and_resumes_from_it(tmp_path: Path,
                                                                     look: str) -> None:
    """`look`: the script calls get_last_checkpoint(output_dir) after the Trainer exists, or
    before it (HF's example scripts: right after the TrainingArguments, which open the store)."""
    _need("transformers")
    out, local = tmp_path / "out", tmp_path / "local"
    env = _env(tmp_path, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               BV_CKPT_LOCAL_DIR=str(local))
    first = _run(HF, out, "signal", env, "cpu", "path")
    assert re.search(r"^end_step=3 callbacks=.*'BvCheckpointCallback'", first, re.M), first
    # HF wrote its folder on this node's tier, not in output_dir: the store holds it there
    # and drained it at bv's signal.
    assert not any(p.name.startswith("checkpoint-") for p in out.iterdir()), list(out.iterdir())
    assert _shards(local, "hf") == ["step-00000003"], list(local.rglob("*"))
    assert _shards(out / "bv-ckpt", "hf") == ["step-00000003"]
    second = _run(HF, out, "run", env, "cpu", "path", look)
    # get_last_checkpoint(output_dir), before or after the Trainer exists, found the store's
    # step (without the early store, "before" found nothing: last=None, start_step=0).
    assert re.search(r"^last=checkpoint-3$", second, re.M), second
    assert re.search(r"^start_step=3$", second, re.M), second
    assert second.count("bv: checkpoint-3 from the checkpoint store") == 1, second
    assert re.search(r"^end_step=6 ", second, re.M), second
    assert "bv: checkpoint-3 from the checkpoint store" in second, second
    link = out / "checkpoint-3"
    assert link.is_symlink() and local in link.resolve().parents, link.resolve()
    assert (link / "trainer_state.json").is_file() and (link / "rng_state.pth").is_file()
    # train() returned: the newest (step 6) drained, where a new allocation (the node-local
    # tier gone) resumes from (the store's fallback: tests/ckpt/test_ckpt_store.py).
    assert _shards(out / "bv-ckpt", "hf") == ["step-00000003", "step-00000006"]
    # (Without the tier HF's own folders stay in output_dir: tests/integrations/test_byos_frameworks.py.)


@pytest.mark.timeout(600)
def test_accelerate_saves_to_the_node_local_tier_and_resumes_from_it(tmp_path: Path) -> None:
    _need("accelerate")
    project, local = tmp_path / "project", tmp_path / "local"
    env = _env(tmp_path, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               BV_CKPT_LOCAL_DIR=str(local))
    first = _run(ACCELERATE, project, "3", env)
    assert re.search(r"^end_step=3$", first, re.M), first
    # The save went to the store (node-local, drained at the signal), not to project_dir.
    assert not (project / "checkpoints").exists() or \
        not list((project / "checkpoints").iterdir())
    assert _shards(local, "accelerate") == ["step-00000000"]
    assert _shards(project / "bv-ckpt", "accelerate") == ["step-00000000"]
    # The next run's load_state() found it through a link to this node's copy, and its own
    # save (the next automatic number) went to the store too.
    second = _run(ACCELERATE, project, "5", env)
    assert re.search(r"^start_step=3$", second, re.M), second
    assert re.search(r"^end_step=5$", second, re.M), second
    (link,) = (project / "checkpoints").iterdir()
    assert link.name == "checkpoint_0" and link.is_symlink(), link
    assert os.fspath(local) in os.readlink(link)
    assert _shards(project / "bv-ckpt", "accelerate") == ["step-00000000", "step-00000001"]


@pytest.mark.timeout(600)
def test_lightning_takes_the_store_with_the_script_unchanged(tmp_path: Path) -> None:
    """A plain Lightning script (no plugin named): bv's callback gives the strategy
    StoreCheckpointIO, so bv's HPC save at the signal is a stub where Lightning expects the
    file and a shard in the store (drained at the signal), and Lightning's own resume of
    that file reads it back through the store."""
    _need("lightning")
    root, local = tmp_path / "root", tmp_path / "local"
    env = _env(tmp_path, BV_CKPT_LOCAL_DIR=str(local))
    first = _run(LIGHTNING, root, "signal", env)
    assert re.search(r"^end_step=3 callbacks=.*'BvCheckpoint'", first, re.M), first
    stub = json.loads((root / "hpc_ckpt_1.ckpt").read_bytes())
    assert stub == {"bv-ckpt-stub": "lightning", "step": 3}, stub
    assert _shards(local, "lightning") == ["step-00000003"]
    assert _shards(root / "bv-ckpt", "lightning") == ["step-00000003"]
    second = _run(LIGHTNING, root, "run", env)
    assert re.search(r"^start_step=3$", second, re.M), second  # Lightning's HPC resume
    assert "bv ckpt: resumed step 3" in second and "local (own copy on this node) x1" in second
    assert re.search(r"^end_step=6 ", second, re.M), second
