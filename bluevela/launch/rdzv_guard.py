"""torchrun whose rendezvous state is unpickled through an allow-list (issue 23).

    python3 -P -m bluevela.launch.rdzv_guard TORCHRUN [torchrun options] script [args]

torchrun keeps its rendezvous state as a pickle in its c10d TCPStore, and every torchrun agent
of the step unpickles it (``pickle.loads``) whenever it syncs (at join, then every keep-alive,
5 s). The TCPStore has no authentication, and it answers ``list_keys`` to anyone who reaches
its port, so a random rendezvous id hides the state's key from /proc but not from the store
itself. Whoever writes that key with a plain pickle runs code as the job's user on every node.

This runs torchrun (``torch.distributed.run.main``, what the ``torchrun`` script calls) with
the ``pickle`` that torch's dynamic rendezvous module sees replaced by one whose ``loads``
builds only the types the state is made of (``_RendezvousState``, ``_NodeDesc`` and three
``datetime`` types); anything else is an ``UnpicklingError``, which torchrun reports as a
corrupt rendezvous state. A writer can still corrupt the state (the step fails: a denial of
service), but no longer run code. The node agent starts torchrun through this when the torchrun
command is torch's own ``torchrun`` script for this Python (`guarded_argv`).

torch is imported in `main` only: the node agent imports `guarded_argv` (standard library).
"""

from __future__ import annotations

import io
import os
import pickle
import sys
import types
from collections.abc import Sequence

RENDEZVOUS_MODULE = "torch.distributed.elastic.rendezvous.dynamic_rendezvous"
# What pickle.dumps(_RendezvousState) refers to (its fields hold ints, bools, dicts, sets and
# these); checked with pickletools on torch 2.13.
ALLOWED = frozenset({
    (RENDEZVOUS_MODULE, "_RendezvousState"),
    (RENDEZVOUS_MODULE, "_NodeDesc"),
    ("datetime", "datetime"),
    ("datetime", "timezone"),
    ("datetime", "timedelta"),
})
TORCHRUN_MARK = b"from torch.distributed.run import main"
PYENV_SHIM_MARK = b'pyenv" exec "$program"'  # a pyenv shim: runs the same name of the current version


class StateUnpickler(pickle.Unpickler):
    """Builds only the rendezvous state's own types."""

    def find_class(self, module: str, name: str) -> object:
        if (module, name) not in ALLOWED:
            raise pickle.UnpicklingError(
                f"{module}.{name} is not part of torchrun's rendezvous state: refused")
        return super().find_class(module, name)


def loads(data: bytes) -> object:
    return StateUnpickler(io.BytesIO(data)).load()


def guarded_pickle() -> types.ModuleType:
    """A stand-in for the ``pickle`` module, with `loads` restricted (dumps and the error
    classes are pickle's own)."""
    shim = types.ModuleType("pickle")
    shim.__dict__.update({k: v for k, v in vars(pickle).items() if not k.startswith("__")})
    shim.loads = loads  # type: ignore[attr-defined]
    return shim


def install() -> None:
    """Point torch's dynamic rendezvous at the restricted unpickler. Raises ImportError when
    torch has no such module (then torchrun is not safe to run either way)."""
    import importlib

    module = importlib.import_module(RENDEZVOUS_MODULE)
    if getattr(module, "pickle", None) is not pickle:
        raise ImportError(f"{RENDEZVOUS_MODULE} no longer unpickles through `pickle`: "
                          "bv's guard does not know this torch")
    module.pickle = guarded_pickle()  # type: ignore[attr-defined]


def guarded_argv(argv: Sequence[str], python: str = sys.executable,
                 path: str | None = None) -> list[str] | None:
    """The argv that runs `argv` (a torchrun command) through this guard, or None when it
    cannot: the command is not torch's ``torchrun`` script, or that script runs another Python
    (another environment, where bluevela may not import) than `python`."""
    import shutil

    if not argv:
        return None
    found = shutil.which(argv[0], path=path if path is not None else os.environ.get("PATH"))
    if found is None:
        return None
    head = _head(found)
    if PYENV_SHIM_MARK in head:
        # The shim would run this name from the current pyenv version: the one `python` is.
        found = os.path.join(os.path.dirname(python), os.path.basename(found))
        head = _head(found)
    first = head.split(b"\n", 1)[0]
    if not first.startswith(b"#!") or TORCHRUN_MARK not in head:
        return None
    interpreter = first[2:].strip().split(b" ")[0].decode("utf-8", "replace")
    if os.path.dirname(interpreter) != os.path.dirname(python):
        return None
    return [python, "-P", "-m", "bluevela.launch.rdzv_guard", found, *argv[1:]]


def _head(path: str) -> bytes:
    try:
        with open(path, "rb") as fh:
            return fh.read(4096)
    except OSError:
        return b""


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        sys.stderr.write("bv rdzv_guard: no torchrun command\n")
        return 2
    install()
    from torch.distributed.run import main as torchrun_main

    sys.argv = [args[0], *args[1:]]
    result = torchrun_main(args[1:])
    return int(result) if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(main())
