"""The overlay form of the health fixtures (tests/fixture_trees.py): a fixture written as an
overlay on its base materializes to the same tree, removals, additions, type changes, modes,
symlinks and a non-default BASE included; the cache is shared and built once per content.
(That the committed set materializes to make_fixtures.py's full trees is
test_health_evaluators.py::test_fixtures_are_what_make_fixtures_builds.)"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests import fixture_trees as ft

REPO = Path(__file__).resolve().parent.parent


def _tree(top: Path) -> dict[str, tuple[str, int, bytes]]:
    return {rel: (kind, 0 if kind == "d" else mode, data)
            for rel, (kind, mode, data) in ft.entries(top).items()}


def _write(path: Path, text: str, mode: int = 0o644) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(mode)


def _full_set(top: Path) -> list[str]:
    """Full trees: a base, a variant of it with every kind of change, a second base (an
    "h200") and a fixture derived from that one."""
    base = top / "h100-healthy"
    _write(base / "ABOUT", "base\n")
    _write(base / "root/proc/modules", "nvidia_peermem 1\nnvidia 2\n")
    _write(base / "root/proc/1644/stat", "1644 (nv-fabricmanage) S\n")
    _write(base / "root/proc/1644/comm", "nv-fabricmanage\n")
    _write(base / "root/sys/x/rate", "400\n")
    _write(base / "root/sys/x/state", "4: ACTIVE\n")
    _write(base / "root/usr/bin/tool", "#!/bin/sh\n", 0o755)
    _write(base / "root/dev/nvidiactl", "")
    (base / "root/sys/link").symlink_to("x/rate")
    _write(base / "root/etc/conf", "a file that becomes a directory\n")

    var = top / "h100-variant"
    _write(var / "ABOUT", "every change\n")
    _write(var / "state/ib_counters.json", "{}\n")
    _write(var / "root/proc/modules", "nvidia 2\n")  # changed
    _write(var / "root/sys/x/rate", "400\n")
    _write(var / "root/sys/x/state", "4: ACTIVE\n", 0o600)  # same bytes, other mode
    _write(var / "root/usr/bin/tool", "#!/bin/sh\n", 0o644)  # lost its exec bit
    _write(var / "root/dev/nvidiactl", "")
    (var / "root/sys/link").symlink_to("x/state")  # retargeted
    (var / "root/sys/newlink").symlink_to("../proc")  # new symlink to a directory
    _write(var / "root/proc/61234/stat", "61234 (python3) D\n")  # added directory
    _write(var / "root/etc/conf/inner", "now a directory\n")  # a file replaced by a directory
    # proc/1644 removed

    same = top / "h100-same"
    _write(same / "ABOUT", "root equal to the base's\n")
    shutil.copytree(base / "root", same / "root", symlinks=True)

    h200 = top / "h200-healthy"
    _write(h200 / "ABOUT", "another base\n")
    _write(h200 / "root/proc/modules", "nvidia 3\n")
    d200 = top / "h200-ib-down"
    _write(d200 / "ABOUT", "on h200\n")
    _write(d200 / "root/proc/modules", "nvidia 3\n")
    _write(d200 / "root/sys/state", "1: DOWN\n")
    return ["h100-healthy", "h100-variant", "h100-same", "h200-healthy", "h200-ib-down"]


def test_overlay_round_trip_keeps_every_change(tmp_path: Path) -> None:
    names = _full_set(tmp_path / "full")
    committed = tmp_path / "committed"
    ft.write_overlays(tmp_path / "full", committed, names,
                      bases={"h200-healthy": "h200-healthy", "h200-ib-down": "h200-healthy"})
    _write(committed / "nvml-real.json", "{}\n")  # a top-level file goes along as is
    var = committed / "h100-variant"
    assert not (var / "root").exists()
    assert (var / ft.REMOVED).read_text() == "etc/conf\nproc/1644\n"
    assert sorted(p.relative_to(var / ft.OVERLAY).as_posix()
                  for p in (var / ft.OVERLAY).rglob("*")) == [
        "etc", "etc/conf", "etc/conf/inner", "proc", "proc/61234", "proc/61234/stat",
        "proc/modules", "sys", "sys/link", "sys/newlink", "sys/x", "sys/x/state", "usr",
        "usr/bin", "usr/bin/tool"]
    assert sorted(p.name for p in (committed / "h100-same").iterdir()) == ["ABOUT"]
    assert (committed / "h200-ib-down" / ft.BASE).read_text() == "h200-healthy\n"
    assert not (committed / "h100-variant" / ft.BASE).exists()

    ft.materialize(committed, tmp_path / "out")
    for name in names:
        assert _tree(tmp_path / "out" / name) == _tree(tmp_path / "full" / name), name
    assert (tmp_path / "out" / "nvml-real.json").read_text() == "{}\n"
    assert os.readlink(tmp_path / "out/h100-variant/root/sys/link") == "x/state"


@pytest.mark.parametrize("line", ["../../etc/passwd", "/etc/passwd", "proc/../../x"])
def test_a_removed_path_outside_the_root_is_refused(tmp_path: Path, line: str) -> None:
    names = _full_set(tmp_path / "full")
    ft.write_overlays(tmp_path / "full", tmp_path / "committed", names[:2])
    (tmp_path / "committed/h100-variant" / ft.REMOVED).write_text(line + "\n")
    with pytest.raises(ft.FixtureError, match="bad path"):
        ft.materialize(tmp_path / "committed", tmp_path / "out")


def test_a_missing_base_is_an_error(tmp_path: Path) -> None:
    names = _full_set(tmp_path / "full")
    ft.write_overlays(tmp_path / "full", tmp_path / "committed", names[:2])
    (tmp_path / "committed/h100-variant" / ft.BASE).write_text("h300-healthy\n")
    with pytest.raises(ft.FixtureError, match="h300-healthy"):
        ft.materialize(tmp_path / "committed", tmp_path / "out")


def test_materialized_is_built_once_per_content_and_shared(tmp_path: Path) -> None:
    names = _full_set(tmp_path / "full")
    committed = tmp_path / "committed"
    ft.write_overlays(tmp_path / "full", committed, names[:3])
    env = dict(os.environ, TMPDIR=str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    code = ("import sys; from pathlib import Path; from tests.fixture_trees import materialized;"
            f"print(materialized(Path({str(committed)!r})))")
    # Four processes at once: one tree, no temporary directory left behind.
    procs = [subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=env,
                              stdout=subprocess.PIPE, text=True) for _ in range(4)]
    outs = {p.communicate(timeout=60)[0].strip() for p in procs}
    assert all(p.returncode == 0 for p in procs)
    assert len(outs) == 1
    (out,) = outs
    assert Path(out).name == f"bv-fixtures-{ft.content_digest(committed)}"
    assert [p.name for p in (tmp_path / "tmp").iterdir()] == [Path(out).name]
    assert _tree(Path(out) / "h100-variant") == _tree(tmp_path / "full" / "h100-variant")
    # Another content, another tree; the first one is reused as it is.
    (committed / "h100-variant" / "ABOUT").write_text("changed\n")
    again = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, check=True,
                           capture_output=True, text=True).stdout.strip()
    assert again != out and (Path(again) / "h100-variant" / "ABOUT").read_text() == "changed\n"


def test_a_cache_dir_writable_by_others_is_not_trusted(tmp_path: Path) -> None:
    names = _full_set(tmp_path / "full")
    committed = tmp_path / "committed"
    ft.write_overlays(tmp_path / "full", committed, names[:2])
    (tmp_path / "tmp").mkdir()
    planted = tmp_path / "tmp" / f"bv-fixtures-{ft.content_digest(committed)}"
    planted.mkdir()
    (planted / "h100-variant").mkdir()
    planted.chmod(0o777)
    code = ("from pathlib import Path; from tests.fixture_trees import materialized;"
            f"print(materialized(Path({str(committed)!r})))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, text=True,
                         capture_output=True, env=dict(os.environ, TMPDIR=str(tmp_path / "tmp"))
                         ).stdout.strip()
    assert Path(out) != planted and (Path(out) / "h100-variant" / "root").is_dir()
    assert [p.name for p in planted.iterdir()] == ["h100-variant"]
    assert list((planted / "h100-variant").iterdir()) == []
