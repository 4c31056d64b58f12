"""Staging a training state into host memory, and the shard payload it becomes.

`Stager.stage(state)` is the only part of a save the training loop waits for: every tensor is
copied into a host buffer kept from the previous save (same key, shape and dtype: reused; a
tensor that changed shape gets a new buffer and the old one is dropped), so staging holds at
most one extra copy of the state. A CUDA tensor is copied with `non_blocking` into pinned
memory and the stream synchronized once at the end; the loop may change its tensors as soon as
`stage` returns.

The payload is a skeleton and the tensors' bytes: the skeleton is tagged JSON (dicts with their
keys' types, lists, tuples, str, int, float, bool, None, bytes, tensors by index), never a
pickle, so a planted or corrupt shard can at worst fail to parse, never run code. Tensors are
laid out at 64-byte offsets, so a resume views them in the one buffer it read (no second copy).

torch is imported inside the functions that need it, never at module import.
"""

from __future__ import annotations

import ctypes
import json
import math
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

ALIGN = 64
MAX_SKELETON = 256 << 20


class StageError(ValueError):
    """The state holds something the store cannot save (its path and type say what)."""


@dataclass
class Staged:
    """One rank's state in host memory, ready to be written (and written again: to the partner
    and to shared storage) while the loop goes on."""

    skeleton: bytes
    tensors: list[Any]  # CPU, contiguous: the stager's buffers
    blobs: list[bytes]
    extra: dict[str, bytes] = field(default_factory=dict)  # added before it is written

    @property
    def payload_size(self) -> int:
        return sum(n for _, n in self._layout()[1])

    def _skeleton_bytes(self) -> bytes:
        if not self.extra:
            return self.skeleton
        doc = json.loads(self.skeleton)
        doc["extra"] = {k: len(v) for k, v in self.extra.items()}
        return json.dumps(doc, separators=(",", ":")).encode()

    def _layout(self) -> tuple[bytes, list[tuple[Any, int]]]:
        skel = self._skeleton_bytes()
        parts: list[tuple[Any, int]] = [(struct.pack(">Q", len(skel)), 8), (skel, len(skel))]
        offset = 8 + len(skel)
        for item in [*self.tensors, *self.blobs, *self.extra.values()]:
            pad = -offset % ALIGN
            if pad:
                parts.append((bytes(pad), pad))
                offset += pad
            n = _nbytes(item)
            parts.append((item, n))
            offset += n
        return skel, parts

    def chunks(self) -> Iterator[memoryview | bytes | bytearray]:
        """The payload, without copying a tensor."""
        for item, n in self._layout()[1]:
            if n:
                yield _view(item) if not isinstance(item, (bytes, bytearray)) else item

    @property
    def nbytes(self) -> int:
        """Host memory this staging holds (tensors and blobs)."""
        return sum(_nbytes(t) for t in self.tensors) + sum(len(b) for b in self.blobs)


def _nbytes(item: Any) -> int:
    if isinstance(item, (bytes, bytearray)):
        return len(item)
    return int(item.numel() * item.element_size())


def _view(t: Any) -> memoryview:
    """A CPU tensor's bytes, without numpy and without a copy."""
    n = _nbytes(t)
    if n == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


def _is_tensor(value: Any) -> bool:
    mod = type(value).__module__
    if not mod.startswith("torch"):
        return False
    import torch

    return isinstance(value, torch.Tensor)


class Stager:
    """Host buffers reused from one save to the next (one per tensor path)."""

    def __init__(self) -> None:
        self.buffers: dict[str, Any] = {}

    @property
    def held_bytes(self) -> int:
        return sum(_nbytes(t) for t in self.buffers.values())

    def stage(self, state: Any) -> Staged:
        """Copy `state` into host memory (see the module docstring).

        Raises:
            StageError: a value of a type the store does not save (named with its path).
        """
        tensors: list[Any] = []
        blobs: list[bytes] = []
        used: set[str] = set()
        cuda = [False]

        def enc(value: Any, path: str) -> Any:
            if value is None or isinstance(value, (bool, str)):
                return value
            if isinstance(value, int):
                return value
            if isinstance(value, float):
                return value if math.isfinite(value) else {"f": repr(value)}
            if isinstance(value, (bytes, bytearray, memoryview)):
                blobs.append(bytes(value))
                return {"b": len(blobs) - 1}
            if isinstance(value, dict):
                items = []
                for k, v in value.items():
                    if not isinstance(k, (str, int)) or isinstance(k, bool):
                        raise StageError(f"{path}: key {k!r} of type {type(k).__name__} "
                                         "(only str and int keys are saved)")
                    items.append([k, enc(v, f"{path}.{k}")])
                return {"d": items}
            if isinstance(value, list):
                return {"l": [enc(v, f"{path}[{i}]") for i, v in enumerate(value)]}
            if isinstance(value, tuple):
                return {"t": [enc(v, f"{path}[{i}]") for i, v in enumerate(value)]}
            if _is_tensor(value):
                return {"T": self._copy(value, path, tensors, used, cuda)}
            raise StageError(f"{path}: a {type(value).__module__}.{type(value).__name__} "
                             "(the store saves tensors, bytes, numbers, strings, lists, "
                             "tuples and dicts)")

        tree = enc(state, "state")
        if cuda[0]:
            import torch

            torch.cuda.synchronize()
        for key in set(self.buffers) - used:
            del self.buffers[key]  # a tensor gone from the state: its buffer goes too
        metas = [[_dtype_name(t), list(t.shape)] for t in tensors]
        skeleton = json.dumps({"v": 1, "tree": tree, "tensors": metas,
                               "blobs": [len(b) for b in blobs]},
                              separators=(",", ":")).encode()
        return Staged(skeleton, tensors, blobs)

    def _copy(self, t: Any, path: str, tensors: list[Any], used: set[str],
              cuda: list[bool]) -> int:
        import torch

        if t.layout != torch.strided or t.is_quantized:
            raise StageError(f"{path}: a {t.layout} tensor (only dense tensors are saved)")
        t = t.detach()
        buf = self.buffers.get(path)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            pin = t.is_cuda
            buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
            self.buffers[path] = buf
        if t.is_cuda:
            cuda[0] = True
            buf.copy_(t, non_blocking=True)
        else:
            buf.copy_(t)
        used.add(path)
        tensors.append(buf)
        return len(tensors) - 1


def _dtype_name(t: Any) -> str:
    return str(t.dtype).removeprefix("torch.")


def decode(payload: bytearray | memoryview) -> tuple[Any, dict[str, bytes]]:
    """A payload back to the state (tensors are views of `payload`: keep it, or clone) and the
    extra parts saved with it.

    Raises:
        StageError: the payload does not parse (a verified file of another format).
    """
    try:
        (slen,) = struct.unpack(">Q", payload[:8])
        if slen > min(MAX_SKELETON, len(payload) - 8):
            raise ValueError(f"skeleton length {slen}")
        doc = json.loads(bytes(payload[8:8 + slen]))
        tensors, offset = _tensor_views(payload, doc["tensors"], 8 + slen)
        blobs, offset = _byte_runs(payload, doc["blobs"], offset)
        extra_sizes = doc.get("extra", {})
        runs, offset = _byte_runs(payload, extra_sizes.values(), offset)
        extra = dict(zip(extra_sizes, runs, strict=True))
        return _rebuild(doc["tree"], tensors, blobs), extra
    except (ValueError, KeyError, TypeError, IndexError, AttributeError, RuntimeError) as exc:
        raise StageError(f"payload does not parse: {exc}") from None


def _tensor_views(payload: bytearray | memoryview, metas: list[Any], offset: int) -> tuple[list[Any], int]:
    """The skeleton's tensors as views of `payload` from `offset` on (each aligned to ALIGN),
    and the offset past the last.

    Raises:
        ValueError: an unknown dtype, or a tensor past the payload's end.
    """
    import torch

    tensors = []
    for dtype_name, shape in metas:
        dtype = getattr(torch, dtype_name)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"dtype {dtype_name!r}")
        offset += -offset % ALIGN
        n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if offset + n > len(payload):
            raise ValueError("tensor past the payload's end")
        if n:
            raw = torch.frombuffer(payload, dtype=torch.uint8, count=n, offset=offset)
            tensors.append(raw.view(dtype).reshape(shape))
        else:
            tensors.append(torch.empty(shape, dtype=dtype))
        offset += n
    return tensors, offset


def _byte_runs(payload: bytearray | memoryview, sizes: Iterable[int], offset: int) -> tuple[list[bytes], int]:
    """Copies of the runs of `sizes` bytes from `offset` on (each aligned to ALIGN), and the
    offset past the last."""
    runs = []
    for n in sizes:
        offset += -offset % ALIGN
        runs.append(bytes(payload[offset:offset + n]))
        offset += n
    return runs, offset


def _rebuild(node: Any, tensors: list[Any], blobs: list[bytes]) -> Any:
    """The skeleton's tree back to the state, its tensors and blobs put in by index.

    Raises:
        ValueError: a node of no known kind.
    """
    if node is None or isinstance(node, (bool, str, int, float)):
        return node
    if "d" in node:
        return {k: _rebuild(v, tensors, blobs) for k, v in node["d"]}
    if "l" in node:
        return [_rebuild(v, tensors, blobs) for v in node["l"]]
    if "t" in node:
        return tuple(_rebuild(v, tensors, blobs) for v in node["t"])
    if "T" in node:
        return tensors[node["T"]]
    if "b" in node:
        return blobs[node["b"]]
    if "f" in node:
        return float(node["f"])
    raise ValueError(f"unknown node {sorted(node)}")
