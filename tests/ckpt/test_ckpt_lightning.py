"""Lightning through the store (bluevela/ckpt/lightning.py): a Trainer with
`StoreCheckpointIO` saves its checkpoints into the store (a stub where Lightning expects the
file), and a new Trainer resumes from `ckpt_path` with the same weights and step; a stub naming
a step the store cannot read fails with that said."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest

from tests.ckpt_helpers import make_store, run_ranks

torch = pytest.importorskip("torch")
L = pytest.importorskip("lightning")


class _Model(L.LightningModule):  # type: ignore[name-defined]
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 2)

    def training_step(self, batch: Any, i: int) -> Any:
        return self.lin(batch[0]).pow(2).sum()

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=0.1)


def _trainer(root: Path, io: Any, steps: int) -> Any:
    from lightning.pytorch.callbacks import ModelCheckpoint

    return L.Trainer(max_steps=steps, default_root_dir=root, plugins=[io], logger=False,
                     enable_progress_bar=False, enable_model_summary=False,
                     callbacks=[ModelCheckpoint(dirpath=root / "ck", save_last=True,
                                                every_n_train_steps=2)])


def test_lightning_saves_into_the_store_and_resumes(tmp_path: Path) -> None:
    from bluevela.ckpt.lightning import StoreCheckpointIO

    torch.manual_seed(0)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(32, 4)),
                                       batch_size=4)

    def body(rank: int, coll: Any) -> Any:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            store = make_store(tmp_path, rank, coll)
            first = _Model()
            _trainer(tmp_path, StoreCheckpointIO(store), 6).fit(first, data)
            store.wait()
            last = tmp_path / "ck" / "last.ckpt"
            assert json.loads(last.read_text()) == {"bv-ckpt-stub": "t", "step": 6}
            ck = StoreCheckpointIO(store).load_checkpoint(last)
            assert ck["global_step"] == 6
            for k, v in first.state_dict().items():
                assert torch.equal(ck["state_dict"][k], v), k
            # A new Trainer resumes there: at max_steps already, it trains no further, and
            # its model holds the saved weights (a fresh one's differ).
            second = _Model()
            assert not torch.equal(second.lin.weight, first.lin.weight)
            trainer = _trainer(tmp_path, StoreCheckpointIO(store), 6)
            trainer.fit(second, data, ckpt_path=str(last))
            assert trainer.global_step == 6
            assert torch.equal(second.lin.weight, first.lin.weight)
            # A stub naming a step the store does not hold (keep=2 pruned step 2).
            old = tmp_path / "old.ckpt"
            old.write_text(json.dumps({"bv-ckpt-stub": "t", "step": 2}))
            with pytest.raises(FileNotFoundError, match="names step 2"):
                StoreCheckpointIO(store).load_checkpoint(old)
            store.close()
            return store.status

    status = run_ranks(1, body)[0]
    assert status[6]["local"] == "ok" and status[6]["shared"] == "not drained"
