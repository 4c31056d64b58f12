"""bv's integrations in a rank forked by a warm parent (launch/warm.py): a framework the parent
pre-imported (BV_WARM_PREIMPORT) is in sys.modules before `boot.start()`, so the import hook
never sees it; start() gives it its hook at once."""

from __future__ import annotations

import subprocess
import sys
import types

import pytest

from bluevela.integrations import boot

LIGHTNING_FIRST = """
import signal
import lightning.pytorch
assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL
from bluevela.integrations import boot
boot.start()
handler = signal.getsignal(signal.SIGUSR1)
print(handler.__module__, handler.__name__)
"""


def test_lightning_imported_before_the_start_gets_bvs_checkpoint_signal() -> None:
    pytest.importorskip("lightning")
    proc = subprocess.run([sys.executable, "-c", LIGHTNING_FIRST], capture_output=True,
                          text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["bluevela.runtime.checkpoint", "_handler"], proc.stdout


def test_each_hook_runs_once_now_or_at_its_import(monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    ran: list[str] = []

    def broken(_: types.ModuleType) -> None:
        raise RuntimeError("the framework changed")

    early = types.ModuleType("bv_test_early")
    monkeypatch.setitem(sys.modules, "bv_test_early", early)
    monkeypatch.setitem(sys.modules, "bv_test_broken", types.ModuleType("bv_test_broken"))
    monkeypatch.setattr(boot, "HOOKS", {"bv_test_early": lambda m: ran.append(m.__name__),
                                        "bv_test_broken": broken,
                                        "bv_test_not_imported": lambda m: ran.append("late")})
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    monkeypatch.setattr(boot.os, "environ", {})
    boot.start()
    assert ran == ["bv_test_early"]
    assert "bv: integration for bv_test_broken off (RuntimeError: the framework changed)" \
        in capsys.readouterr().err
    finder = sys.meta_path[0]
    assert isinstance(finder, boot.AfterImport)
    assert list(finder.hooks) == ["bv_test_not_imported"]
