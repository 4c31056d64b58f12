"""Typed step outcomes (bluevela/goodput/outcome.py): one vocabulary for how a step ended, and a
kind for every reason a node is lost, with the words the job output has always shown."""

from __future__ import annotations

import json

from bluevela.goodput.outcome import Loss, LossKind, StepEnd, loss_kinds
from bluevela.launch.step_result import lost_text


def test_step_end_values_are_the_record_kinds() -> None:
    # The goodput record stores `.value`; a StepEnd is also the string itself.
    assert [e.value for e in StepEnd] == ["ok", "failed", "lost", "hang", "signal", "terminated"]
    assert StepEnd("hang") is StepEnd.HANG and StepEnd.OK == "ok"
    assert json.loads(json.dumps({"kind": StepEnd.LOST})) == {"kind": "lost"}
    assert {e for e in StepEnd if e.by_signal} == {StepEnd.SIGNAL, StepEnd.TERMINATED}


def test_every_loss_has_a_kind_and_todays_words() -> None:
    made = [Loss.closed(), Loss.silent(10.4), Loss.never_connected(120), Loss.no_abort_answer(),
            Loss.protocol("bad MAC"), Loss.hung()]
    assert [m.kind for m in made] == [LossKind.CLOSED, LossKind.SILENT,
                                      LossKind.NEVER_CONNECTED, LossKind.NO_ABORT_ANSWER,
                                      LossKind.PROTOCOL, LossKind.HUNG]
    assert [m.text for m in made] == [
        "its agent's connection closed: the node or its processes died",
        "silent for 10 s (no agent ping)", "its agent never connected in 120 s",
        "did not answer the abort", "its agent broke the protocol (bad MAC)", "its rank hung"]
    lost = {"node2": Loss.closed(), "node3": Loss.silent(10)}
    assert lost_text(lost) == ("node2 lost (its agent's connection closed: the node or its "
                               "processes died); node3 lost (silent for 10 s (no agent ping))")
    # The serialised form: the kind's value beside the text; it reads back as the same kind.
    kinds = loss_kinds(lost)
    assert kinds == {"node2": "closed", "node3": "silent"}
    assert {n: LossKind(v) for n, v in json.loads(json.dumps(kinds)).items()} == {
        n: loss.kind for n, loss in lost.items()}


def test_a_reworded_loss_keeps_its_kind() -> None:
    assert Loss(LossKind.SILENT, "quiet for a while").kind is Loss.silent(3).kind
    assert len({k.value for k in LossKind}) == len(LossKind)
