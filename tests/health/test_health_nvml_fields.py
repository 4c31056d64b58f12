"""The NVML field table and the sampler's one-session reading (health.nvml_fields, nvml_live).

The table test holds the table and the model together: every typed `GPUInfo` attribute is a
row, so a field added to one and not the other fails here. The session test runs the real
pynvml over a stand-in `libnvidia-ml.so.1` (tests/health/test_health_nvml_errors.py's, built from C)
that logs each nvmlInit and nvmlShutdown to a file: one sample is one of each.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bluevela.health.nvml_fields import FIELDS_BY_NAME, GPU_FIELDS, LATE_FIELDS, RECHECK_FIELDS
from bluevela.health.nvml_snapshot import GPUInfo, load_snapshot, parse_gpu
from tests.conftest import build_standin_nvml
from tests.fixture_trees import materialized
from tests.health.test_health_nvml_errors import STANDIN_C

REPO = Path(__file__).resolve().parents[2]
FIXTURES = materialized()
# Not table rows: the index and the handle's error come from the gather itself, the
# *_recheck fields from the snapshot's second reading of the RECHECK_FIELDS rows.
NOT_ROWS = {"index", "error", "clocks_event_reasons_recheck", "compute_processes_recheck"}


def test_every_model_field_is_one_table_row() -> None:
    names = [f.name for f in GPU_FIELDS]
    assert len(names) == len(set(names))
    parsed = {f.name for f in GPU_FIELDS if f.parse is not None}
    assert parsed == {f.name for f in dataclasses.fields(GPUInfo)} - NOT_ROWS
    assert {f.name for f in GPU_FIELDS} - parsed == {"serial"}  # recorded, not judged
    assert {f.name for f in RECHECK_FIELDS} == {"clocks_event_reasons", "compute_processes"}
    assert LATE_FIELDS[0] == "vbios_version" and LATE_FIELDS[-1] == "app_clock_mem_mhz"
    assert names[names.index("vbios_version"):] == list(LATE_FIELDS)


def test_parse_follows_the_table() -> None:
    snap = load_snapshot(FIXTURES / "h100-healthy" / "nvml.json")
    raw = json.loads((FIXTURES / "h100-healthy" / "nvml.json").read_text())["gpus"][3]
    g = snap.gpus[3]
    assert g == parse_gpu(raw, 3)
    assert g.pci_bus_id == raw["pci_bus_id"] and g.temperature_c == float(raw["temperature_c"])
    assert g.remapped_rows_pending is bool(raw["remapped_rows_pending"])
    # A row's converter drops what it cannot use: the model holds None, never a wrong type.
    bad = parse_gpu({"index": 3, "temperature_c": "hot", "fabric_state": True,
                     "nvlink_state": {"0": 1}, "compute_processes": [{"pid": "x"}]}, 0)
    assert (bad.index, bad.temperature_c, bad.nvlink_state) == (3, None, None)
    assert bad.fabric_state == 1 and bad.compute_processes == ()
    assert FIELDS_BY_NAME["power_w"].record(69800) == 69.8


COUNTING = STANDIN_C.replace("int nvmlInit_v2(void) { return 0; }", r"""
#include <stdio.h>
#include <stdlib.h>
static void mark(const char *what) {
    FILE *f = fopen(getenv("STANDIN_LOG"), "a");
    if (f) { fputs(what, f); fclose(f); }
}
int nvmlInit_v2(void) { mark("init\n"); return 0; }
typedef struct { unsigned int gpu; unsigned int memory; } util;
int nvmlDeviceGetUtilizationRates(dev *h, util *u) { (void)h; u->gpu = 87; u->memory = 40; return 0; }
int nvmlDeviceGetClockInfo(dev *h, int type, unsigned int *mhz) {
    (void)h; if (type != 1) return 2; *mhz = 1755; return 0;
}
""").replace("int nvmlInitWithFlags(unsigned int flags) { (void)flags; return 0; }",
             "int nvmlInit_v2(void);\n"
             "int nvmlInitWithFlags(unsigned int flags) { (void)flags; return nvmlInit_v2(); }"
             ).replace("int nvmlShutdown(void) { return 0; }",
                       "static void mark(const char *what);\n"
                       "int nvmlShutdown(void) { mark(\"shutdown\\n\"); return 0; }")

SAMPLE = """
import json
from bluevela.health.nvml import LiveNVML
snap, activity = LiveNVML(include_kmsg=True, recheck_s=5.0).sample()
print(json.dumps({"gpus": [g.temperature_c for g in snap.gpus], "kmsg": snap.kmsg,
                  "activity": activity}))
"""


def test_a_sample_is_one_nvml_session(tmp_path: Path) -> None:
    pytest.importorskip("pynvml")
    build_standin_nvml(tmp_path, COUNTING)
    log = tmp_path / "calls.log"
    env = dict(os.environ, LD_LIBRARY_PATH=str(tmp_path), PYTHONPATH=str(REPO),
               STANDIN_LOG=str(log))
    p = subprocess.run([sys.executable, "-c", SAMPLE], capture_output=True, text=True,
                       timeout=60, env=env, cwd="/")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert log.read_text() == "init\nshutdown\n"  # 9058adc..cd8e436: two of each per sample
    assert out == {"gpus": [41.0], "kmsg": None,
                   "activity": {"0": {"util_pct": 87.0, "sm_clock_mhz": 1755.0}}}
