"""The attempt banner round trip (bluevela/launch/attempts.py): what the supervisor writes is
what `bv logs --attempt N`, `bv status` and the supervisor's own history read back, with one
format in one module."""

from __future__ import annotations

import pytest

from bluevela.launch.attempts import (
    BANNER,
    END,
    History,
    attempt_causes,
    banner,
    end_line,
    previous_cause,
    read_history,
    split_attempts,
)

CAUSES = ["none", "node2 lost (its agent's connection closed: the node or its processes died)",
          "a ==== b", "two\nlines\r\n and\ttabs", "ünïcode ✓ (x) [y] ; $(z)", " ==== ", ""]


@pytest.mark.parametrize("cause", CAUSES)
def test_banner_and_end_line_read_back(cause: str) -> None:
    flat = " ".join(cause.split())
    line = banner(12, "4711", ["node1", "node2", "node7"], cause)
    m = BANNER.fullmatch(line)
    assert m is not None, line
    assert (m["n"], m["job"], m["nodes"], m["prev"]) == ("12", "4711", "node[1-2,7]", flat)
    end = end_line(12, cause)
    e = END.fullmatch(end)
    assert e is not None and (e["n"], e["cause"]) == ("12", flat), end
    assert BANNER.match(end) is None and END.match(line) is None


@pytest.mark.parametrize("cause", CAUSES)
def test_the_supervisors_history_and_the_logs_split_agree(cause: str) -> None:
    flat = " ".join(cause.split())
    lines = [banner(1, "9", ["n1"], "none"), "step=1", end_line(1, cause),
             banner(2, "9", ["n1", "n2"], cause), "step=2", end_line(2, "exit 0")]
    text = "pre\n" + "\n".join(lines) + "\n"
    assert read_history(x.encode() for x in text.splitlines(keepends=True)) == History(2, "exit 0")
    assert read_history(x.encode() + b"\n" for x in lines[:4]) == History(2, None)
    parts = split_attempts(text)
    assert [(p.attempt, p.nodes, p.previous, p.ended) for p in parts] == [
        (1, "n1", "none", flat), (2, "n[1-2]", flat, "exit 0")]
    assert parts[0].text.startswith("pre\n")
    assert attempt_causes(text) == ({1: flat, 2: "exit 0"} if flat else {2: "exit 0"})
    assert previous_cause(read_history([(end_line(3, cause) + "\n").encode()])) == "none"
