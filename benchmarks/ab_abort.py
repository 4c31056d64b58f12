"""A survivor's step end, old checkout vs new (issue 37): the supervisor's ``abort`` -> the
node agent's ``exit`` message, without Slurm.

    python benchmarks/ab_abort.py --old <checkout> [--new <checkout>] [--pairs 8]

Each run starts the checkout's real node agent (``python3 -P -m bluevela.launch.agent``,
``PYTHONPATH`` the checkout) on a stand-in torchrun whose worker absorbs SIGTERM, as bv's ranks
do (the runtime takes it as a checkpoint request, 20 s grace) and which waits for its worker,
as torchrun does: the tree ends only by the agent's kill, as on a survivor of a crash. This
process plays the supervisor (the signed channel, hello, go, abort) and times abort -> exit.
Pairs alternate the order (old first in even pairs). A measurement that prints, not a test.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bluevela.protocol.channel import Channel, challenge_line
from bluevela.protocol.keys import SECRET_ENV, derive, new_secret

REPO = Path(__file__).resolve().parent.parent
WORKER = ("import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: None); "
          "open(sys.argv[1], 'w').close(); time.sleep(60)")
TORCHRUN = f'''
import signal, subprocess, sys
child = subprocess.Popen([sys.executable, "-c", {WORKER!r}, sys.argv[-1]])
signal.signal(signal.SIGTERM, lambda *a: child.send_signal(signal.SIGTERM))
child.wait()
'''


def once(checkout: Path, tmp: Path) -> float:
    secret = new_secret()
    torchrun, ready = tmp / "torchrun", tmp / "ready"
    torchrun.write_text(f"#!{sys.executable}\n{TORCHRUN}")
    torchrun.chmod(0o755)
    ready.unlink(missing_ok=True)
    with socket.socket() as listen:
        listen.bind(("127.0.0.1", 0))
        listen.listen(1)
        listen.settimeout(30)
        env = {**os.environ, "PYTHONPATH": str(checkout), "SLURMD_NODENAME": "node1",
               "BV_SUPERVISOR": f"127.0.0.1:{listen.getsockname()[1]}", "BV_RDZV_NODE": "node1",
               "BV_RDZV_GUARD": "optional", SECRET_ENV: secret}
        agent = subprocess.Popen([sys.executable, "-P", "-m", "bluevela.launch.agent", "--",
                                  str(torchrun), str(ready)], env=env, cwd="/",
                                 stderr=subprocess.DEVNULL)
        try:
            sock, _ = listen.accept()
            sock.settimeout(30)
            nonce = os.urandom(16)
            sock.sendall(challenge_line(nonce))
            chan = Channel(sock, derive(bytes.fromhex(secret), b"line"), nonce, b"s")
            queue: list[dict[str, object]] = []

            def nxt() -> dict[str, object]:
                while not queue:
                    data = sock.recv(65536)
                    if not data:
                        raise RuntimeError("the agent closed its channel")
                    queue.extend(chan.feed(data))
                return queue.pop(0)

            hello = nxt()
            chan.send({"t": "go", "port": hello["port"], "node_rank": 0, "nnodes": 1})
            deadline = time.monotonic() + 30
            while not ready.exists():
                if time.monotonic() > deadline:
                    raise RuntimeError("the stand-in worker never started")
                time.sleep(0.01)
            time.sleep(0.3)
            asked = time.monotonic()
            chan.send({"t": "abort"})
            while nxt()["t"] != "exit":
                pass
            return time.monotonic() - asked
        finally:
            if agent.poll() is None:
                agent.kill()
            agent.wait(10)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", type=Path, required=True)
    ap.add_argument("--new", type=Path, default=REPO)
    ap.add_argument("--pairs", type=int, default=8)
    args = ap.parse_args()
    took: dict[str, list[float]] = {"old": [], "new": []}
    with tempfile.TemporaryDirectory() as tmp:
        for pair in range(args.pairs):
            for side in (["old", "new"] if pair % 2 == 0 else ["new", "old"]):
                took[side].append(once(args.old if side == "old" else args.new, Path(tmp)))
    for side, values in took.items():
        print(f"abort -> exit, {side}: median {statistics.median(values):.3f} s, range "
              f"{min(values):.3f}-{max(values):.3f} ({len(values)} runs)")
    ratios = [n / o for o, n in zip(took["old"], took["new"], strict=True)]
    print(f"new/old: median {statistics.median(ratios):.2f}, range {min(ratios):.2f}-"
          f"{max(ratios):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
