"""The sampler opens NVML once per sample (issue 26, section 4).

The sampler's live path runs the real pynvml binding (nvidia-ml-py) against a stand-in
`libnvidia-ml.so.1` built here from C and found first through LD_LIBRARY_PATH, as the driver's
library is found through ld.so.cache. The stand-in has two GPUs, answers temperature,
utilisation and the SM clock, lacks the rest (an older driver: null fields), and appends a
line to `$NVML_CALLS` at every `nvmlInit*` and `nvmlShutdown`: the count of NVML sessions a
sample costs, read from the library's side of the binding. Before this, one sample opened
NVML twice (the health snapshot's gather, then the utilisation and clocks read).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import build_standin_nvml

pytest.importorskip("pynvml")

REPO = Path(__file__).resolve().parents[2]

STANDIN_C = r"""
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
typedef struct { int id; } dev;
typedef struct { unsigned int gpu; unsigned int memory; } utilization;
static dev gpus[2] = {{0}, {1}};
static void note(const char *what) {
    const char *p = getenv("NVML_CALLS");
    FILE *f = p ? fopen(p, "a") : NULL;
    if (f) { fprintf(f, "%s\n", what); fclose(f); }
}
int nvmlInitWithFlags(unsigned int flags) { (void)flags; note("init"); return 0; }
int nvmlInit_v2(void) { note("init"); return 0; }
int nvmlInit(void) { note("init"); return 0; }
int nvmlShutdown(void) { note("shutdown"); return 0; }
const char *nvmlErrorString(int r) { return r == 13 ? "Function Not Found" : "Unknown Error"; }
int nvmlSystemGetDriverVersion(char *buf, unsigned int len) {
    strncpy(buf, "550.54.15", len); return 0;
}
int nvmlDeviceGetCount_v2(unsigned int *n) { *n = 2; return 0; }
int nvmlDeviceGetCount(unsigned int *n) { *n = 2; return 0; }
int nvmlDeviceGetHandleByIndex_v2(unsigned int i, dev **h) {
    if (i > 1) return 2;
    *h = &gpus[i]; return 0;
}
int nvmlDeviceGetTemperature(dev *h, int sensor, unsigned int *t) {
    (void)sensor; *t = 40 + h->id; return 0;
}
int nvmlDeviceGetUtilizationRates(dev *h, utilization *u) {
    u->gpu = 87 + h->id; u->memory = 5; return 0;
}
int nvmlDeviceGetClockInfo(dev *h, int type, unsigned int *mhz) {
    (void)type; *mhz = 1980 - h->id; return 0;
}
"""

SAMPLE = """
import json, sys, time
from pathlib import Path
from bluevela.health.context import ProbeContext
from bluevela.site import load_site
from bluevela.telemetry.sampler import Config, Sampler
site = load_site(Path(sys.argv[1]))
ctx = ProbeContext(site.node_classes["h100"], "h100", root=Path(sys.argv[2]), nvml_snapshot=None)
s = Sampler(ctx, Config(Path(sys.argv[3]), "gpu001", 10.0, 1e9, 1 << 30))
calls = Path(sys.argv[4])
per_sample = []
for k in range(3):
    before = calls.read_text().splitlines() if calls.exists() else []
    cols, vals, _ = s.sample(1_750_000_000.0 + 10 * k)
    after = calls.read_text().splitlines()
    per_sample.append(after[len(before):])
v = dict(zip((c.name for c in cols), vals))
print(json.dumps({"per_sample": per_sample, "values": {
    k: v[k] for k in ("gpu0.temp_c", "gpu1.temp_c", "gpu0.util_pct", "gpu1.util_pct",
                      "gpu0.sm_clock_mhz", "gpu1.sm_clock_mhz")}}))
"""


@pytest.fixture(scope="module")
def standin_lib(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_standin_nvml(tmp_path_factory.mktemp("nvml-counting"), STANDIN_C)


def test_one_nvml_session_per_sample_with_util_and_clocks(standin_lib: Path,
                                                          tmp_path: Path) -> None:
    calls = tmp_path / "nvml-calls"
    env = dict(os.environ, LD_LIBRARY_PATH=str(standin_lib), PYTHONPATH=str(REPO),
               NVML_CALLS=str(calls))
    root = REPO / "tests" / "data" / "health" / "h100-healthy" / "root"
    p = subprocess.run([sys.executable, "-c", SAMPLE, str(REPO / "site.yaml"), str(root),
                        str(tmp_path / "samples"), str(calls)],
                       capture_output=True, text=True, timeout=120, env=env, cwd="/")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["per_sample"] == [["init", "shutdown"]] * 3, out["per_sample"]
    assert out["values"] == {"gpu0.temp_c": 40.0, "gpu1.temp_c": 41.0,
                             "gpu0.util_pct": 87.0, "gpu1.util_pct": 88.0,
                             "gpu0.sm_clock_mhz": 1980.0, "gpu1.sm_clock_mhz": 1979.0}
