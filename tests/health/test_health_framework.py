"""The check framework: statuses, worst-wins, results, the registry, metrics text."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from bluevela.checks_registry import Check, check, register, unregister
from bluevela.errors import HealthError
from bluevela.health.checks import all_checks, get_check
from bluevela.health.metrics import PROM_FILE, merge_last_results, render, write_prom
from bluevela.health.result import CheckResult, HealthReport, Status, worst


def test_status_values_are_nagios() -> None:
    assert [int(s) for s in (Status.OK, Status.WARNING, Status.CRITICAL, Status.UNKNOWN)] == [0, 1, 2, 3]
    assert Status.parse("critical") is Status.CRITICAL
    assert Status.parse(3) is Status.UNKNOWN


@pytest.mark.parametrize(
    ("statuses", "expected"),
    [
        ([], Status.OK),
        ([Status.OK, Status.WARNING], Status.WARNING),
        ([Status.WARNING, Status.UNKNOWN], Status.UNKNOWN),
        # Nagios host verdict: CRITICAL outranks UNKNOWN although its value is smaller.
        ([Status.UNKNOWN, Status.CRITICAL], Status.CRITICAL),
        ([Status.CRITICAL, Status.UNKNOWN, Status.OK], Status.CRITICAL),
    ],
)
def test_worst_is_by_severity_not_value(statuses: list[Status], expected: Status) -> None:
    assert worst(statuses) is expected


def test_report_exit_code_is_worst_status() -> None:
    rep = HealthReport("quick", (CheckResult("a", Status.UNKNOWN, "x"),
                                 CheckResult("b", Status.CRITICAL, "port down")))
    assert rep.status is Status.CRITICAL and rep.exit_code == 2
    assert rep.drain_detail() == "b: port down"
    assert HealthReport("quick", (CheckResult("a", Status.UNKNOWN, "x"),)).exit_code == 3


def test_check_result_is_frozen_and_cleans_metrics() -> None:
    r = CheckResult("gpu", Status.OK, "  two\nlines ", {"temp_max_c": 31, "flag": True,
                                                        "bad name": 1.0, "nan_c": float("nan")})
    assert r.summary == "two lines"
    assert r.metrics == {"temp_max_c": 31.0, "flag": 1.0}
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.status = Status.CRITICAL  # type: ignore[misc]
    again = CheckResult.from_dict(r.to_dict())
    assert again == r
    assert r.to_dict()["status"] == "OK" and r.to_dict()["status_code"] == 0


def test_registry_refuses_duplicates() -> None:
    names = set(all_checks())
    assert {"gpu", "ib", "node", "nccl"} <= names
    assert get_check("nccl").noisy and not get_check("ib").noisy
    with pytest.raises(HealthError, match="registered twice"):
        register(Check("ib", probe=lambda ctx: None, evaluate=lambda f, c: None))  # type: ignore[arg-type,return-value]
    with pytest.raises(HealthError, match="registered twice"):
        @check("gpu", probe=lambda ctx: None)
        def again(facts: object, cls: object) -> CheckResult:  # pragma: no cover
            raise AssertionError

    with pytest.raises(HealthError, match=r"known: (dcgm, )?gpu, ib, nccl, node"):
        get_check("nope")


def test_register_and_unregister_a_throwaway_check() -> None:
    @check("tmp_framework_check", probe=lambda ctx: 5)
    def evaluate(facts: int, cls: object) -> CheckResult:
        """A throwaway."""
        return CheckResult("tmp_framework_check", Status.OK, f"got {facts}")

    try:
        chk = get_check("tmp_framework_check")
        assert chk.doc == "A throwaway."
        assert chk.evaluate(5, None).summary == "got 5"  # type: ignore[arg-type]
    finally:
        unregister("tmp_framework_check")
    assert "tmp_framework_check" not in all_checks()


def test_the_builtin_table_names_exactly_the_builtin_checks() -> None:
    """Site validation reads `BUILTIN_CHECKS` and imports no check: every name there is a
    check its module registers, and every check of the built-in package is there."""
    from bluevela.checks_registry import BUILTIN_CHECKS, BUILTIN_PACKAGE

    builtin = {n: c.evaluate.__module__ for n, c in all_checks().items()
               if c.evaluate.__module__.startswith(f"{BUILTIN_PACKAGE}.")}
    assert builtin == BUILTIN_CHECKS


def test_a_builtin_check_missing_from_the_table_is_refused() -> None:
    from bluevela.checks_registry import BUILTIN_PACKAGE, known_names

    def evaluate(facts: object, cls: object) -> CheckResult:  # pragma: no cover
        raise AssertionError

    evaluate.__module__ = f"{BUILTIN_PACKAGE}.newcheck"
    with pytest.raises(HealthError, match="not in checks_registry.BUILTIN_CHECKS"):
        check("newcheck", probe=lambda ctx: None)(evaluate)
    assert "newcheck" not in all_checks() and "newcheck" not in known_names()


def test_validating_a_site_imports_no_check(tmp_path: Path) -> None:
    """A site.yaml's tiers are checked against the registry's table: parsing one (a typo
    refused, a good file accepted) imports nothing of `bluevela.health`."""
    site = tmp_path / "site.yaml"
    site.write_text(_site_text())
    bad = tmp_path / "bad.yaml"
    bad.write_text(_site_text(tiers="{quick: {checks: [gpu, ibb], cap_s: 5, check_timeout_s: 3}}"))
    code = ("import sys\n"
            "from bluevela.errors import SiteConfigError\n"
            "from bluevela.site_file import parse_site\n"
            "from pathlib import Path\n"
            f"p = Path({str(site)!r})\n"
            "parse_site(p.read_text(), p)\n"
            f"b = Path({str(bad)!r})\n"
            "try:\n    parse_site(b.read_text(), b)\nexcept SiteConfigError as e:\n"
            "    assert 'ibb' in str(e), e\nelse:\n    raise SystemExit('ibb accepted')\n"
            "print(sorted(m for m in sys.modules if m.startswith('bluevela.health')))\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=REPO, timeout=120, check=False)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]"


def test_prometheus_text(tmp_path: Path) -> None:
    rep = HealthReport("quick", (
        CheckResult("ib", Status.CRITICAL, "mlx5_3/1 state DOWN", {"symbol_error_total": 3},
                    duration_s=0.01),
        CheckResult("gpu", Status.OK, "ok", {"temp_max_c": 33.5}),
    ))
    merged = merge_last_results(tmp_path, rep, "prolog")
    later = HealthReport("quick", (CheckResult("gpu", Status.WARNING, "warm", {"temp_max_c": 80}),))
    merged = merge_last_results(tmp_path, later, "epilog")
    assert merged["ib"]["status_code"] == 2  # kept from the earlier run
    text = render(merged)
    assert 'bluevela_check_status{check="ib"} 2' in text
    assert 'bluevela_check_status{check="gpu"} 1' in text
    assert "bluevela_node_status 2" in text
    assert "bluevela_ib_symbol_error_total 3" in text
    assert "bluevela_gpu_temp_max_celsius 80" in text
    assert "# TYPE bluevela_gpu_temp_max_celsius gauge" in text
    assert "# TYPE bluevela_ib_symbol_error_total counter" in text
    path = write_prom(tmp_path / "metrics", merged)
    assert path == tmp_path / "metrics" / PROM_FILE and path.read_text() == text
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".")]  # no temp left


# -- node state: who may change it, and which site settings it relies on --------------------

REPO = Path(__file__).resolve().parents[2]


def _site_text(**health: str) -> str:
    """The repo's site.yaml with some `health:` keys replaced (YAML flow values)."""
    import yaml

    data = yaml.safe_load((REPO / "site.yaml").read_text())
    for key, value in health.items():
        data["health"][key] = yaml.safe_load(value)
    return yaml.safe_dump(data)


@pytest.mark.parametrize("prefix", ["", "bv", " bv:", "b v:", ":", "12:", "bv: "])
def test_drain_prefix_must_be_distinctive(prefix: str, tmp_path: Path) -> None:
    """`drain_prefix: ""` made every operator's drain count as ours (resumed, counted by the
    breaker); a prefix must be non-empty, contain a letter, end with ':', no whitespace."""
    from bluevela.errors import SiteConfigError
    from bluevela.site_file import parse_site

    with pytest.raises(SiteConfigError, match="drain_prefix"):
        parse_site(_site_text(drain_prefix=repr(prefix)), tmp_path / "site.yaml")
    ok = parse_site(_site_text(drain_prefix="'site-bv:'"), tmp_path / "site.yaml")
    assert ok.health.drain_prefix == "site-bv:"


def test_unknown_check_in_a_tier_is_a_validation_error(tmp_path: Path) -> None:
    """A typo in a tier (`ibb`) used to validate, and the hooks then ran without that check."""
    from bluevela.errors import SiteConfigError
    from bluevela.site_file import parse_site

    tiers = ("{quick: {checks: [gpu, ibb, node], cap_s: 5, check_timeout_s: 3}, "
             "full: {checks: [gpu, ib, node, nccl], cap_s: 180, check_timeout_s: 120}}")
    with pytest.raises(SiteConfigError, match=r"unknown check\(s\) 'ibb' \(known: (dcgm, )?gpu, ib,") as e:
        parse_site(_site_text(tiers=tiers), tmp_path / "site.yaml")
    assert "health.tiers.quick.checks" in str(e.value)


def test_nightly_drain_is_not_resumed_by_passing_health_checks() -> None:
    """The hourly healthcheck resumed `bv: nightly <date>: ...` drains once gpu/ib/node/nccl
    passed, without re-measuring what the nightly found."""
    from bluevela.fleet.nodestate import passes_for_resume
    from bluevela.site import load_site

    site = load_site(REPO / "site.yaml")
    ok = {"gpu": 0, "ib": 0, "node": 0, "nccl": 0}
    reason = "bv: nightly 2026-11-25: gemm 512.0 TFLOP/s < floor 700"
    passes, why = passes_for_resume(site, reason, ok)
    assert not passes and "nightly" in why and "bv health resume" in why
    assert passes_for_resume(site, "bv: ib: mlx5_3/1 state DOWN", ok)[0]


def test_checks_never_import_the_node_state_module() -> None:
    """Checks judge; hooks, the nightly and `bv health resume` act. No module under
    bluevela/health/checks imports bluevela.fleet.nodestate (directly or through what it imports)."""
    import ast
    import subprocess
    import sys

    for path in (REPO / "bluevela" / "health" / "checks").rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for name in names:
                assert not name.startswith("bluevela.fleet.nodestate"), f"{path} imports {name}"
                assert "drain" not in name, f"{path} imports {name}"
    code = ("import sys, bluevela.health.checks, bluevela.health.runner; "
            "print('bluevela.fleet.nodestate' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=REPO).stdout.strip()
    assert out == "False"
