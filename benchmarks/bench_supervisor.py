"""What authenticating the supervisor's heartbeats costs (issue 16 §1).

- ``supervisor.beat_parse_cpu_ms_per_1000``: CPU to take 1,000 beats in-process, signed
  (HMAC-SHA256 verify, then the range-checked parse: `parse_beat`) vs the unauthenticated
  parse of 6c9e5ca (split and int, reproduced below as `_parse_unsigned`), same method:
  `time.process_time` over 20,000 beats, median of 7 repetitions, interleaved.
- ``supervisor.beat_cpu_ms_per_1000``: the REAL supervisor (stand-in srun/torchrun,
  tests/supervisor_standins.py) receives 20,000 beats over UDP, paced so that none is dropped;
  its CPU (utime+stime from /proc) per 1,000, the idle ticks of the same wall time
  subtracted. With ``BV_BENCH_OLD=<checkout of 6c9e5ca>`` the old supervisor is run the same
  way (its unsigned format), interleaved, and the ratio is given with its spread.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from _common import REPO, Figure

sys.path.insert(0, str(REPO))

from bluevela.protocol.keys import beat_key, mac  # noqa: E402
from bluevela.protocol.messages import Beat, format_beat, parse_beat  # noqa: E402

N_BEATS = 20_000


def _parse_unsigned(data: bytes) -> tuple[int, str, int, int, float, bool, str] | None:
    """6c9e5ca's parse_beat (the unauthenticated format), for the comparison."""
    try:
        words = data.decode("ascii").split()
        if len(words) != 8 or words[0] != "bvhb1":
            return None
        return (int(words[1]), words[2], int(words[3]), int(words[4]), int(words[5]) / 1000.0,
                words[6] == "1", words[7])
    except (UnicodeDecodeError, ValueError):
        return None


def _in_process(reps: int) -> tuple[list[float], list[float]]:
    key = beat_key(os.urandom(32))
    signed = [format_beat(Beat(r % 64, "node042", 1000 + r, 4242, 0.5, False,
                               "train.py:120:train_step", seq=r), key) for r in range(N_BEATS)]
    plain = [f"bvhb1 {r % 64} node042 {1000 + r} 4242 500 0 train.py:120:train_step".encode()
             for r in range(N_BEATS)]
    auth, unauth = [], []
    for _ in range(reps):
        t0 = time.process_time()
        for data in plain:
            _parse_unsigned(data)
        unauth.append((time.process_time() - t0) * 1000 * 1000 / N_BEATS)
        t0 = time.process_time()
        for data in signed:
            parse_beat(data, key)
        auth.append((time.process_time() - t0) * 1000 * 1000 / N_BEATS)
    return auth, unauth


def _supervisor_cpu(old: Path | None) -> float:
    """The real supervisor's CPU ms per 1,000 beats received over UDP."""
    from tests.supervisor_standins import Job

    with tempfile.TemporaryDirectory(prefix="bv-bench-sup-") as tmp:
        job = Job(Path(tmp), ("n1",), options=["--hang-timeout=600"])
        if old is not None:
            job.env["PYTHONPATH"] = str(old)
        job.start()
        try:
            job.wait_ready()
            addr = job.addrs()[1]
            key = None
            if old is None:
                secret = (Path(tmp) / "secret").read_text().split()[-1]
                key = beat_key(bytes.fromhex(secret))
            udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            beats = []
            for i in range(N_BEATS):
                if key is None:
                    beats.append(f"bvhb1 0 n1 {i} 4242 5 0 train.py:120:train_step".encode())
                else:
                    body = f"bvhb2 0 n1 {i} 4242 {i + 1} 5 0 train.py:120:train_step".encode()
                    beats.append(body + b" " + mac(key, body))
            time.sleep(0.5)
            c0, t0 = job.cpu_s(), time.monotonic()
            for i, data in enumerate(beats):
                udp.sendto(data, addr)
                if i % 20 == 19:
                    time.sleep(0.001)  # paced: none dropped (the receive buffer never fills)
            time.sleep(0.3)
            busy, wall = job.cpu_s() - c0, time.monotonic() - t0
            c1 = job.cpu_s()
            time.sleep(wall)
            idle = job.cpu_s() - c1
            return (busy - idle) * 1000 * 1000 / N_BEATS
        finally:
            job.finish()
            job.kill()


def figures(args: argparse.Namespace) -> Iterator[Figure]:
    reps = 3 if args.quick else 7
    auth, unauth = _in_process(reps)
    a, u = statistics.median(auth), statistics.median(unauth)
    yield Figure("supervisor.beat_parse_cpu_ms_per_1000", a, "ms", "",
                 f"signed (HMAC verify + range-checked parse), median of {reps} x {N_BEATS}; "
                 f"unsigned parse of 6c9e5ca {u:.2f} ms; ratio {a / u:.2f} "
                 f"(range {min(auth) / max(unauth):.2f}-{max(auth) / min(unauth):.2f})")
    old_dir = os.environ.get("BV_BENCH_OLD")
    old = Path(old_dir) if old_dir else None
    rounds = 2 if args.quick else 3
    new_ms, old_ms = [], []
    for _ in range(rounds):
        new_ms.append(_supervisor_cpu(None))
        if old is not None:
            old_ms.append(_supervisor_cpu(old))
    note = f"real supervisor, {N_BEATS} beats over UDP, median of {rounds}: " + \
        ", ".join(f"{x:.0f}" for x in new_ms)
    if old_ms:
        ratios = [n / o for n, o in zip(new_ms, old_ms, strict=True)]
        note += (f"; 6c9e5ca (unsigned) interleaved: {', '.join(f'{x:.0f}' for x in old_ms)}; "
                 f"ratio new/old {statistics.median(ratios):.2f} "
                 f"({min(ratios):.2f}-{max(ratios):.2f})")
    yield Figure("supervisor.beat_cpu_ms_per_1000", statistics.median(new_ms), "ms", "<= 50",
                 note)
