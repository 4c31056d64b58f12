"""The checkpoint shard's digest, old checkout vs new: write, load, verify and a streamed
fetch of one shard file, interleaved.

Each side runs, for each size, in a fresh interpreter whose PYTHONPATH is its checkout (so
each imports its own bluevela/ckpt/shardfile.py): it writes a shard of that payload from memory
with `write_shard` (the node-local save: temporary file, fsync, rename), then, the file in the
page cache, `load_at` (the resume from this node: read into one buffer, verified), `verify_at`
(the drain's and the epilog's check) and `read_stream` over the open file (the spare's fetch
from its partner, the socket replaced by the file so that the network is not measured), and
`tcp`: the whole fetch over loopback (a `ShardServer` of the side's code serving the file,
`fetch_payload` reading it into memory, verified: the sender's sends and the receiver's reads
and hashing on the same cores). Rounds
alternate the order (old,new / new,old) so that load on this shared machine falls on both
sides; the figures are each side's median per operation and the old/new ratio per round
(median, min-max).

Usage: python3 benchmarks/ab_digest.py --old /tmp/old-checkout [--new .] [--mb 64,512]
           [--rounds 5] [--dir /var/tmp]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import PY, REPO

_CHILD = """
import json, os, sys, time
from bluevela.ckpt.partner import ShardServer, fetch_payload
from bluevela.ckpt.shardfile import MAGIC, load_at, read_stream, verify_at, write_shard
work, sizes = sys.argv[1], [int(x) for x in sys.argv[2].split(",")]
out = {}
d = os.open(work, os.O_RDONLY | os.O_DIRECTORY)
for mb in sizes:
    payload = bytearray(os.urandom(1 << 20)) * mb
    header = {"step": 1, "rank": 0, "world": 1, "payload": len(payload), "name": "ab"}
    t = time.perf_counter(); write_shard(d, "s", header, [payload]); w = time.perf_counter() - t
    del payload
    load_at(d, "s")  # the page cache warm for every side alike
    t = time.perf_counter(); load_at(d, "s", {"step": 1}); ld = time.perf_counter() - t
    t = time.perf_counter(); verify_at(d, "s"); v = time.perf_counter() - t
    size = os.path.getsize(os.path.join(work, "s"))
    with open(os.path.join(work, "s"), "rb", buffering=0) as f:
        t = time.perf_counter(); read_stream(f, size, {"step": 1}); rs = time.perf_counter() - t
    key = b"k" * 32
    srv = ShardServer(key, lambda s: os.dup(d), lambda s, r: (os.dup(d), "s"),
                      lambda s, r, n: "no", 1 << 40, host="127.0.0.1")
    t = time.perf_counter(); fetch_payload(("127.0.0.1", srv.port), key, 1, 0)
    tcp = time.perf_counter() - t
    srv.close()
    os.unlink(os.path.join(work, "s"))
    out[mb] = {"write": w, "load": ld, "verify": v, "fetch": rs, "tcp": tcp}
print(MAGIC.decode(), json.dumps(out))
"""

OPS = ("write", "load", "verify", "fetch", "tcp")


def _side(checkout: Path, work: Path, sizes: str) -> tuple[str, dict[str, dict[str, float]]]:
    """The side's shard format (the magic its code wrote) and its seconds per size and op."""
    # `-c` puts the working directory first on sys.path: the child runs in `work`, so that
    # PYTHONPATH (the side's checkout) is where bluevela comes from.
    env = dict(os.environ, PYTHONPATH=str(checkout))
    proc = subprocess.run([PY, "-c", _CHILD, str(work), sizes], capture_output=True, text=True,
                          env=env, cwd=work, timeout=900, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"ab_digest: {checkout}: {proc.stderr.strip()[-2000:]}")
    magic, _, doc = proc.stdout.strip().splitlines()[-1].partition(" ")
    return magic, {str(k): v for k, v in json.loads(doc).items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", type=Path, required=True)
    ap.add_argument("--new", type=Path, default=REPO)
    ap.add_argument("--mb", default="64,512")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dir", type=Path, default=Path("/var/tmp"))
    args = ap.parse_args()
    sides = {"old": args.old.resolve(), "new": args.new.resolve()}
    runs: dict[str, list[dict[str, dict[str, float]]]] = {"old": [], "new": []}
    formats: dict[str, str] = {}
    for r in range(args.rounds):
        order = ("old", "new") if r % 2 == 0 else ("new", "old")
        got: dict[str, dict[str, dict[str, float]]] = {"old": {}, "new": {}}
        for mb in args.mb.split(","):
            for name in order:
                with tempfile.TemporaryDirectory(prefix="bv-ab-digest-", dir=args.dir) as work:
                    formats[name], times = _side(sides[name], Path(work), mb)
                    got[name].update(times)
        for name in order:
            runs[name].append(got[name])
    print(f"ab_digest: {args.rounds} rounds, old {sides['old']} vs new {sides['new']}, "
          f"{os.cpu_count()} cores, hash threads {os.environ.get('BV_CKPT_HASH_THREADS', 'default')}; "
          f"formats written: old {formats['old']}, new {formats['new']}")
    print(f"{'MB':>5} {'op':<7} {'old s':>8} {'new s':>8} {'old/new':>8} {'min-max':>12}  GB/s new")
    for mb in args.mb.split(","):
        for op in OPS:
            old = [run[mb][op] for run in runs["old"]]
            new = [run[mb][op] for run in runs["new"]]
            ratios = [o / n for o, n in zip(old, new, strict=True)]
            gbs = int(mb) / 1024 / statistics.median(new)
            print(f"{mb:>5} {op:<7} {statistics.median(old):8.3f} {statistics.median(new):8.3f} "
                  f"{statistics.median(ratios):8.2f} {min(ratios):5.2f}-{max(ratios):<5.2f}  "
                  f"{gbs:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
