"""The ranks' datagrams to the supervisor: one signed ASCII line each, over UDP.

    bvhb2 <rank> <node> <step> <pid> <seq> <age_ms> <state 0|1|2|3> <where> <mac>
    bvck1 <rank> <step> <pid> <seq> <start_age_ms> <end_age_ms> <mac>
    bvcb1 <rank> <step> <pid> <seq> <start_age_ms> <end_age_ms> <tiers 0..7> <mac>
    bvcr1 <rank> <step> <pid> <seq> <start_age_ms> <end_age_ms> <local> <partner> <shared> <skipped> <mac>
    bvag1 <node> <pid> <seq> <count> [<rank> <pid> <step> <age_ms> <state> <where>]*count <mac>

A heartbeat (`Beat`, bluevela/runtime/heartbeat.py: `step` -1 when the caller gave none,
`age_ms` since its last progress() call, `state` 1 while its main thread waits inside
``torch.distributed``, 2 once its training is over (`finished()`: teardown under way, not
watched for hangs), 3 when it is over and it may have been at bv's checkpoint request (the
rank acted on it, or a handler other than bv's had the signal: the job is requeued after a
request; 2 means the training simply ended, and a request that came later is no reason to
requeue), else 0, `where` its main thread's ``file:line:function``)
and a checkpoint (`CkptMsg`: how long before the send a save started and ended: what the
training loop waited for). The checkpoint store (bluevela/ckpt) sends two more: a save's
background phase (`CkptBgMsg`: off the training path; `tiers` the places this rank's shard of
the step is complete in, 1 node-local, 2 the partner's copy, 4 shared storage) and a resume
(`ResumeMsg`, rank 0 for the job: how many ranks read their shard from each tier, how many
copies were skipped). `mac` is
`keys.mac` with the beat key over the rest of the line; `seq` counts the sending process's
datagrams of that kind. Each kind is one `Form`: its magic word, its size cap and its
fields' bounds; `sign_datagram` and `read_datagram` are the one writer and the one reader,
which verifies the MAC before it reads a word and range-checks every number (a word's
length before int() parses it). A sender's seq must rise (`fresh_seq`).

The third kind is a node agent's aggregate (`Agg`, bluevela/launch/agent.py): the agent
receives its own ranks' beats on the node (signed as above: a beat from another user of the
node does not verify) and sends the supervisor one datagram per beat interval with each
local rank's last beat (its age taken at the send: the rank's age plus the time since the
agent received it), at most AGG_MAX_RANKS ranks a datagram. It is signed with its own key
(`keys.agg_key`), bounded (AGG_MAX_BYTES), parsed word by word with every number
range-checked and every word's characters checked (`parse_agg`), and its seq rises per
(node, agent pid) as a beat's does.
"""

from __future__ import annotations

import hmac
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from bluevela.protocol.keys import mac
from bluevela.protocol.names import safe_name

BEAT_MAGIC = "bvhb2"
CKPT_MAGIC = "bvck1"
CKPT_BG_MAGIC = "bvcb1"
RESUME_MAGIC = "bvcr1"
NUM_MAX_LEN = 20  # digits (and sign) of a number in a signed datagram: no 400-digit int()
# Range checks (a signed datagram from our own ranks always passes them).
MAX_RANK = 1 << 20
MAX_STEP = 1 << 62
MAX_PID = 1 << 22  # Linux pid_max limit
BEAT_MAX_AGE_MS = 1 << 40  # ~35 years
CKPT_MAX_AGE_MS = 7 * 86400 * 1000
NODE_WORD = 64  # characters of a node name in a beat
WHERE_WORD = 200  # characters of a beat's `where`
WHERE_PUNCT = "/<>"  # kept in `where` besides a name's characters (``<string>:1:<module>``)

Bounds = tuple[int, int] | None  # a number's [low, high], or None for a word


@dataclass(frozen=True)
class Form:
    """One kind of datagram: its first word, its size cap and its fields' bounds."""

    magic: str
    max_bytes: int
    fields: tuple[Bounds, ...]
    head: bytes = field(init=False)  # what a datagram of this kind starts with

    def __post_init__(self) -> None:
        object.__setattr__(self, "head", self.magic.encode() + b" ")


RANK = (0, MAX_RANK)
STEP = (-1, MAX_STEP)
PID = (1, MAX_PID)
SEQ = (0, MAX_STEP)
BEAT = Form(BEAT_MAGIC, 512, (RANK, None, STEP, PID, SEQ, (0, BEAT_MAX_AGE_MS), None, None))
CKPT = Form(CKPT_MAGIC, 256, (RANK, STEP, PID, SEQ, (0, CKPT_MAX_AGE_MS), (0, CKPT_MAX_AGE_MS)))
CKPT_BG = Form(CKPT_BG_MAGIC, 256, (*CKPT.fields, (0, 7)))
RESUME = Form(RESUME_MAGIC, 320, (*CKPT.fields, RANK, RANK, RANK, (0, MAX_RANK)))
TIER_BITS = {"local": 1, "partner": 2, "shared": 4}  # a CkptBgMsg's `tiers`


def bounded_int(word: str, low: int, high: int) -> int:
    """`word` as an int within [low, high]; ValueError for anything else (a long word is
    refused before int() parses it)."""
    if not 0 < len(word) <= NUM_MAX_LEN:
        raise ValueError(word)
    value = int(word)
    if not low <= value <= high:
        raise ValueError(word)
    return value


def sign_datagram(form: Form, values: Sequence[object], key: bytes) -> bytes:
    """The datagram of `form` with `values` (words already fit: `safe_name`), signed."""
    body = " ".join([form.magic, *map(str, values)]).encode("ascii", "replace")
    return body + b" " + mac(key, body)


def read_datagram(form: Form, data: bytes, key: bytes) -> list[int | str] | None:
    """The values of a datagram of `form` signed with `key`: numbers range-checked, words as
    sent; None for anything else (unsigned, badly signed, oversized, another kind, a word
    missing or a number out of range). Never raises."""
    if len(data) > form.max_bytes or not data.startswith(form.head):
        return None
    body, _, tag = data.rpartition(b" ")
    if not hmac.compare_digest(tag, mac(key, body)):
        return None
    try:
        words = body.decode("ascii").split()
        if len(words) != 1 + len(form.fields) or words[0] != form.magic:
            return None
        return [word if bounds is None else bounded_int(word, *bounds)
                for word, bounds in zip(words[1:], form.fields, strict=True)]
    except (UnicodeDecodeError, ValueError):
        return None


def fresh_seq(last_seen: dict[tuple[int, int], int], sender: tuple[int, int], seq: int,
              max_senders: int) -> bool:
    """True, and `seq` recorded, when it is above the last one seen from `sender` (a rank's
    (rank, pid)); False for a replayed or reordered datagram, and for a new sender once
    `max_senders` are known (forged pids cannot grow the table without bound)."""
    last = last_seen.get(sender)
    if last is not None and seq <= last:
        return False
    if last is None and len(last_seen) >= max_senders:
        return False
    last_seen[sender] = seq
    return True


# --------------------------------------------------------------------------------------------
# Heartbeats and checkpoints


@dataclass(frozen=True)
class Beat:
    """One heartbeat as the supervisor receives it."""

    rank: int
    node: str
    step: int
    pid: int
    age_s: float = 0.0  # since the last progress() call
    in_collective: bool = False
    where: str = "?"
    seq: int = 0  # this process's beat number (replay: the supervisor keeps the newest)
    finished: bool = False  # its training is over (runtime.finished()): no hang to watch for
    at_request: bool = False  # ... maybe at the checkpoint request (state 3)


def beat_state(beat: Beat | AggRank) -> int:
    """The `state` word of a beat or an aggregate's rank: 3 finished at the checkpoint request,
    2 finished, 1 in a collective, else 0."""
    if beat.finished:
        return 3 if beat.at_request else 2
    return int(beat.in_collective)


def state_flags(word: str) -> tuple[bool, bool, bool]:
    """A `state` word read back: (in a collective, finished, finished at the request)."""
    return word == "1", word in ("2", "3"), word == "3"


def format_beat(beat: Beat, key: bytes) -> bytes:
    """The signed datagram for `beat` (`key`: `keys.beat_key(secret)`)."""
    return sign_datagram(BEAT, (beat.rank, safe_name(beat.node, NODE_WORD, replace=""),
                                beat.step, beat.pid, beat.seq, max(0, int(beat.age_s * 1000)),
                                beat_state(beat),
                                safe_name(beat.where, WHERE_WORD, replace="",
                                          extra=WHERE_PUNCT)), key)


def parse_beat(data: bytes, key: bytes) -> Beat | None:
    """The beat in a datagram signed with `key`, or None for anything else (never raises)."""
    v = read_datagram(BEAT, data, key)
    if v is None:
        return None
    in_coll, finished, at_request = state_flags(str(v[6]))
    return Beat(rank=int(v[0]), node=str(v[1]), step=int(v[2]), pid=int(v[3]), seq=int(v[4]),
                age_s=int(v[5]) / 1000.0, in_collective=in_coll, where=str(v[7]),
                finished=finished, at_request=at_request)


@dataclass(frozen=True)
class TimedMsg:
    """What the three timed datagrams (`CkptMsg`, `CkptBgMsg`, `ResumeMsg`) start with: the
    sender, the step, its seq, and ages: how long before the send the thing started and
    ended. Sent as whole ms (`_timed_values`), read back by `_read_timed`."""

    rank: int
    step: int
    pid: int
    seq: int
    start_age_s: float
    end_age_s: float


@dataclass(frozen=True)
class CkptMsg(TimedMsg):
    """One checkpoint a rank saved: ages are how long before the send it started and ended."""


def format_ckpt(msg: CkptMsg, key: bytes) -> bytes:
    return sign_datagram(CKPT, _timed_values(msg), key)


def parse_ckpt(data: bytes, key: bytes) -> CkptMsg | None:
    """The checkpoint in a datagram signed with `key`, or None for anything else, a save
    that ended before it started included (never raises)."""
    t = _read_timed(CKPT, data, key)
    return None if t is None else CkptMsg(*t.head, t.start_age_s, t.end_age_s)


@dataclass(frozen=True)
class CkptBgMsg(TimedMsg):
    """One save's background phase on one rank (off the training path): ages as `CkptMsg`,
    `tiers` the places its shard of the step is complete in so far (`TIER_BITS`)."""

    tiers: int


@dataclass(frozen=True)
class ResumeMsg(TimedMsg):
    """One resume of the job (rank 0 sends it): the step, how long it took (ages), how many
    ranks read their shard from each tier and how many copies were skipped on the way."""

    local: int
    partner: int
    shared: int
    skipped: int


class _Timed(NamedTuple):
    """A timed datagram read back: rank, step, pid, seq; the ages in seconds; the rest."""

    head: tuple[int, int, int, int]
    start_age_s: float
    end_age_s: float
    rest: list[int]


def _timed_values(msg: TimedMsg) -> tuple[int, ...]:
    """The first six values of a timed datagram: rank, step, pid, seq, then the start and end
    ages in whole ms (a negative age sent as 0)."""
    return (msg.rank, msg.step, msg.pid, msg.seq, max(0, int(msg.start_age_s * 1000)),
            max(0, int(msg.end_age_s * 1000)))


def _read_timed(form: Form, data: bytes, key: bytes) -> _Timed | None:
    """A timed datagram of `form` (every field a number, the ages in ms fifth and sixth) read
    back, or None for anything `read_datagram` refuses and for an end before the start."""
    v = read_datagram(form, data, key)
    if v is None or int(v[5]) > int(v[4]):
        return None
    n = [int(x) for x in v]
    return _Timed((n[0], n[1], n[2], n[3]), n[4] / 1000.0, n[5] / 1000.0, n[6:])


def format_ckpt_bg(msg: CkptBgMsg, key: bytes) -> bytes:
    return sign_datagram(CKPT_BG, (*_timed_values(msg), msg.tiers), key)


def parse_ckpt_bg(data: bytes, key: bytes) -> CkptBgMsg | None:
    """As `parse_ckpt`, for a save's background phase."""
    t = _read_timed(CKPT_BG, data, key)
    return None if t is None else CkptBgMsg(*t.head, t.start_age_s, t.end_age_s, *t.rest)


def format_resume(msg: ResumeMsg, key: bytes) -> bytes:
    return sign_datagram(RESUME, (*_timed_values(msg), msg.local, msg.partner, msg.shared,
                                  msg.skipped), key)


def parse_resume(data: bytes, key: bytes) -> ResumeMsg | None:
    """As `parse_ckpt`, for a resume."""
    t = _read_timed(RESUME, data, key)
    return None if t is None else ResumeMsg(*t.head, t.start_age_s, t.end_age_s, *t.rest)


# --------------------------------------------------------------------------------------------
# A node agent's aggregate of its ranks' beats

AGG_MAGIC = "bvag1"
AGG_MAX_RANKS = 32  # ranks of one datagram (a node with more sends several)
AGG_HEAD = 5  # words before the ranks: magic, node, pid, seq, count
AGG_RANK_WORDS = 6  # rank, pid, step, age_ms, state, where
# The biggest aggregate a real agent sends: the head, AGG_MAX_RANKS ranks with a `where` of
# WHERE_WORD characters and every number at its widest, the MAC.
# (`safe_name` may add "..." to a word cut at its limit.)
AGG_MAX_BYTES = (len(AGG_MAGIC) + NODE_WORD + 3 + 2 * NUM_MAX_LEN + 3 + 5
                 + AGG_MAX_RANKS * (4 * NUM_MAX_LEN + 1 + WHERE_WORD + 3 + AGG_RANK_WORDS)
                 + 1 + 32)
# The whole body's shape in one pass (a word's characters and digits, a number's length
# before int() reads it), then each rank's words; the numbers' ranges are checked after.
_NUM = r"(-?[0-9]{1,%d})" % (NUM_MAX_LEN - 1)  # noqa: UP031
_AGG_RANK = r" %s %s %s %s ([0123]) ([A-Za-z0-9_.:\-/<>?]{1,%d})" % (  # noqa: UP031
    _NUM, _NUM, _NUM, _NUM, WHERE_WORD + 3)
_AGG_BODY_RE = re.compile(r"bvag1 ([A-Za-z0-9_.:\-]{1,%d}) %s %s %s((?:%s)+)" % (  # noqa: UP031
    NODE_WORD + 3, _NUM, _NUM, _NUM, _AGG_RANK.replace("(", "(?:").replace("(?:?:", "(?:")))
_AGG_RANK_RE = re.compile(_AGG_RANK)


class AggRank(NamedTuple):
    """One rank's last beat as its node's agent forwards it (a tuple: the supervisor makes
    8 N of them per beat interval)."""

    rank: int
    pid: int
    step: int
    age_s: float  # since its last progress() call, at the agent's send
    in_collective: bool = False
    where: str = "?"
    finished: bool = False
    at_request: bool = False  # finished, maybe at the checkpoint request (the beat's state 3)


@dataclass(frozen=True)
class Agg:
    """One aggregate: node `node`'s agent (process `pid`), its `seq`-th datagram."""

    node: str
    pid: int
    seq: int
    ranks: tuple[AggRank, ...]


def format_agg(agg: Agg, key: bytes) -> bytes:
    """The signed datagram for `agg` (`key`: `keys.agg_key(secret)`; at most AGG_MAX_RANKS
    ranks, raises ValueError past that)."""
    if not 0 < len(agg.ranks) <= AGG_MAX_RANKS:
        raise ValueError(f"an aggregate holds 1 to {AGG_MAX_RANKS} ranks")
    words = [AGG_MAGIC, safe_name(agg.node, NODE_WORD, replace=""), str(agg.pid),
             str(agg.seq), str(len(agg.ranks))]
    for r in agg.ranks:
        words += [str(r.rank), str(r.pid), str(r.step), str(max(0, int(r.age_s * 1000))),
                  str(beat_state(r)),
                  safe_name(r.where, WHERE_WORD, replace="", extra=WHERE_PUNCT)]
    body = " ".join(words).encode("ascii", "replace")
    return body + b" " + mac(key, body)


_AGG_HEAD_B = AGG_MAGIC.encode() + b" "


def parse_agg(data: bytes, key: bytes, max_rank: int = MAX_RANK) -> Agg | None:
    """The aggregate in a datagram signed with `key`, or None for anything else: unsigned or
    badly signed, over AGG_MAX_BYTES, a count outside 1..AGG_MAX_RANKS or not the words that
    follow, a number out of range, a rank >= `max_rank` or twice in one datagram, a node or
    `where` word with other characters. Never raises."""
    if len(data) > AGG_MAX_BYTES or not data.startswith(_AGG_HEAD_B):
        return None
    body, _, tag = data.rpartition(b" ")
    if not hmac.compare_digest(tag, mac(key, body)):
        return None
    try:
        m = _AGG_BODY_RE.fullmatch(body.decode("ascii"))
        if m is None:
            return None
        node, pid, seq, count, tail = m.groups()
        n = bounded_int(count, 1, AGG_MAX_RANKS)
        found = _AGG_RANK_RE.findall(tail)
        if len(found) != n:
            return None
        ranks: list[AggRank] = []
        seen: set[int] = set()
        high = min(MAX_RANK, max_rank - 1)
        for rank_w, pid_w, step_w, age_w, state, where in found:
            r, rpid, step, age = int(rank_w), int(pid_w), int(step_w), int(age_w)
            if (not 0 <= r <= high or r in seen or not 1 <= rpid <= MAX_PID
                    or not -1 <= step <= MAX_STEP or not 0 <= age <= BEAT_MAX_AGE_MS):
                return None
            seen.add(r)
            in_coll, finished, at_request = state_flags(state)
            ranks.append(AggRank(r, rpid, step, age / 1000.0, in_coll, where, finished,
                                 at_request))
        return Agg(node, bounded_int(pid, *PID), bounded_int(seq, *SEQ), tuple(ranks))
    except (UnicodeDecodeError, ValueError):
        return None

