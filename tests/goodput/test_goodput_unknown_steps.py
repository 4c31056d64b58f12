"""A plain torchrun script's goodput (issue 35): it imports nothing of bv, so no step reaches
the ledger, which used to read "start-up to first step 19.7 s, productive 0.0 s" and an ETTR
of 0 %: it said the job never trained. Now the ETTR is unknown, with a note saying why and how
to report steps; a script that reports them is unchanged."""

from __future__ import annotations

from bluevela.report import goodput as G
from tests.goodput.test_goodput_ledger import _launch, _rec


def test_a_script_that_reports_no_step_has_an_unknown_ettr() -> None:
    rec = _rec(0, submit=0, start=2, launches=[_launch(1, 1, 3, None, [], "ok", gone=25)])
    led = G.build_ledger(9, [rec])
    assert led.phases["productive"] == 0.0 and led.phases["startup"] > 20
    assert led.steps_reported is False and led.ettr is None
    assert led.to_dict()["ettr"] is None and led.to_dict()["steps_reported"] is False
    lines = G.summary_lines(led)
    assert lines[0].endswith("ETTR unknown (no step reported)"), lines[0]
    assert f"  note: {G.NO_STEPS_NOTE}" in lines
    assert "runtime.progress(step)" in G.NO_STEPS_NOTE


def test_a_script_that_reports_steps_is_unchanged() -> None:
    rec = _rec(0, submit=0, start=2, launches=[_launch(1, 1, 3, 6, [], "ok", gone=25)])
    led = G.build_ledger(9, [rec])
    assert led.steps_reported is True and led.ettr is not None and led.ettr > 0.7
    assert G.NO_STEPS_NOTE not in led.notes
    assert "ETTR 76.0%" in G.summary_lines(led)[0]
