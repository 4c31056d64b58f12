"""Recording this node's NVML through pynvml, in the snapshot format (`nvml_snapshot`).

Each GPU's values are the rows of `nvml_fields.GPU_FIELDS`, read through the table's `call`
and `record` columns; every NVML call is guarded, so a field NVML does not support (or that
fails) is recorded as null with NVML's text under the GPU's `errors`.

Two entry points, each one nvmlInit and one nvmlShutdown:

- `gather_live()`: a snapshot (`bv health snapshot`, the gpu check's live source), with the
  kernel log's GPU lines and a second reading of the GPUs that looked throttled or busy;
- `sample_live()`: what the telemetry sampler needs per sample: the snapshot (no kernel log,
  no second reading: a sampler never sleeps inside a sample) and each GPU's utilisation and SM
  clock (`nvml_fields.ACTIVITY_FIELDS`, not in the snapshot format), in the same NVML session.
  `nvml.LiveNVML.sample()` is the same, parsed.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from bluevela.health.kmsg import read_kmsg_nvrm, read_marked_lines
from bluevela.health.nvml_fields import (
    ACTIVITY_FIELDS,
    GPU_FIELDS,
    RECHECK_FIELDS,
    GPUField,
    guarded_call,
    text,
)
from bluevela.health.nvml_snapshot import header
from bluevela.health.throttle import HW_SLOWDOWNS


class NVMLInitError(RuntimeError):
    """nvmlInit failed: the node's GPU stack cannot start (no driver, version mismatch).

    Attributes:
        nvml_message: NVML's own text (`Driver Not Loaded`), as the drain reason shows it.
    """

    def __init__(self, nvml_message: str) -> None:
        super().__init__(f"NVML init failed: {nvml_message}")
        self.nvml_message = nvml_message


class NVMLMissingError(ImportError):
    """The Python binding (pynvml, package nvidia-ml-py) is not installed: bluevela's own
    installation is incomplete, which says nothing about the node."""


def _binding() -> Any:
    try:
        import pynvml
    except ImportError as exc:
        raise NVMLMissingError("pynvml is not installed (package nvidia-ml-py)") from exc
    return pynvml


def _binding_version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as pkg_version

    try:
        return pkg_version("nvidia-ml-py")
    except PackageNotFoundError:
        return "?"


def _source() -> str:
    return f"live NVML via pynvml (nvidia-ml-py {_binding_version()})"


@contextmanager
def _session(nv: Any, raise_init_error: bool) -> Iterator[str | None]:
    """nvmlInit, then nvmlShutdown at the end. Yields None, or NVML's message when nvmlInit
    failed and `raise_init_error` is False (then there is nothing to shut down).

    Raises:
        NVMLInitError: nvmlInit failed and `raise_init_error`.
    """
    try:
        nv.nvmlInit()
    except nv.NVMLError as exc:
        if raise_init_error:
            raise NVMLInitError(str(exc)) from exc
        yield str(exc)
        return
    try:
        yield None
    finally:
        try:
            nv.nvmlShutdown()
        except nv.NVMLError:
            pass


def gather_live(*, include_kmsg: bool = True, recheck_s: float = 0.0,
                raise_init_error: bool = True,
                process_gpus: tuple[int, ...] | None = None) -> dict[str, Any]:
    """Record this node's NVML values in the snapshot format.

    A GPU showing a hardware slowdown or compute processes is read again after `recheck_s`
    (0: no second reading).

    Args:
        include_kmsg: also read the kernel log's NVRM lines (`BV_KMSG`, else /dev/kmsg).
        recheck_s: seconds before the second reading.
        raise_init_error: raise when nvmlInit fails; False records it as `init_error`.
        process_gpus: only processes on these GPUs call for a second reading (the job's
            GPUs in the prolog); None: any GPU.

    Raises:
        NVMLMissingError: pynvml (package nvidia-ml-py) is not installed.
        NVMLInitError: nvmlInit failed (no driver, version mismatch) and `raise_init_error`.
    """
    nv = _binding()
    with _session(nv, raise_init_error) as init_error:
        if init_error is not None:
            return _init_failed(init_error, include_kmsg)
        return _gather(nv, include_kmsg, recheck_s, process_gpus)


def sample_live() -> tuple[dict[str, Any], dict[int, dict[str, float]]]:
    """One NVML session for one telemetry sample: the snapshot (no kernel log, no second
    reading; nvmlInit's failure is its `init_error`) and {GPU index: {"util_pct": %,
    "sm_clock_mhz": MHz}}, a value left out where NVML refused it ({} without GPUs).

    Raises:
        NVMLMissingError: pynvml (package nvidia-ml-py) is not installed.
    """
    nv = _binding()
    with _session(nv, raise_init_error=False) as init_error:
        if init_error is not None:
            return _init_failed(init_error, include_kmsg=False), {}
        snap = _gather(nv, include_kmsg=False)
        indexes = [g["index"] for g in snap["gpus"]]
        return snap, _activity(nv, indexes)


def _init_failed(message: str, include_kmsg: bool) -> dict[str, Any]:
    out = header(_source())
    errors: dict[str, str] = {}
    out.update(driver_version=None, nvml_version=None, cuda_driver_version=None,
               device_count=None, gpus=[], kmsg=None, errors=errors, init_error=message)
    if include_kmsg:
        _read_kmsg(out, errors)
    return out


def _read_kmsg(out: dict[str, Any], errors: dict[str, str]) -> None:
    path = os.environ.get("BV_KMSG")
    try:
        out["kmsg"] = read_marked_lines(path) if path else read_kmsg_nvrm()
    except OSError as exc:
        errors["kmsg"] = f"{exc.strerror or exc}"


def _opt_text(value: Any) -> str | None:
    return None if value is None else text(value)


def _gather(nv: Any, include_kmsg: bool, recheck_s: float = 0.0,
            process_gpus: tuple[int, ...] | None = None) -> dict[str, Any]:
    errors: dict[str, str] = {}

    def call(key: str, fn: Any) -> Any:
        return guarded_call(nv, errors, key, fn)

    count = call("device_count", nv.nvmlDeviceGetCount)
    cuda = call("cuda_driver_version", getattr(
        nv, "nvmlSystemGetCudaDriverVersion_v2", None) or nv.nvmlSystemGetCudaDriverVersion)
    out = header(_source())
    out.update({
        "driver_version": _opt_text(call("driver_version", nv.nvmlSystemGetDriverVersion)),
        "nvml_version": _opt_text(call("nvml_version", nv.nvmlSystemGetNVMLVersion)),
        "cuda_driver_version": cuda,
        "device_count": count,
        "gpus": [_read_gpu(nv, i, GPU_FIELDS) for i in range(count or 0)],
        "kmsg": None,
        "errors": errors,
    })
    suspects = _suspects(out["gpus"], process_gpus)
    if suspects and recheck_s > 0:
        # One transient reading (a power-brake blip, a process exiting) must not drain a node.
        time.sleep(recheck_s)
        out["recheck"] = {"after_s": recheck_s,
                          "gpus": [_read_gpu(nv, i, RECHECK_FIELDS) for i in suspects]}
    if include_kmsg:
        _read_kmsg(out, errors)
    return out


def _suspects(gpus: list[dict[str, Any]], process_gpus: tuple[int, ...] | None) -> list[int]:
    """The GPUs to read again: a hardware slowdown, or compute processes (on `process_gpus`)."""
    return [g["index"] for g in gpus
            if ((g.get("clocks_event_reasons") or 0) & HW_SLOWDOWNS)
            or (g.get("compute_processes")
                and (process_gpus is None or g["index"] in process_gpus))]


def _read_gpu(nv: Any, index: int, fields: tuple[GPUField, ...]) -> dict[str, Any]:
    """One GPU's snapshot object: its index, `fields`, and the errors of the calls NVML
    refused; `{"index": i, "error": ...}` when its handle cannot be opened (fallen off the
    bus)."""
    try:
        h = nv.nvmlDeviceGetHandleByIndex(index)
    except nv.NVMLError as exc:
        return {"index": index, "error": str(exc)}
    errs: dict[str, str] = {}
    return {"index": index, **read_gpu_fields(nv, h, fields, errs), "errors": errs}


def read_gpu_fields(nv: Any, h: Any, fields: tuple[GPUField, ...], errs: dict[str, str],
                    get: Any = None) -> dict[str, Any]:
    """The snapshot values of `fields` for the GPU behind handle `h`, in the table's order.

    Each `Call` runs once, however many fields it answers; a call NVML refuses makes its
    fields null, its error under `errs[call.key]`.

    Args:
        get: `get(key, fn)`, the guard around each call; default `guarded_call` into `errs`.
    """
    guard = get or (lambda key, fn: guarded_call(nv, errs, key, fn))
    answers: dict[str, Any] = {}
    out: dict[str, Any] = {}
    for f in fields:
        c = f.call
        if c.key not in answers:
            answers[c.key] = (c.read(nv, h, errs) if c.guards_itself
                              else guard(c.key, lambda c=c: c.read(nv, h)))
        answer = answers[c.key]
        out[f.name] = None if answer is None else f.record(answer)
    return out


def _activity(nv: Any, indexes: list[int]) -> dict[int, dict[str, float]]:
    out: dict[int, dict[str, float]] = {}
    for i in indexes:
        try:
            h = nv.nvmlDeviceGetHandleByIndex(i)
        except nv.NVMLError:
            out[i] = {}
            continue
        values = read_gpu_fields(nv, h, ACTIVITY_FIELDS, {})
        out[i] = {k: v for k, v in values.items() if v is not None}
    return out
