"""The goodput ledger's costs (issue 18): the events in the training loop, and the ledger.

1. Events in the training loop: CPU (process time) and wall time per 1,000 calls of
   `runtime.progress(step)` and of `runtime.checkpoint_saved(step)`, with a supervisor that
   listens (a bound UDP socket) and with a dead one (nothing bound at the port: every send
   is refused by the kernel). Each call is measured in-process over `--calls` calls, `--rounds`
   times, alternating live and dead; the median and the range of the rounds are printed.
   The dead/live ratio says whether a dead supervisor slows the loop.
2. The ledger of a 1,000-node, 24-hour job with 10 interruptions (5 relaunches on a spare, 5
   requeues; a checkpoint every 10 minutes: 144 saves): the supervisor's events files of its
   6 Slurm attempts are written by `EventLog` itself, read back as the epilog does
   (`events_epilog.collect`), put through JSON as the archive stores them, checked again and made
   into a ledger (`goodput.build_ledger`). Time of each part and the peak Python memory
   (tracemalloc) of the whole, median of `--rounds`.

    python3 benchmarks/bench_goodput.py [--calls 100000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bluevela.goodput import events as E  # noqa: E402
from bluevela.goodput import events_epilog  # noqa: E402
from bluevela.goodput.outcome import Loss, StepEnd  # noqa: E402
from bluevela.launch import events_log  # noqa: E402
from bluevela.protocol.keys import beat_key, new_secret  # noqa: E402
from bluevela.protocol.messages import CkptMsg, format_ckpt  # noqa: E402
from bluevela.report import goodput as G  # noqa: E402
from bluevela.runtime import heartbeat  # noqa: E402


def _loop_cost(calls: int, target: str, what: str) -> tuple[float, float]:
    """(CPU s, wall s) per 1,000 calls of `what` with the supervisor address `target`."""
    os.environ["BV_HEARTBEAT"] = target
    os.environ["BV_JOB_SECRET"] = new_secret()
    heartbeat._SENDER = heartbeat._Sender()  # a fresh sender, as in a new rank
    fn = heartbeat.progress if what == "progress" else heartbeat.checkpoint_saved
    fn(0)  # the first call starts the sender (socket, beat thread): not the steady cost
    c0, w0 = time.process_time(), time.perf_counter()
    for step in range(calls):
        fn(step)
    c1, w1 = time.process_time(), time.perf_counter()
    return (c1 - c0) * 1e6 / calls, (w1 - w0) * 1e6 / calls  # s/call x 1e3 calls x 1e3 ms


def bench_loop(calls: int, rounds: int) -> dict[str, Any]:
    live = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    live.bind(("127.0.0.1", 0))
    live.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    probe.bind(("127.0.0.1", 0))
    dead_port = probe.getsockname()[1]
    probe.close()
    targets = {"live": f"127.0.0.1:{live.getsockname()[1]}", "dead": f"127.0.0.1:{dead_port}"}
    out: dict[str, Any] = {}
    for what in ("progress", "checkpoint_saved"):
        runs: dict[str, list[tuple[float, float]]] = {"live": [], "dead": []}
        for _ in range(rounds):
            for side in ("live", "dead"):
                runs[side].append(_loop_cost(calls, targets[side], what))
                while True:  # empty the live socket's buffer between rounds
                    live.setblocking(False)
                    try:
                        live.recv(4096)
                    except BlockingIOError:
                        break
        for side, vals in runs.items():
            cpu = [v[0] for v in vals]
            wall = [v[1] for v in vals]
            out[f"{what}.{side}.cpu_ms_per_1000"] = (statistics.median(cpu), min(cpu), max(cpu))
            out[f"{what}.{side}.wall_ms_per_1000"] = (statistics.median(wall), min(wall),
                                                      max(wall))
        ratios = [d[1] / lv[1] for d, lv in zip(runs["dead"], runs["live"], strict=True)]
        out[f"{what}.dead_vs_live_wall_ratio"] = (statistics.median(ratios), min(ratios),
                                                  max(ratios))
    live.close()
    return out


def _big_job_files(tmp: Path) -> tuple[list[tuple[int, str]], list[str]]:
    """EventLog files of a 1,000-node, 24 h job: 6 Slurm attempts, 10 interruptions."""
    nodes = [f"gpu{i:04d}" for i in range(1001)]
    key = b"k" * 32
    t = time.time() - 86400 - 600
    day = 86400.0
    per = day / 11  # 11 launches share the day
    files = []
    launch_no = 0
    attempt = 0
    env = {"SLURM_JOB_ID": "4242", "BV_EVENTS_DIR": str(tmp)}
    for restart in range(6):
        env["SLURM_RESTART_COUNT"] = str(restart)
        log = events_log.EventLog.open(env, "gpu0000", query=False)
        launches = 2 if restart < 5 else 1  # a spare relaunch, then a requeue
        for la in range(1, launches + 1):
            attempt += 1
            launch_no += 1
            start = t + (launch_no - 1) * per
            mono0 = time.monotonic() - (time.time() - start)
            log.launch(attempt, la, nodes[:1000], 1, mono0)
            log.progress(mono0 + 300)
            # A save every 600 s (20 s each): the datagrams as the ranks send them.
            now_wall = time.time()
            s = start + 300 + 600
            while s + 20 < start + per - 400:
                ck = CkptMsg(0, int(s), 100, int(s), now_wall - s, now_wall - s - 20)
                log.datagram(format_ckpt(ck, beat_key(key)), beat_key(key),
                             8000, time.monotonic())
                s += 600
            fail = start + per - 200
            f_mono = time.monotonic() - (time.time() - fail)
            log.step_ended(StepEnd.LOST if launch_no < 11 else StepEnd.OK,
                           "gpu0999 lost (its agent's connection closed)",
                           {"gpu0999": Loss.closed()}, f_mono, f_mono + 1, f_mono + 30)
        if restart < 5:  # the requeue 40 s after the failure (EventLog.requeue writes "now")
            log._write({"e": "requeue", "t": fail + 40})
        log.close()
        files.append((restart, "gpu0000"))
    return files, nodes


def bench_ledger(rounds: int) -> dict[str, Any]:
    times: dict[str, list[float]] = {"collect_s": [], "archive_json_s": [], "ledger_s": []}
    peaks: list[float] = []
    sizes: list[int] = []
    phases: dict[str, float] = {}
    for _ in range(rounds):
        with tempfile.TemporaryDirectory() as d:
            tmp = Path(d)
            tmp.chmod(0o1777)  # like /tmp: a directory the epilog reads (events_dir.dir_layout)
            files, _ = _big_job_files(tmp)
            sizes.append(sum(p.stat().st_size for p in tmp.iterdir()))
            tracemalloc.start()
            t0 = time.perf_counter()
            recs = [events_epilog.collect(4242, k, node, os.getuid(), {"BV_EVENTS_DIR": d})
                    for k, node in files]
            t1 = time.perf_counter()
            stored = [E.validate(json.loads(json.dumps(r))) for r in recs if r is not None]
            t2 = time.perf_counter()
            led = G.build_ledger(4242, stored, gpus_per_node=8)
            t3 = time.perf_counter()
            peaks.append(tracemalloc.get_traced_memory()[1] / 2**20)
            tracemalloc.stop()
            times["collect_s"].append(t1 - t0)
            times["archive_json_s"].append(t2 - t1)
            times["ledger_s"].append(t3 - t2)
            assert len(stored) == 6 and len(led.interruptions) == 10, led.interruptions
            assert abs(sum(led.phases.values()) - led.wall_s) < 1e-6
            phases = {k: round(v / 3600, 3) for k, v in led.phases.items()}
    out: dict[str, Any] = {f"ledger_1000n_24h.{k}": (statistics.median(v), min(v), max(v))
                           for k, v in times.items()}
    out["ledger_1000n_24h.peak_mib"] = (statistics.median(peaks), min(peaks), max(peaks))
    out["ledger_1000n_24h.events_bytes"] = sizes[0]
    out["ledger_1000n_24h.phases_h"] = phases
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--calls", type=int, default=100_000)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    res = {**bench_loop(args.calls, args.rounds), **bench_ledger(args.rounds)}
    for k, v in res.items():
        if isinstance(v, tuple):
            print(f"{k:52} median {v[0]:.4g}  range {v[1]:.4g}..{v[2]:.4g}")
        else:
            print(f"{k:52} {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
