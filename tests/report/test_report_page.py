"""The pages' one writer: atomic, and a symlink planted at the temporary name or at the target
is replaced, never followed (issue 16 §4: `bv report fleet --html` wrote through a symlink at
its predictable temporary name `.NAME.PID.tmp`). Real files, real symlinks."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bluevela.report.fleet import compute
from bluevela.report.fleet_gather import gather
from tests.report.test_report_fleet import CLASSES, NOW, T0, fleet  # noqa: F401 (fixture)


def _plant(tmp_path: Path, out: Path) -> tuple[Path, Path]:
    """Two victim files, and symlinks to them at `out`'s temporary name (this process's pid,
    as the writer names it) and at `out` itself."""
    victims = tmp_path / "victims"
    victims.mkdir()
    v_tmp, v_out = victims / "via-tmp", victims / "via-target"
    v_tmp.write_text("precious 1\n")
    v_out.write_text("precious 2\n")
    (out.parent / f".{out.name}.{os.getpid()}.tmp").symlink_to(v_tmp)
    out.symlink_to(v_out)
    return v_tmp, v_out


def _check(out: Path, v_tmp: Path, v_out: Path, marker: str) -> None:
    assert v_tmp.read_text() == "precious 1\n", "wrote through the symlink at the temp name"
    assert v_out.read_text() == "precious 2\n", "wrote through the symlink at the target"
    assert not out.is_symlink() and marker in out.read_text()
    assert not (out.parent / f".{out.name}.{os.getpid()}.tmp").exists()


def test_fleet_page_follows_no_planted_symlink(fleet: Path, tmp_path: Path) -> None:  # noqa: F811
    from bluevela.report.fleet_html import write_html

    rep = compute(gather(fleet, T0, NOW), since=T0, now=NOW, classes=CLASSES)
    pages = tmp_path / "pages"
    pages.mkdir()
    out = pages / "fleet.html"
    v_tmp, v_out = _plant(tmp_path, out)
    write_html(rep, out)
    _check(out, v_tmp, v_out, "Fleet reliability report")


def test_page_writer_follows_no_planted_symlink(tmp_path: Path) -> None:
    from bluevela.report.page import document, write_page

    pages = tmp_path / "pages"
    pages.mkdir()
    out = pages / "p.html"
    v_tmp, v_out = _plant(tmp_path, out)
    write_page(out, document("t <&>", ["<p>body</p>"]))
    _check(out, v_tmp, v_out, "<title>t &lt;&amp;&gt;</title>")


def test_page_writer_error_is_one_line(tmp_path: Path) -> None:
    from bluevela.report.page import ReportError, write_page

    with pytest.raises(ReportError, match=r"^cannot write .*missing/p\.html: No such file"):
        write_page(tmp_path / "missing" / "p.html", "x")


def test_formatters() -> None:
    from bluevela.report.page import esc, fmt_duration, fmt_num

    assert [fmt_num(x) for x in (512.04, 1234.5, 0.0123, float("nan"), None)] == \
        ["512", "1234", "0.0123", "–", "–"]
    assert fmt_num(1234.56, 1, " W") == "1,234.6 W" and fmt_num(float("inf"), 1) == "–"
    assert [fmt_duration(x) for x in (12, 420, 12600, None)] == ["12 s", "7 min", "3.5 h", "–"]
    assert esc("<a href='x'>&\"") == "&lt;a href=&#x27;x&#x27;&gt;&amp;&quot;"


def test_readable_range() -> None:
    from bluevela.report.page import readable_range as r

    # the 0.2-point spread: a 10-point axis around it, on round numbers
    assert r(40.98, 41.01, 10, lower=0, upper=100) == (36.0, 46.0)
    assert r(35, 35, 10, lower=0, upper=100) == (30.0, 40.0)  # all equal
    assert r(0, 0, 10, lower=0, upper=100, from_zero=True) == (0.0, 10.0)  # never -1..1
    assert r(98, 99.9, 10, lower=0, upper=100) == (90.0, 100.0)  # shifted inside 0..100
    assert r(85.3, 99.9, 10, lower=0, upper=100) == (85.0, 100.0)  # a real spread kept
    assert r(87, 710, 71, lower=0) == (50.0, 750.0)
    assert r(float("nan"), 1, 10) == (0.0, 1.0)
