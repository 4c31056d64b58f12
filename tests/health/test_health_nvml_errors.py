"""NVML's own errors are null fields; a misspelt NVML function is a bug that shows (issue 23 §6).

The live gather runs the real pynvml binding (nvidia-ml-py) against a stand-in
`libnvidia-ml.so.1` built here from C and found first through LD_LIBRARY_PATH, as the driver's
library is found through ld.so.cache: it answers a few calls (one GPU, its temperature),
refuses one as NVML does (`nvmlDeviceGetPowerUsage`: NOT_SUPPORTED) and lacks the rest, as an
older driver lacks newer functions (pynvml: `NVMLError_FunctionNotFound`, or for an
unversioned call in nvidia-ml-py 13 `NVMLLibraryMismatchError`). Each of those is a null field
with NVML's text. A name the binding does not have (a typo in bluevela; here the
binding's `nvmlDeviceGetTemperature` deleted before the gather, which is what a misspelt
`nv.nvmlDeviceGetTemprature` meets) raises AttributeError: 9058adc caught it and wrote a
field that was always null. In a health check the exception is an UNKNOWN "crashed" result
(the runner's rule), never a drain.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import build_standin_nvml

pynvml = pytest.importorskip("pynvml")

REPO = Path(__file__).resolve().parents[2]

STANDIN_C = r"""
#include <string.h>
typedef struct { int id; } dev;
static dev gpu0 = {0};
int nvmlInitWithFlags(unsigned int flags) { (void)flags; return 0; }
int nvmlInit_v2(void) { return 0; }
int nvmlShutdown(void) { return 0; }
const char *nvmlErrorString(int r) {
    switch (r) {
    case 3: return "Not Supported";
    case 13: return "Function Not Found";
    default: return "Unknown Error";
    }
}
int nvmlSystemGetDriverVersion(char *buf, unsigned int len) {
    strncpy(buf, "550.54.15", len); return 0;
}
int nvmlDeviceGetCount_v2(unsigned int *n) { *n = 1; return 0; }
int nvmlDeviceGetHandleByIndex_v2(unsigned int i, dev **h) {
    if (i != 0) return 2;
    *h = &gpu0; return 0;
}
int nvmlDeviceGetTemperature(dev *h, int sensor, unsigned int *t) {
    (void)h; (void)sensor; *t = 41; return 0;
}
int nvmlDeviceGetPowerUsage(dev *h, unsigned int *mw) { (void)h; (void)mw; return 3; }
#ifdef WITH_PROCS_V3
int nvmlDeviceGetComputeRunningProcesses_v3(dev *h, unsigned int *n, void *infos) {
    (void)h; (void)infos; *n = 0; return 0;
}
#endif
"""

GATHER = """
import json, sys
import pynvml
from bluevela.health.nvml_live import gather_live
if sys.argv[1] == "typo":
    del pynvml.nvmlDeviceGetTemperature
print(json.dumps(gather_live(include_kmsg=False, raise_init_error=True)))
"""


def _build(tmp_path_factory: pytest.TempPathFactory, *flags: str) -> Path:
    return build_standin_nvml(tmp_path_factory.mktemp("nvml-standin"), STANDIN_C, *flags)


@pytest.fixture(scope="module")
def standin_lib(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A driver without nvmlDeviceGetComputeRunningProcesses_v3."""
    return _build(tmp_path_factory)


@pytest.fixture(scope="module")
def standin_lib_v3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A driver with it (no process running)."""
    return _build(tmp_path_factory, "-DWITH_PROCS_V3")


def _gather(lib: Path, mode: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, LD_LIBRARY_PATH=str(lib), PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-c", GATHER, mode], capture_output=True,
                          text=True, timeout=60, env=env, cwd="/")


def test_nvml_errors_are_null_fields_with_nvmls_text(standin_lib: Path) -> None:
    p = _gather(standin_lib, "plain")
    assert p.returncode == 0, p.stderr
    out: dict[str, Any] = json.loads(p.stdout)
    assert out["driver_version"] == "550.54.15" and out["device_count"] == 1
    g = out["gpus"][0]
    assert g["temperature_c"] == 41
    assert g["power_w"] is None and g["errors"]["power_w"] == "Not Supported"
    assert g["serial"] is None and g["errors"]["serial"] == "Function Not Found"
    assert out["nvml_version"] is None
    assert out["errors"]["nvml_version"] == "Function Not Found"
    # nvidia-ml-py 13 raises NVMLLibraryMismatchError (not an NVMLError) for an unversioned
    # call whose versioned function the driver lacks: NVML's too, a null field (9058adc: the
    # whole gather raised)
    assert g["compute_processes"] is None
    if hasattr(pynvml, "NVMLLibraryMismatchError"):
        assert g["errors"].pop("compute_processes").startswith("Unversioned function called")
    # every other error text is NVML's own: no Python exception was taken for a missing value
    texts = [*out["errors"].values(), *g["errors"].values()]
    assert texts and all(t in ("Not Supported", "Function Not Found") for t in texts), texts


def test_a_name_the_binding_lacks_raises(standin_lib_v3: Path) -> None:
    p = _gather(standin_lib_v3, "plain")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["gpus"][0]["compute_processes"] == []
    p = _gather(standin_lib_v3, "typo")
    assert p.returncode == 1, p.stdout[-400:]  # 9058adc: exit 0, temperature_c null
    last = p.stderr.strip().splitlines()[-1]
    assert last == "AttributeError: module 'pynvml' has no attribute 'nvmlDeviceGetTemperature'"


def test_the_call_wrapper_catches_only_nvmls_errors() -> None:
    from bluevela.health.nvml_fields import guarded_call

    where: dict[str, str] = {}
    # the library not loaded: pynvml raises its own NVMLError_Uninitialized
    assert guarded_call(pynvml, where, "device_count", pynvml.nvmlDeviceGetCount) is None
    assert where == {"device_count": "Uninitialized"}
    with pytest.raises(AttributeError):
        guarded_call(pynvml, where, "temperature_c",
                   lambda: pynvml.nvmlDeviceGetTemprature(None, 0))
    with pytest.raises(TypeError):
        guarded_call(pynvml, where, "temperature_c", lambda: pynvml.nvmlDeviceGetTemperature())
    assert where == {"device_count": "Uninitialized"}


def test_every_nvml_name_used_unguarded_is_in_the_binding() -> None:
    """A typo is caught here, without a GPU: each `nv.<name>` that nvml_fields.py and
    nvml_live.py call and each NVML_* constant their tables name exist in the installed pynvml (those looked up with
    getattr/hasattr and a fallback, for older bindings, are not `nv.<name>`)."""
    src = "".join((REPO / "bluevela" / "health" / f"{m}.py").read_text()
                  for m in ("nvml_fields", "nvml_live"))
    names = set(re.findall(r"\bnv\.(\w+)", src)) | set(re.findall(r'"(NVML_\w+)"', src))
    assert len(names) > 40
    assert sorted(n for n in names if not hasattr(pynvml, n)) == []
