"""Lightning, HF Trainer and Accelerate through the node-local checkpoint store on the REAL dev
cluster, several ranks and a spare (docs/checkpoints.md "Frameworks"): the plain scripts of
examples/byos/ with their own periodic saves, the tier turned on the way a site does it for a
host running several nodes (`BV_CKPT_LOCAL_DIR=<tmp>/local/%n`, `%n` each node's name).

One job per framework, 2 training nodes + 1 spare, 1 rank per node. Once a periodic save is
complete on the first node (its own shard, and its copy of the second node's: the partner
copy), the second node crashes with its disk (`devcluster crash`, its node-local directory
deleted). bv relaunches the step on the spare in the same allocation; there the framework's own
resume (Lightning's `fit(ckpt_path="last")`, HF's `get_last_checkpoint`, Accelerate's
`load_state()` of its automatic names) takes the store's newest complete step: the spare's rank from the first node
over the store's authenticated transfer, nothing of shared storage (nothing was drained before
the end: the drain is every 0th save, at bv's signal and at the end). The job then trains to
its end. (One process per framework, with bv's signal and a second run:
tests/integrations/test_ckpt_frameworks.py.)
"""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import hostlist
import pytest

from bluevela.launch.attempts import split_attempts
from tests.ckpt.test_ckpt_cluster import _output
from tests.conftest import REPO, DevCluster
from tests.integrations.test_byos_cluster import BANNER, _starts, _steps, tracebacks

pytestmark = [pytest.mark.cluster]
EXAMPLES = REPO / "examples" / "byos"
DEVCLUSTER = REPO / "slurm" / "devcluster"
STEPS = 24
STEP_S = 0.3
EVERY = 8  # the script's own periodic save (steps)


@dataclasses.dataclass(frozen=True)
class Tiered:
    module: str
    script: str
    args: tuple[str, ...]  # its directory option and its periodic save
    name: str  # the store's checkpoint name
    savers: frozenset[int]  # the ranks whose shard a save holds
    numbered: bool = False  # the store's step is the save's number (0, 1, ...), not the step

    def trained(self, store_step: int) -> int:
        """The training step a save of store step `store_step` was made at."""
        return (store_step + 1) * EVERY if self.numbered else store_step


FRAMEWORKS = {
    # Lightning saves on global rank 0 only; every rank resumes from rank 0's shard.
    "lightning": Tiered("lightning", "lightning_ddp.py", ("--root", "{d}", "--every", str(EVERY)),
                        "lightning", frozenset({0})),
    "hf": Tiered("transformers", "hf_trainer.py", ("--out", "{d}", "--save-steps", str(EVERY)),
                 "hf", frozenset({0, 1})),
    "accelerate": Tiered("accelerate", "accelerate_loop.py",
                         ("--dir", "{d}", "--every", str(EVERY), "--auto-naming"),
                         "accelerate", frozenset({0, 1}), numbered=True),
}


def _held(local: Path, node: str, name: str) -> dict[int, set[int]]:
    """step -> the ranks whose complete shard lies on `node` (own or a partner's copy)."""
    out: dict[int, set[int]] = {}
    for p in local.glob(f"{node}/bv-*/job-*/{name}/*/step-*/rank-*.bvck"):
        step = int(p.parent.name.split("-")[1])
        out.setdefault(step, set()).add(int(p.stem.split("-")[1]))
    return out


@pytest.mark.timeout(600)
@pytest.mark.parametrize("framework", list(FRAMEWORKS))
def test_framework_resumes_on_the_spare_from_the_partners_copy(
        devcluster: DevCluster, tmp_path: Path, framework: str) -> None:
    fw = FRAMEWORKS[framework]
    if importlib.util.find_spec(fw.module) is None:
        pytest.skip(f"{fw.module} is not installed (pip install -e '.[frameworks]')")
    devcluster.resume_all()
    devcluster.wait_idle(timeout=120)
    state, local = tmp_path / "state", tmp_path / "local"
    args = [a.replace("{d}", str(state)) for a in fw.args]
    out = tmp_path / "submit.out"
    with out.open("wb") as stdout:
        proc = subprocess.Popen(
            [sys.executable, "-m", "bluevela", "submit", "--wait", "-N", "2",
             "--spare-nodes", "1", "--procs-per-node", "1", "-t", "10",
             str(EXAMPLES / fw.script), *args, "--steps", str(STEPS), "--step-s", str(STEP_S)],
            stdout=stdout, stderr=subprocess.STDOUT, cwd=tmp_path,
            env=devcluster.environ(BV_CKPT_LOCAL_DIR=str(local / "%n")))
    crashed: str | None = None
    saved = 0
    try:
        deadline = time.monotonic() + 300
        while True:
            first = BANNER.search(_output(tmp_path))
            if first is not None:
                kept, crashed = hostlist.expand_hostlist(first.group(3))[:2]
                complete = [s for s, ranks in _held(local, kept, fw.name).items()
                            if fw.savers <= ranks]
                if complete:
                    saved = max(complete)
                    break
            assert proc.poll() is None and time.monotonic() < deadline, (
                "no save complete on the first node", _output(tmp_path),
                sorted(p.relative_to(tmp_path) for p in local.rglob("*.bvck")))
            time.sleep(0.2)
        # Nothing drained yet: the spare's shard can only come from the first node.
        assert not list((state / "bv-ckpt").glob(f"{fw.name}/step-*")), list(state.rglob("*"))
        devcluster.run([sys.executable, str(DEVCLUSTER), "crash", crashed])
        shutil.rmtree(local / crashed, ignore_errors=True)  # the node's disk goes with it
        proc.wait(timeout=420)
    finally:
        if proc.poll() is None:
            proc.kill()
        if crashed is not None:
            devcluster.run([sys.executable, str(DEVCLUSTER), "revive", crashed], check=False)
    text = _output(tmp_path)
    assert proc.returncode == 0, (out.read_text(errors="replace"), text)
    banners = BANNER.findall(text)
    assert [b[0] for b in banners] == ["1", "2"], text
    assert f"{crashed} lost" in banners[1][3] and "(spare " in banners[1][3], banners[1]
    second = split_attempts(text)[1].text
    # The relaunched step resumed the store's newest complete step (the one seen complete
    # before the crash, or a later one completed meanwhile): the framework's own start step.
    summary = re.search(r"^bv ckpt: resumed step (\d+) .*$", second, re.M)
    assert summary is not None, second
    step = int(summary.group(1))
    assert step >= saved and fw.trained(step) % EVERY == 0, (step, saved, summary.group(0))
    starts = _starts(second)
    assert {int(s["start_step"]) for s in starts.values()} == {fw.trained(step)}, (starts, step)
    # The rank on the spare took its shard from the first node (Lightning: rank 0's, which
    # every rank reads; the others: the crashed rank's partner copy); none from shared storage.
    assert "partner (" in summary.group(0) and "shared" not in summary.group(0), summary.group(0)
    assert summary.group(0).endswith("nothing skipped"), summary.group(0)
    assert _steps(second)[-1] == STEPS and f"done step={STEPS}" in second, second
    assert not tracebacks(second), tracebacks(second)
