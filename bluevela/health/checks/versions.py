"""`versions`: the software and firmware a node runs, against the pins of its class.

Observed (each through the probe roots, so tests and the dev cluster point them at fixtures):

- `driver`: the NVIDIA driver version (NVML `nvmlSystemGetDriverVersion`);
- `cuda`: the CUDA driver API version the driver supports ("12.4"; NVML
  `nvmlSystemGetCudaDriverVersion` gives 12040);
- `vbios`: every GPU's VBIOS (`nvmlDeviceGetVbiosVersion`);
- `hca_fw`: every HCA's firmware, `<root>/sys/class/infiniband/<hca>/fw_ver`;
- `kernel`: `<root>/proc/sys/kernel/osrelease`.

With `BV_NVML_SNAPSHOT` the NVML values come from the snapshot file; live, the probe opens
NVML for these three calls only (no per-GPU health reads: the gpu check does those).

Pinned in site.yaml per node class (`versions:`, docs/site-yaml.md): each field an exact
string or a list of allowed ones. A node that differs is WARNING, CRITICAL for the fields the
class names in `versions.critical` (`bv: versions: kernel 6.1.0-17-amd64, pinned
6.1.0-18-amd64`). A pinned field that could not be read is UNKNOWN. GPUs (or HCAs) of one node
that disagree among themselves are WARNING even where nothing is pinned. The observed strings
travel as the result's `info` (spool report, last_results.json, Prometheus
`bluevela_versions_info`), which `bv health nodes --versions` compares across the fleet.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from bluevela.checks_registry import check
from bluevela.health.result import CheckResult, Status, summarize

if TYPE_CHECKING:
    from bluevela.health.context import ProbeContext
    from bluevela.site import NodeClass

logger = logging.getLogger(__name__)

SYSFS_IB = "sys/class/infiniband"
OSRELEASE = "/proc/sys/kernel/osrelease"
FIELDS = ("driver", "cuda", "vbios", "hca_fw", "kernel")
_MAX_TEXT = 128  # a version string longer than this is not one


@dataclass(frozen=True)
class VersionFacts:
    """What the node runs. Per-component fields are `(component, version)` pairs; `errors`
    says why a field could not be read (field -> message)."""

    driver: str | None = None
    cuda: str | None = None
    vbios: tuple[tuple[str, str], ...] = ()
    hca_fw: tuple[tuple[str, str], ...] = ()
    kernel: str | None = None
    errors: dict[str, str] = field(default_factory=dict)

    def values(self, name: str) -> tuple[tuple[str, str], ...]:
        """`(component, version)` pairs of field `name` ("" as the component of a node-wide
        field); empty when unread."""
        got = getattr(self, name)
        if isinstance(got, tuple):
            return got
        return (("", got),) if got else ()


def cuda_text(value: Any) -> str | None:
    """NVML's CUDA driver version (12040) as CUDA writes it ("12.4"); a string is kept."""
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, int):
        return f"{value // 1000}.{value % 1000 // 10}" if value > 0 else None
    text = str(value).strip()
    return text or None


def _clean(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, bytes):
        value = value.decode(errors="replace")
    text = " ".join(str(value).split())
    return text[:_MAX_TEXT] or None


def read_hca_fw(ctx: ProbeContext) -> tuple[tuple[tuple[str, str], ...], str | None]:
    """Every HCA's fw_ver under the root; (pairs, error)."""
    base = ctx.under_root(SYSFS_IB)
    try:
        hcas = sorted(os.listdir(base))
    except FileNotFoundError:
        return (), None  # no InfiniBand on this node
    except OSError as exc:
        return (), f"cannot list {base}: {exc.strerror or exc}"
    out: list[tuple[str, str]] = []
    bad: list[str] = []
    for hca in hcas:
        try:
            text = _clean((base / hca / "fw_ver").read_text(errors="replace"))
        except OSError as exc:
            bad.append(f"{hca}: {exc.strerror or exc}")
            continue
        if text:
            out.append((hca, text))
    return tuple(out), ("; ".join(bad) if bad else None)


def read_nvml_versions(ctx: ProbeContext) -> tuple[str | None, str | None,
                                                   tuple[tuple[str, str], ...], str | None]:
    """(driver, cuda, vbios pairs, error) from the snapshot or from live NVML."""
    if ctx.nvml_snapshot is not None:
        from bluevela.health.nvml_snapshot import load_snapshot

        try:
            snap = load_snapshot(ctx.nvml_snapshot)
        except (OSError, ValueError) as exc:
            return None, None, (), f"{type(exc).__name__}: {exc}"
        if snap.init_error:
            return None, None, (), f"NVML: {snap.init_error}"
        vbios = tuple((f"GPU{g.index}", v) for g in snap.gpus
                      if (v := _clean(getattr(g, "vbios_version", None))))
        return (_clean(snap.driver_version), cuda_text(getattr(snap, "cuda_driver_version", None)),
                vbios, None)
    return _live_nvml()


def _live_nvml() -> tuple[str | None, str | None, tuple[tuple[str, str], ...], str | None]:
    try:
        import pynvml as nv
    except ImportError as exc:
        return None, None, (), f"pynvml not installed: {exc}"
    try:
        nv.nvmlInit()
    except Exception as exc:  # noqa: BLE001 - NVMLError and its many subclasses
        return None, None, (), f"NVML init failed: {exc}"
    errors: list[str] = []

    def call(what: str, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except Exception as exc:  # noqa: BLE001
            errors.append(f"{what}: {exc}")
            return None

    try:
        driver = _clean(call("driver", nv.nvmlSystemGetDriverVersion))
        cuda = cuda_text(call("cuda", nv.nvmlSystemGetCudaDriverVersion))
        count = call("device count", nv.nvmlDeviceGetCount) or 0
        vbios: list[tuple[str, str]] = []
        for i in range(int(count)):
            handle = call(f"GPU{i}", nv.nvmlDeviceGetHandleByIndex, i)
            if handle is not None:
                v = _clean(call(f"GPU{i} vbios", nv.nvmlDeviceGetVbiosVersion, handle))
                if v:
                    vbios.append((f"GPU{i}", v))
    finally:
        try:
            nv.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass
    return driver, cuda, tuple(vbios), "; ".join(errors) or None


def probe_versions(ctx: ProbeContext) -> VersionFacts:
    errors: dict[str, str] = {}
    try:
        kernel = _clean(ctx.under_root(OSRELEASE).read_text(errors="replace"))
    except OSError as exc:
        kernel = None
        errors["kernel"] = f"{OSRELEASE}: {exc.strerror or exc}"
    hca_fw, err = read_hca_fw(ctx)
    if err:
        errors["hca_fw"] = err
    driver: str | None = None
    cuda: str | None = None
    vbios: tuple[tuple[str, str], ...] = ()
    if ctx.nvml_snapshot is not None or ctx.node_class.gpus > 0:
        driver, cuda, vbios, err = read_nvml_versions(ctx)
        if err:
            for name in ("driver", "cuda", "vbios"):
                errors[name] = err
    return VersionFacts(driver, cuda, vbios, hca_fw, kernel, errors)


def _components(names: Sequence[str]) -> str:
    """GPU0, GPU3 -> "GPU 0, 3"; mlx5_0, mlx5_1 -> "mlx5_0, mlx5_1"."""
    if names and all(n.startswith("GPU") and n[3:].isdigit() for n in names):
        return "GPU " + ", ".join(n[3:] for n in names)
    return ", ".join(names)


def observed(facts: VersionFacts) -> dict[str, str]:
    """Field -> the observed value (distinct values of a per-component field joined by ',')."""
    out: dict[str, str] = {}
    for name in FIELDS:
        vals = sorted({v for _, v in facts.values(name)})
        if vals:
            out[name] = ",".join(vals)
    return out


def field_problems(name: str, pairs: Sequence[tuple[str, str]], allowed: tuple[str, ...] | None,
                   critical: bool, error: str | None) -> list[tuple[Status, str]]:
    """The problems of one field: unread while pinned, off its pin, or mixed within the node."""
    if not pairs:
        if allowed is not None:
            return [(Status.UNKNOWN, f"{name} unread" + (f" ({error})" if error else ""))]
        return []
    by_value: dict[str, list[str]] = {}
    for comp, value in pairs:
        by_value.setdefault(value, []).append(comp)
    if allowed is None:
        if len(by_value) > 1:
            mixed = "; ".join(f"{v} ({_components(c)})" for v, c in sorted(by_value.items()))
            return [(Status.WARNING, f"{name} differs within the node: {mixed}")]
        return []
    pinned = allowed[0] if len(allowed) == 1 else f"one of {', '.join(allowed)}"
    out: list[tuple[Status, str]] = []
    for value, comps in sorted(by_value.items()):
        if value in allowed:
            continue
        if not comps[0]:
            where = ""  # a node-wide field
        elif len(comps) == len(pairs) and len(pairs) > 1:
            where = f" (all {len(comps)})"
        else:
            where = f" ({_components(comps)})"
        out.append((Status.CRITICAL if critical else Status.WARNING,
                    f"{name} {value}{where}, pinned {pinned}"))
    return out


@check("versions", probe=probe_versions)
def evaluate_versions(facts: VersionFacts, cls: NodeClass) -> CheckResult:
    """Driver, CUDA, VBIOS, HCA firmware and kernel against the class's pins."""
    pins = cls.versions
    problems: list[tuple[Status, str]] = []
    pinned = 0
    for name in FIELDS:
        allowed = pins.allowed(name)
        pinned += allowed is not None
        problems += field_problems(name, facts.values(name), allowed, name in pins.critical,
                                   facts.errors.get(name))
    info = observed(facts)
    metrics = {"pinned_count": pinned,
               "mismatched_count": sum(s in (Status.WARNING, Status.CRITICAL)
                                       and "pinned" in t for s, t in problems)}
    status, summary = summarize(problems)
    if summary is None:
        seen = ", ".join(f"{k} {v}" for k, v in info.items()) or "nothing read"
        summary = f"{seen}" + (f" ({pinned} pinned)" if pinned else " (none pinned)")
    return CheckResult("versions", status, summary, metrics, info=info)
