"""prolog_epilog/bv-sampler.service: systemd's own verifier and security review, and the
sampler under the W^X rule that MemoryDenyWriteExecute= imposes.

`systemd-analyze verify` needs the ExecStart binary to exist: it runs on a temporary copy of
the unit whose ExecStart is this checkout's prolog_epilog/sampler (the shim installed as
/opt/bluevela/prolog_epilog/sampler); nothing else in the copy changes.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
UNIT = REPO / "prolog_epilog" / "bv-sampler.service"
H100 = REPO / "tests" / "data" / "health" / "h100-healthy"

pytestmark = pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                                reason="systemd-analyze not installed (package systemd)")


def _unit_copy(tmp: Path, text: str | None = None) -> Path:
    text = UNIT.read_text() if text is None else text
    text = re.sub(r"(?m)^ExecStart=.*$", f"ExecStart={REPO / 'prolog_epilog' / 'sampler'}", text)
    path = tmp / "bv-sampler.service"
    path.write_text(text)
    return path


def _verify(unit: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["systemd-analyze", "verify", "--man=no", str(unit)],
                          capture_output=True, text=True, timeout=60)


def test_unit_verifies_without_a_warning(tmp_path: Path) -> None:
    p = _verify(_unit_copy(tmp_path))
    about_unit = [ln for ln in (p.stdout + p.stderr).splitlines() if "bv-sampler" in ln]
    assert p.returncode == 0 and not about_unit, p.stdout + p.stderr
    # The check can fail: a misspelt hardening key is reported.
    bad = _verify(_unit_copy(tmp_path, UNIT.read_text().replace(
        "[Service]\n", "[Service]\nProtectKernelTunabels=yes\n")))
    assert "ProtectKernelTunabels" in bad.stdout + bad.stderr


def test_unit_is_hardened_and_has_a_watchdog(tmp_path: Path) -> None:
    keys: dict[str, list[str]] = {}
    for line in UNIT.read_text().splitlines():
        if "=" in line and not line.startswith("#"):
            k, _, v = line.partition("=")
            keys.setdefault(k.strip(), []).append(v.strip())
    assert keys["Type"] == ["notify"] and int(keys["WatchdogSec"][0]) >= 30
    assert keys["CapabilityBoundingSet"] == ["CAP_SYSLOG"]
    assert keys["RestrictAddressFamilies"] == ["AF_UNIX"]
    assert keys["ReadWritePaths"] == ["/var/lib/bluevela"] and keys["ProtectSystem"] == ["strict"]
    assert "ProtectKernelLogs" not in keys  # it would take /dev/kmsg (the XIDs) away
    p = subprocess.run(["systemd-analyze", "security", "--offline=yes", "--no-pager",
                        str(_unit_copy(tmp_path))], capture_output=True, text=True, timeout=60)
    m = re.search(r"Overall exposure level for \S+: ([0-9.]+)", p.stdout + p.stderr)
    assert m is not None, p.stdout + p.stderr
    assert float(m.group(1)) <= 3.0, p.stdout  # systemd's scale: 0 best, 10 worst (was 9.0)


MDWE_C = r"""
#include <stdio.h>
#include <sys/prctl.h>
#include <unistd.h>
/* PR_SET_MDWE (Linux 6.3): no mapping may become writable and executable, the rule that
   systemd's MemoryDenyWriteExecute= enforces with a seccomp filter. */
int main(int argc, char **argv) {
    (void)argc;
    if (prctl(65, 1, 0, 0, 0) != 0) { perror("prctl(PR_SET_MDWE)"); return 77; }
    execv(argv[1], argv + 1);
    perror("execv");
    return 1;
}
"""


def test_sampler_and_pynvml_run_under_memory_deny_write_execute(tmp_path: Path) -> None:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    (tmp_path / "mdwe.c").write_text(MDWE_C)
    subprocess.run([cc, "-o", str(tmp_path / "mdwe"), str(tmp_path / "mdwe.c")], check=True,
                   timeout=60)
    probe = subprocess.run([str(tmp_path / "mdwe"), sys.executable, "-c", "pass"],
                           capture_output=True, text=True, timeout=60)
    if probe.returncode == 77:
        pytest.skip(f"kernel without PR_SET_MDWE: {probe.stderr.strip()}")
    # The rule is in force: an anonymous W+X mapping is refused.
    wx = subprocess.run([str(tmp_path / "mdwe"), sys.executable, "-c",
                         "import mmap; mmap.mmap(-1, 4096, prot=7)"],
                        capture_output=True, text=True, timeout=60)
    assert wx.returncode != 0 and "PermissionError" in wx.stderr, wx.stderr
    # ctypes (pynvml's loader, with a callback made as ctypes itself makes one at import) and
    # one sample of the sampler on live NVML (where a driver is installed, its libnvidia-ml loads
    # under the rule too; without one the sampler warns and samples the rest).
    code = ("import ctypes, pynvml; assert ctypes.CFUNCTYPE(ctypes.c_int)(lambda: 7)() == 7\n"
            "from bluevela.telemetry.sampler import main; raise SystemExit(main(['--once']))")
    env = dict(os.environ, BV_HOOK_ENV="none", BV_SITE=str(REPO / "site.yaml"),
               BV_CACHE_DIR="off", BV_NODE_CLASS="h100", BV_SYSFS_ROOT=str(H100 / "root"),
               BV_NVML_SNAPSHOT="", BV_STATE_DIR=str(tmp_path), BV_SAMPLER_INTERVAL_S="0.2",
               PYTHONPATH=str(REPO))
    p = subprocess.run([str(tmp_path / "mdwe"), sys.executable, "-c", code], env=env, cwd="/",
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    assert '"ib.mlx5_0/1.rx_bytes_per_s": 0.0' in p.stdout, p.stdout
