"""`dcgm`: NVIDIA DCGM diagnostics (`dcgmi diag -r <level> -j`) as a check result.

DCGM is NVIDIA's own (not on PyPI or Debian): the probe runs `<root>/usr/bin/dcgmi` (where
the datacenter-gpu-manager package installs it; on a real node also found on PATH) as an argv
list with the context's level (1: seconds, 2: about 2 min, 3: about 30 min, 4: hours) and
parses its JSON. It runs in the runner's killable child: the level's timeout kills dcgmi with
the child's process group. Absent DCGM, or a host engine that does not answer, is UNKNOWN (and
logged), never OK: nothing was diagnosed.

Where it runs is the site's `health.dcgm` (`bluevela.site.DcgmOptions`), by purpose
(bluevela/health/dcgm_runs.py):
- `healthcheck_level`: added to the healthcheck hook's run (`with_purpose`);
- `before_resume_level`: run before bluevela resumes a node it drained (the healthcheck's
  auto-resume and `bv health resume` on the node; `bluevela.fleet.nodestate.resume_if_passing`);
- `nightly_level`: a step of each node's nightly job (`bv health dcgm`), a failure drains it
  `bv: nightly <date>: dcgm: diag r3 GPU 3 memory failed: ...`.
A tier may also name `dcgm`; it then runs at `node.dcgm_level`.

Two JSON shapes are read (both from NVIDIA's documented/emitted format):
- DCGM 3.x: `{"DCGM GPU Diagnostic": {"test_categories": [{"category", "tests": [{"name",
  "results": [{"gpu_ids": "0,1", "status": "Pass", "warnings": [{"warning", "error_id",
  "error_category", "error_severity"}], "info": ...}]}]}]}, "version": ...}`;
- DCGM 4.x: `{"DCGM Diagnostic": {"test_categories": [... "results": [{"entity_group":
  "GPU", "entity_id": 0, "status": "Fail", "warnings": [...]}], "test_summary": ...}]}}`.
A warning may also be a plain string. Statuses are compared case-insensitively (Pass, Fail,
Warn, Skip, Not Run).

Verdicts: a result `Fail` is CRITICAL, unless every warning of it has severity CONFIG
(dcgm_errors.h `DCGM_ERROR_CONFIG` = 5: e.g. persistence mode off), which is a WARNING (a
fleet-wide configuration slip must not drain the fleet); `Warn` is WARNING; `Skip`/`Not Run`
are counted only.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bluevela.checks_registry import check
from bluevela.health.result import CheckResult, Status, summarize

if TYPE_CHECKING:
    from bluevela.health.context import ProbeContext
    from bluevela.site import NodeClass

logger = logging.getLogger(__name__)

DCGMI = "usr/bin/dcgmi"
SEVERITY_CONFIG = 5  # dcgm_errors.h: DCGM_ERROR_CONFIG
TOP_KEYS = ("DCGM Diagnostic", "DCGM GPU Diagnostic")


@dataclass(frozen=True)
class DiagResult:
    category: str
    test: str
    status: str  # lower case: pass, fail, warn, skip, not run
    gpus: str  # "0", "0,1", "" (the node)
    warnings: tuple[str, ...] = ()
    config_only: bool = False  # every warning has severity CONFIG


@dataclass(frozen=True)
class DcgmFacts:
    level: int
    available: bool
    results: tuple[DiagResult, ...] = ()
    version: str | None = None
    error: str | None = None


def _warnings(items: Any) -> tuple[tuple[str, ...], bool]:
    texts: list[str] = []
    severities: list[Any] = []
    for w in items if isinstance(items, list) else []:
        if isinstance(w, str):
            texts.append(w)
            severities.append(None)
        elif isinstance(w, dict):
            texts.append(str(w.get("warning") or w.get("message") or "").strip())
            severities.append(w.get("error_severity"))
    config_only = bool(severities) and all(s == SEVERITY_CONFIG for s in severities)
    return tuple(t for t in texts if t), config_only


def parse_diag(text: str) -> tuple[tuple[DiagResult, ...], str | None]:
    """Results and the DCGM version from `dcgmi diag -j` output.

    Raises:
        ValueError: not JSON, or no test categories in it.
    """
    start = text.find("{")
    data = json.loads(text[start:] if start >= 0 else text)
    body = next((data[k] for k in TOP_KEYS if isinstance(data, dict) and k in data), None)
    cats = body.get("test_categories") if isinstance(body, dict) else None
    if not isinstance(cats, list):
        raise ValueError("no test_categories in the diagnostic output")
    version = data.get("version") or (body.get("version") if isinstance(body, dict) else None)
    out: list[DiagResult] = []
    for cat in cats:
        if not isinstance(cat, dict):
            continue
        for t in cat.get("tests") or []:
            if not isinstance(t, dict):
                continue
            for r in t.get("results") or []:
                if not isinstance(r, dict):
                    continue
                if "gpu_ids" in r:
                    gpus = str(r["gpu_ids"])
                elif r.get("entity_group", "GPU") == "GPU" and "entity_id" in r:
                    gpus = str(r["entity_id"])
                else:
                    gpus = ""
                warns, config_only = _warnings(r.get("warnings"))
                out.append(DiagResult(str(cat.get("category", "")), str(t.get("name", "?")),
                                      str(r.get("status", "")).strip().lower(), gpus, warns,
                                      config_only))
    return tuple(out), str(version) if version is not None else None


def find_dcgmi(ctx: ProbeContext) -> Path | None:
    """`<root>/usr/bin/dcgmi`; on a real root (`/`) also dcgmi on PATH (or the default path)."""
    dcgmi = ctx.under_root(DCGMI)
    if os.access(dcgmi, os.X_OK):
        return dcgmi
    if ctx.root == Path("/"):
        found = shutil.which("dcgmi", path=os.environ.get("PATH") or os.defpath)
        if found:
            return Path(found)
    return None


def probe_dcgm(ctx: ProbeContext) -> DcgmFacts:
    level = ctx.node_class.node.dcgm_level
    dcgmi = find_dcgmi(ctx)
    if dcgmi is None:
        where = ctx.under_root(DCGMI)
        logger.warning("dcgm diag r%d asked for, but DCGM is not installed (%s not found)",
                       level, where)
        return DcgmFacts(level, available=False, error=f"DCGM not installed ({where} not found)")
    try:
        proc = subprocess.run([str(dcgmi), "diag", "-r", str(level), "-j"], capture_output=True,
                              text=True, check=False, stdin=subprocess.DEVNULL)
    except OSError as exc:
        return DcgmFacts(level, available=False, error=f"cannot run {dcgmi}: {exc.strerror or exc}")
    # dcgmi exits non-zero when a test fails: the JSON decides; no JSON is our failure.
    try:
        results, version = parse_diag(proc.stdout)
    except ValueError:
        tail = (proc.stderr.strip() or proc.stdout.strip() or f"exit {proc.returncode}")
        logger.warning("dcgmi diag -r %d gave no diagnostic: %s", level, tail[-200:])
        return DcgmFacts(level, available=True,
                         error=f"dcgmi diag gave no diagnostic: {tail.splitlines()[-1][:200]}")
    return DcgmFacts(level, True, results, version)


def _gpu_label(gpus: str) -> str:
    return f"GPU {gpus} " if gpus and "," not in gpus else f"GPUs {gpus} " if gpus else ""


def dcgm_timed_out(seconds: float, cls: NodeClass) -> CheckResult:
    """Killed at its timeout: UNKNOWN (nothing was diagnosed), saying which level hung."""
    return CheckResult("dcgm", Status.UNKNOWN,
                       f"diag r{cls.node.dcgm_level}: no result in {seconds:g} s, dcgmi killed",
                       {"level": cls.node.dcgm_level})


@check("dcgm", probe=probe_dcgm, on_timeout=dcgm_timed_out)
def evaluate_dcgm(facts: DcgmFacts, cls: NodeClass) -> CheckResult:
    """DCGM diagnostics (dcgmi diag -r LEVEL -j); absent DCGM is UNKNOWN."""
    if facts.error:
        return CheckResult("dcgm", Status.UNKNOWN, facts.error, {"level": facts.level})
    problems: list[tuple[Status, str]] = []
    counts: dict[str, int] = {}
    for r in facts.results:
        counts[r.status] = counts.get(r.status, 0) + 1
        why = f": {r.warnings[0]}" if r.warnings else ""
        if r.status == "fail":
            status = Status.WARNING if r.config_only else Status.CRITICAL
            problems.append((status, f"diag r{facts.level} {_gpu_label(r.gpus)}{r.test} "
                             f"failed{why}"))
        elif r.status == "warn":
            problems.append((Status.WARNING, f"diag r{facts.level} {_gpu_label(r.gpus)}{r.test} "
                             f"warned{why}"))
    metrics: dict[str, float] = {
        "level": facts.level,
        "results_count": len(facts.results),
        "failed_count": counts.get("fail", 0),
        "warned_count": counts.get("warn", 0),
        "skipped_count": counts.get("skip", 0) + counts.get("not run", 0),
    }
    if not facts.results:
        return CheckResult("dcgm", Status.UNKNOWN, f"diag r{facts.level}: no test results",
                           metrics)
    status, summary = summarize(problems)
    if summary is None:
        summary = (f"diag r{facts.level}: {counts.get('pass', 0)} passed, "
                   f"{metrics['skipped_count']:g} skipped"
                   + (f" (DCGM {facts.version})" if facts.version else ""))
    return CheckResult("dcgm", status, summary, metrics)

