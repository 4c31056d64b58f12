#!/usr/bin/env bash
# Issue 6: GPU truth, in ONE call on a lent H100/H200 machine (see docs/gpu-verification.md).
#   device run: bash benchmarks/device/run.sh   (repo root; $OUT set by the device tool)
# Installs the package without dependencies (the machine's python3 has torch, pynvml, h5py,
# click, rich, numpy; the wheels of pydantic and python-hostlist travel in .whl/), then writes
# everything under $OUT (at most 8 files):
#   nvml-<gpu>.json      bv health snapshot of the real GPU (the fixture of record)
#   health-quick.json    bv health run --tier quick --json (live NVML)
#   health-full.json     bv health run --tier full --json
#   bench.json           bv bench run gemm hbm h2d d2h --json (the CLI end to end, once)
#   interleave.json      bv's measurements and the bare-torch reference (reference.py, same
#                        timing method) alternated A B A B ... on the same warm GPU in one
#                        process; ratio bv/reference per figure: median, min-max, IQR over pairs
#   timings.json         quick-tier wall times, process start included, vs python -c pass
#   pytest-gpu.txt       the GPU-marked tests
#   log.txt              nvidia-smi -q and the commands' stderr
# `run.sh health` does the health part only (snapshot, quick, timings, full, GPU tests).
# On a machine without a GPU it stops at once with exit 2 and one line.
set -uo pipefail
OUT=${OUT:-$(mktemp -d)}
PY=${PY:-python3}
log="$OUT/log.txt"
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "device/run.sh: no NVIDIA GPU here (nvidia-smi missing or failing); nothing to verify" >&2
    exit 2
fi
if [ -d .whl ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/bv-site .whl/*.whl >>"$log" 2>&1 || { echo "wheel install failed" >&2; exit 2; }
    export PYTHONPATH="/tmp/bv-site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
name=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)
case "$name" in
    *H200*) gpu=h200 ;;
    *H100*) gpu=h100 ;;
    *) echo "device/run.sh: unexpected GPU '$name'; using the h100x1 class" >&2; gpu=h100 ;;
esac
export BV_SITE="$PWD/benchmarks/device/site-device.yaml" BV_NODE_CLASS="${gpu}x1"
export BV_STATE_DIR=/tmp/bv-state BV_SPOOL_DIR=/tmp/bv-spool BV_ARCHIVE_DIR=/tmp/bv-archive \
       BV_METRICS_DIR=/tmp/bv-metrics
mkdir -p /tmp/bv-state /tmp/bv-spool /tmp/bv-archive /tmp/bv-metrics
bv() { "$PY" -m bluevela "$@"; }
{ echo "== $(date -u +%FT%TZ) $name"; nvidia-smi; nvidia-smi -q; "$PY" -c 'import torch, sys; print(sys.version, torch.__version__)'; } >>"$log" 2>&1

echo "== snapshot";  bv health snapshot --out "$OUT/nvml-$gpu.json" 2>>"$log"; echo "rc=$?"
echo "== quick";     bv health run --tier quick --json >"$OUT/health-quick.json" 2>>"$log"; echo "rc=$?"
echo "== timings"
"$PY" - "$OUT/timings.json" <<'PYEOF' 2>>"$log"
import json, statistics, subprocess, sys, time
def t(argv):
    s = time.perf_counter(); subprocess.run(argv, capture_output=True); return time.perf_counter() - s
q = [t([sys.executable, "-m", "bluevela", "health", "run", "--tier", "quick", "--json"]) for _ in range(30)]
p = [t([sys.executable, "-c", "pass"]) for _ in range(30)]
q.sort(); p.sort()
d = {"quick_p50_s": statistics.median(q), "quick_p95_s": q[int(0.95 * (len(q) - 1))],
     "quick_max_s": q[-1], "python_pass_p50_s": statistics.median(p), "runs": len(q)}
json.dump(d, open(sys.argv[1], "w"), indent=1); print(d)
PYEOF
echo "== full";      bv health run --tier full --json >"$OUT/health-full.json" 2>>"$log"; echo "rc=$?"
if [ "${1:-all}" != health ]; then
echo "== bench";     bv bench run gemm hbm h2d d2h --json >"$OUT/bench.json" 2>>"$log"; echo "rc=$?"
echo "== interleaved bv / reference (${PAIRS:=7} pairs)"
"$PY" benchmarks/device/interleave.py --pairs "$PAIRS" >"$OUT/interleave.json" 2>>"$log"; echo "rc=$?"
grep -E '^(gemm|hbm|h2d|d2h)' "$log" | tail -n 8
fi
echo "== gpu tests"; "$PY" -m pytest -q -m gpu -p no:cacheprovider tests >"$OUT/pytest-gpu.txt" 2>&1; echo "rc=$?"
tail -n 3 "$OUT/pytest-gpu.txt"
"$PY" - "$OUT" <<'PYEOF'
import json, sys, pathlib
o = pathlib.Path(sys.argv[1])
def load(n):
    try: return json.loads((o / n).read_text())
    except Exception as e: return {"error": str(e)}
q, f, b, r = load("health-quick.json"), load("health-full.json"), load("bench.json"), load("interleave.json")
for doc, label in ((q, "quick"), (f, "full")):
    for c in doc.get("checks", []):
        print(f"{label:5} {c['name']:5} {c['status']:8} {c['summary']}")
print("bench:", json.dumps(b)[:1500])
print("bv / reference:", json.dumps(r.get("summary", r)))
PYEOF
exit 0
