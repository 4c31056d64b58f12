"""The hooks' environment: hook.env, Slurm's variables validated, hostile values inert, drains."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bluevela.errors import UnsafeValueError
from bluevela.fleet.nodestate import check_of_reason, passes_for_resume
from bluevela.health.result import CheckResult, HealthReport, Status
from bluevela.hooks.env import (
    HookContext,
    load_hook_env,
    parse_derived,
    parse_exit,
    parse_hook_env,
    read_hook_env,
)
from bluevela.hooks.telemetry import job_telemetry, reading_of
from bluevela.site import Site

REPO = Path(__file__).resolve().parents[2]


def test_hook_env_accepts_only_bv_keys_and_slurm_conf() -> None:
    text = """
# comment
BV_SITE=/etc/bluevela/site.yaml
export BV_NODE_CLASS="h100"
SLURM_CONF='/etc/slurm/slurm.conf'
PATH=/tmp/evil
LD_PRELOAD=/tmp/evil.so
PYTHONPATH=/tmp/evil
bv_lower=x
BV_EMPTY=
not a pair
"""
    assert parse_hook_env(text) == {
        "BV_SITE": "/etc/bluevela/site.yaml",
        "BV_NODE_CLASS": "h100",
        "SLURM_CONF": "/etc/slurm/slurm.conf",
        "BV_EMPTY": "",
    }


def test_hook_env_file_must_be_safe(tmp_path: Path) -> None:
    good = tmp_path / "hook.env"
    good.write_text("BV_NODE_CLASS=h100\n")
    good.chmod(0o644)
    assert read_hook_env(good) == {"BV_NODE_CLASS": "h100"}
    good.chmod(0o666)
    assert read_hook_env(good) == {}  # world-writable: refused
    good.chmod(0o644)
    link = tmp_path / "link.env"
    link.symlink_to(good)
    assert read_hook_env(link) == {}  # a symlink: refused
    assert read_hook_env(tmp_path / "absent") == {}


def test_load_hook_env_sets_path_and_slurm_bin(tmp_path: Path) -> None:
    f = tmp_path / "hook.env"
    f.write_text("BV_SLURM_BIN=/opt/slurm/bin\nSLURM_CONF=/x/slurm.conf\n")
    env: dict[str, str] = {"BV_HOOK_ENV": str(f)}
    load_hook_env(env)
    assert env["SLURM_CONF"] == "/x/slurm.conf"
    assert env["PATH"].split(":")[0] == "/opt/slurm/bin" and "/usr/bin" in env["PATH"]
    env2: dict[str, str] = {"BV_HOOK_ENV": "none", "PATH": "/bin"}
    assert load_hook_env(env2) == {} and env2["PATH"] == "/bin"


def test_exit_status_parsing() -> None:
    assert parse_exit("3:0", "768") == (3, None)
    assert parse_exit(None, "768") == (3, None)  # raw wait status
    assert parse_exit(None, "9") == (None, 9)  # killed by SIGKILL
    assert parse_exit("0:15", None) == (0, 15)
    assert parse_exit("junk", "also junk") == (None, None)
    assert parse_derived("3:0") == 3 and parse_derived("256") == 1 and parse_derived(None) is None


def test_context_validates_node_and_job() -> None:
    ctx = HookContext.from_env("epilog", {
        "SLURMD_NODENAME": "gpu001", "SLURM_JOB_ID": "42", "SLURM_JOB_USER": "al\x1bice",
        "SLURM_NODELIST": "gpu[001-003]", "SLURM_JOB_NUM_NODES": "3",
        "SLURM_JOB_EXIT_CODE2": "3:0", "SLURM_JOB_DERIVED_EC": "768",
    })
    assert ctx.node == "gpu001" and ctx.job_id == 42 and ctx.user == "alice"
    assert ctx.nodelist == ("gpu001", "gpu002", "gpu003") and ctx.num_nodes == 3
    assert ctx.exit_code == 3 and ctx.derived_exit_code == 3
    assert "\x1b" not in ctx.user
    for bad in ({"SLURMD_NODENAME": "../../etc", "SLURM_JOB_ID": "1"},
                {"SLURMD_NODENAME": "n1", "SLURM_JOB_ID": "1;touch /tmp/x"},
                {"SLURMD_NODENAME": "n1", "SLURM_JOB_ID": "$(id)"},
                {"SLURMD_NODENAME": "n1"}):
        with pytest.raises(UnsafeValueError):
            HookContext.from_env("prolog", bad)
    hc = HookContext.from_env("healthcheck", {"SLURMD_NODENAME": "n1"})
    assert hc.job_id is None
    weird = HookContext.from_env("prolog", {"SLURMD_NODENAME": "n1", "SLURM_JOB_ID": "7",
                                            "SLURM_NODELIST": "n[1-2],../x"})
    assert weird.nodelist == ()


def test_owner_controlled_values_are_never_read() -> None:
    """The hooks' code never reads the job owner's variables (so they cannot be words or paths)."""
    owner_vars = ("SLURM_JOB_COMMENT", "SLURM_JOB_WORK_DIR", "SLURM_JOB_STDOUT",
                  "SLURM_JOB_STDERR", "SLURM_JOB_NAME", "SLURM_JOB_EXTRA", "SLURM_JOB_CONSTRAINTS")
    for path in [*(REPO / "bluevela" / "hooks").rglob("*.py"),
                 *(REPO / "bluevela" / "health").rglob("*.py")]:
        code = "\n".join(line for line in path.read_text().splitlines()
                         if not line.lstrip().startswith("#"))
        body = code.split('"""', 2)[-1] if code.lstrip().startswith('"""') else code
        for var in owner_vars:
            assert var not in body, f"{path} mentions {var}"


def test_resume_rules(site: Site) -> None:
    assert check_of_reason(site, "bv: ib: mlx5_3/1 state DOWN") == "ib"
    assert check_of_reason(site, "maint: dimm swap") is None
    assert check_of_reason(site, "bv: something odd") is None
    ok = {"gpu": 0, "ib": 0, "node": 1, "nccl": 3}
    assert passes_for_resume(site, "bv: ib: mlx5_3/1 state DOWN", ok)[0]
    assert not passes_for_resume(site, "bv: ib: x", {**ok, "gpu": 2})[0]  # anything CRITICAL
    assert not passes_for_resume(site, "bv: nccl: busbw low", ok)[0]  # nccl UNKNOWN now
    assert not passes_for_resume(site, "bv: nccl: busbw low", {"ib": 0})[0]  # not re-run
    assert passes_for_resume(site, "bv: odd reason", {"ib": 0, "gpu": 1})[0]
    assert not passes_for_resume(site, "bv: odd reason", {"ib": 0, "gpu": 3})[0]


def test_job_telemetry_deltas() -> None:
    before = HealthReport("quick", (
        CheckResult("gpu", Status.OK, "", {"energy_j": 1000.0, "temp_max_c": 31,
                                            "xid_count": 2, "ecc_uncorrected_volatile_total": 0}),
        CheckResult("ib", Status.OK, "", {"symbol_error_total": 10, "link_downed_total": 5,
                                          "port_xmit_data_bytes": 4000,
                                          "port_xmit_packets_total": 99}),
    ))
    after = HealthReport("quick", (
        CheckResult("gpu", Status.OK, "", {"energy_j": 351000.0, "temp_max_c": 64,
                                            "xid_count": 3, "ecc_uncorrected_volatile_total": 0}),
        CheckResult("ib", Status.OK, "", {"symbol_error_total": 14, "link_downed_total": 1,
                                          "port_xmit_data_bytes": 4_000_004_000,
                                          "port_xmit_packets_total": 199}),
    ))
    t = job_telemetry(reading_of(before, 100.0), after, 160.0)
    assert t == {
        "job_wall_s": 60.0,
        "gpu_energy_j": 350000.0,
        "gpu_temp_max_c": 64,
        "gpu_xid_new_count": 1,
        "gpu_ecc_uncorrected_volatile_increase_count": 0,
        "ib_symbol_error_increase_count": 4,
        "ib_link_downed_increase_count": 1,  # went down: reset, its value is the increase
        "ib_port_xmit_data_bytes": 4_000_000_000,
    }
    assert job_telemetry(None, after, 1.0) == {}


def test_hook_env_default_path_is_etc_bluevela() -> None:
    from bluevela.hooks import env as hook_env

    assert str(hook_env.HOOK_ENV) == "/etc/bluevela/hook.env"
    assert os.path.isabs(hook_env.DEFAULT_PATH.split(":")[0])
