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
service), but no longer run code. The node agent starts torchrun through this (`torchrun_start`)
when the torchrun command is torch's own ``torchrun`` script for this Python, in whatever form
pip, uv or conda wrote it (`launcher_python`); when it is not, the step fails unless the site
allows an unguarded torchrun (``BV_RDZV_GUARD=optional``, site.yaml ``launch.rdzv_guard``).
Each node is told whether it hosts the store (``BV_RDZV_IS_HOST``, set as torch's ``is_host``):
torch's own guess turns a host whose port someone else took into a client of theirs.

The store outlives every node's shutdown. The c10d store is a server inside the first node's
torchrun, and torch 2.13 ends a step with a race on it: each agent passes its exit barrier
(``store_util.barrier``: ``add`` a count, the last one ``set``s a key, all ``wait`` on it), then
``launch_agent``'s ``finally`` closes the rendezvous (``DynamicRendezvousHandler.shutdown``: a
few ``get``/``compare_set`` round trips on the store), then the process exits and the server
with it. The host does not wait for the other nodes to leave: a node still between its ``set``
and its ``wait`` (or later in its close) when the host's process is gone fails there: torchrun
logs "Error waiting on exit barrier" with a traceback, or "failed to shutdown the rendezvous"
after torch's C++ "recvValue failed" stack, though the job succeeded. So here every node's
guard, once torchrun's main has returned, adds itself to a count in the store
(`finish_rendezvous`), and the host's guard keeps the server (it holds the store torch's
c10d backend made, `hold_store`) until that count reaches ``--nnodes`` or ``LINGER_S`` passes.
A one-node step, or torchrun ended by a failure or a signal, does not wait.

Since issue 37 bv starts torchrun with torch's STATIC rendezvous (``--rdzv-backend=static``,
each node's rank from the supervisor's ``go`` in ``PET_NODE_RANK``, the store at the endpoint):
the supervisor knows the step's world, so no join loop polls the store once a second. That
rendezvous keeps no pickled state (its agents put JSON role infos and a barrier count in the
store), so the allow-listed unpickler is installed only for c10d, which bv still uses for a
step with ``--max-restarts`` above 0 (supervisor.torchrun_step_argv says why). What still
matters with static, and stays: the store's host is named, not guessed (node rank 0, the
step's first node: its TCPStore binds the port or torchrun fails; every other node is a
client), and the store outlives the other nodes' exit barrier (the static handler makes the
store and keeps it: `hold_static_store`, then the same `finish_rendezvous`).

torch is imported in `main` only: the node agent imports `guarded_argv` (standard library).
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import re
import sys
import types
from collections.abc import Mapping, Sequence
from typing import Any

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
C10D_BACKEND_MODULE = "torch.distributed.elastic.rendezvous.c10d_rendezvous_backend"
STATIC_MODULE = "torch.distributed.elastic.rendezvous.static_tcp_rendezvous"
# How long the host's guard keeps the store for nodes that have not finished their shutdown:
# they passed the same exit barrier, so they are milliseconds behind unless one died since.
LINGER_S = 10.0
FINISHED_KEY = "bv.rdzv_guard.finished."  # + the rendezvous id: the count of finished nodes
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
    if callable(getattr(module, "get_method_name", None)):
        module.get_method_name = method_name  # type: ignore[attr-defined]


def method_name(depth: int = 2) -> str:
    """torch's ``dynamic_rendezvous.get_method_name`` (the name of the function `depth` frames
    up, for its rendezvous events) without ``inspect.stack()``, which reads a source line for
    every frame. Under ``python -m`` the stack holds runpy's frozen frames, and inspect looks
    each up by a scan of every loaded module (over 1,000 with torch): ~3 ms a call, two calls
    per event, a dozen events on each node's way through the rendezvous, before any rank
    starts (the plain ``torchrun`` script has no such frame)."""
    try:
        return sys._getframe(depth).f_code.co_name
    except ValueError:  # fewer frames than that: what torch's own returns then
        return "no_method_name"


@dataclasses.dataclass(frozen=True)
class HeldStore:
    """The store torch's c10d rendezvous backend made in this process: the server itself
    where `host` (the same rule torch follows: ``is_host`` of ``--rdzv-conf``, else the
    endpoint names this machine), a client elsewhere."""

    store: Any  # torch.distributed.TCPStore
    run_id: str
    host: bool


def hold_store(held: list[HeldStore]) -> bool:
    """Make torch's c10d backend hand the store it creates to `held` too, so that it (and on
    the host its server) lives as long as this process, not as long as torchrun's objects.
    False when this torch has no such factory: then the guard does not linger (torch's own
    end, race included)."""
    import importlib

    module = importlib.import_module(C10D_BACKEND_MODULE)
    create = getattr(module, "_create_tcp_store", None)
    if create is None:
        return False
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError
    from torch.distributed.elastic.rendezvous.utils import (
        _matches_machine_hostname,
        parse_rendezvous_endpoint,
    )

    default_port = int(getattr(module, "DEFAULT_PORT", 29400))

    named = os.environ.get(HOST_ENV)

    def create_and_hold(params: Any) -> Any:
        if named in ("0", "1"):
            # bv names the host (the step's first node): torch's own guess would adopt a
            # squatter's store as a client when the port is taken; named, the host fails.
            params.config["is_host"] = named
        try:
            store = create(params)
        except RendezvousConnectionError:
            if named == "1":
                sys.stderr.write(
                    f"bv rdzv_guard: cannot host the rendezvous store at {params.endpoint}: "
                    "the port is taken (another process holds it): the step fails rather than "
                    "join a store it does not own\n")
            raise
        host = params.get_as_bool("is_host")
        if host is None:
            endpoint = parse_rendezvous_endpoint(params.endpoint, default_port=default_port)
            host = _matches_machine_hostname(endpoint[0])
        held.append(HeldStore(store, str(params.run_id), bool(host)))
        return store

    module._create_tcp_store = create_and_hold  # type: ignore[attr-defined]
    return True


def finish_rendezvous(held: HeldStore, nnodes: int, linger_s: float = LINGER_S) -> str | None:
    """Count this node as finished (torchrun's main has returned: it left the exit barrier and
    closed the rendezvous); on the host, keep the server until `nnodes` have, at most
    `linger_s`. Returns the line to say when the host stopped waiting early, else None. A
    node that finds the store gone (its host has left) has nothing more to do."""
    from datetime import timedelta

    count_key = FINISHED_KEY + held.run_id
    all_key = count_key + ".all"
    store = held.store
    try:
        store.set_timeout(timedelta(seconds=max(linger_s, 0.1)))
        finished = int(store.add(count_key, 1))
        if finished >= nnodes:
            store.set(all_key, "1")
        elif held.host:
            store.wait([all_key], timedelta(seconds=linger_s))
    except RuntimeError:  # torch's DistError: the store is gone, or the bound passed
        if not held.host:
            return None
        return (f"bv rdzv_guard: {nnodes - _count(store, count_key)} of {nnodes} nodes' torchrun "
                f"did not finish within {linger_s:.0f} s: the rendezvous store closes now\n")
    return None


def _count(store: Any, key: str) -> int:
    try:
        return int(store.add(key, 0))
    except RuntimeError:
        return 0


def hold_static_store(held: list[HeldStore]) -> list[Any]:
    """The same for torch's static rendezvous (issue 37): its handler makes the store (the
    server where its node rank is 0: the step's first node, named by bv) at its first
    rendezvous and keeps it. Returns the list the handlers made in this process are added
    to; `held_static` reads their stores once torchrun's main has returned. An empty list
    stays empty when this torch makes its static handler another way."""
    import importlib

    module = importlib.import_module(STATIC_MODULE)
    made: list[Any] = []
    create = getattr(module, "create_rdzv_handler", None)
    if create is None:
        return made

    def create_and_keep(params: Any) -> Any:
        handler = create(params)
        made.append(handler)
        return handler

    module.create_rdzv_handler = create_and_keep  # type: ignore[attr-defined]
    return made


def held_static(handlers: Sequence[Any]) -> list[HeldStore]:
    """The stores the static handlers in `handlers` made (none before their rendezvous)."""
    return [HeldStore(h._store, str(h.run_id), int(h.rank) == 0)
            for h in handlers if getattr(h, "_store", None) is not None]


@dataclasses.dataclass(frozen=True)
class RdzvArgs:
    """What the guard reads of torchrun's own options."""

    backend: str
    nnodes: int  # ``--nnodes`` when it is one number (bv's supervisor passes one), else 0


def rdzv_args(torchrun_args: Sequence[str]) -> RdzvArgs:
    """torchrun's rendezvous backend and fixed node count, as its own parser reads them
    (its ``PET_*`` environment included)."""
    from torch.distributed.run import parse_args, parse_min_max_nnodes

    args = parse_args(list(torchrun_args))
    low, high = parse_min_max_nnodes(args.nnodes)
    return RdzvArgs(str(args.rdzv_backend), int(high) if low == high else 0)


# The line a console-script launcher runs its Python with when a #! line cannot (the path is
# over 127 bytes or has a space): pip's and conda's `'''exec' "/path/python" "$0" "$@"`, uv's
# `'''exec' '/path/python' "$0" "$@"` (tests/data/launchers/ holds each one recorded).
TRAMPOLINE = re.compile(rb"^'''exec' (?P<cmd>.+?) \"\$0\" \"\$@\"")
# uv's relocatable venvs: the Python beside the script (newer uv: its realpath; older: as found).
RELOCATABLE = (
    (b'"$(dirname -- "$(realpath -- "$0")")"/', True),
    (b'"$(CDPATH= cd -- "$(dirname -- "$0")" && echo "$PWD")"/', False),
)
ENV_PROGRAMS = ("/usr/bin/env", "/bin/env")  # conda's long-prefix form: #!/usr/bin/env python3.11
GUARD_ENV = "BV_RDZV_GUARD"  # "required" (the default) or "optional": site.yaml launch.rdzv_guard
HOST_ENV = "BV_RDZV_IS_HOST"  # "1" on the step's first node (it hosts the store), else "0"
RDZV_CONF_ENV = "PET_RDZV_CONF"  # torchrun's --rdzv-conf, from the environment
TORCHRUN_MODULE = "torch.distributed.run"


class GuardUnavailable(Exception):
    """The torchrun command cannot run through the guard (the reason is the message)."""


@dataclasses.dataclass(frozen=True)
class TorchrunStart:
    """How the node agent starts torchrun: its argv, what it adds to torchrun's environment,
    and a line for the job's output ('' when there is nothing to say)."""

    argv: list[str]
    env: dict[str, str]
    note: str = ""


def torchrun_start(torchrun: Sequence[str], *, host: bool, env: Mapping[str, str],
                   python: str = sys.executable) -> TorchrunStart:
    """The node agent's torchrun: through the guard, with this node's part in the rendezvous
    named (`host`: the step's first node hosts the store, the others are its clients, so a
    port someone else took first fails the step instead of being joined).

    Raises:
        GuardUnavailable: the guard cannot apply and the site did not opt out
            (``BV_RDZV_GUARD=optional``: site.yaml ``launch.rdzv_guard: optional``).
    """
    try:
        argv = guard_plan(torchrun, python, env.get("PATH", os.defpath))
    except GuardUnavailable as exc:
        if env.get(GUARD_ENV, "required") != "optional":
            raise GuardUnavailable(
                f"torchrun cannot run through bv's rendezvous guard: {exc}; refused (a site "
                "can allow an unguarded torchrun: site.yaml launch.rdzv_guard: optional)"
            ) from exc
        # Unguarded: the state is unpickled by torch's own pickle. is_host still travels, in
        # the environment torchrun reads --rdzv-conf from (a --rdzv-conf option wins over it).
        conf = ",".join(p for p in (env.get(RDZV_CONF_ENV, ""), f"is_host={int(host)}") if p)
        return TorchrunStart(list(torchrun), {RDZV_CONF_ENV: conf},
                             f"torchrun runs WITHOUT bv's rendezvous guard ({exc}): whoever "
                             "reaches the rendezvous store's port can run code as the job's "
                             "user (site.yaml launch.rdzv_guard: optional)")
    return TorchrunStart(argv, {HOST_ENV: "1" if host else "0"})


def guarded_argv(argv: Sequence[str], python: str = sys.executable,
                 path: str | None = None) -> list[str] | None:
    """The argv that runs `argv` (a torchrun command) through this guard, or None when it
    cannot (`guard_plan` says why)."""
    try:
        return guard_plan(argv, python, path if path is not None else os.environ.get("PATH"))
    except GuardUnavailable:
        return None


def guard_plan(argv: Sequence[str], python: str, path: str | None) -> list[str]:
    """The argv that runs `argv` through this guard: `argv` is torch's ``torchrun`` console
    script (any launcher form pip, uv or conda write; a pyenv shim of it) or ``PY -m
    torch.distributed.run``, run by `python`'s environment (where bluevela imports).

    Raises:
        GuardUnavailable: why it cannot (not torch's torchrun, not found, another Python).
    """
    import shutil

    if not argv:
        raise GuardUnavailable("no torchrun command")
    found = shutil.which(argv[0], path=path)
    if found is None:
        raise GuardUnavailable(f"{argv[0]!r} is not found on PATH")
    if len(argv) >= 3 and list(argv[1:3]) == ["-m", TORCHRUN_MODULE]:
        _same_python(found, python, f"{argv[0]} -m {TORCHRUN_MODULE}")
        return [python, "-P", "-m", "bluevela.launch.rdzv_guard", "torchrun", *argv[3:]]
    head = _head(found)
    if PYENV_SHIM_MARK in head:
        # The shim would run this name from the current pyenv version: the one `python` is.
        shim, found = found, os.path.join(os.path.dirname(python), os.path.basename(found))
        if not os.path.isfile(found):
            raise GuardUnavailable(f"{shim} is a pyenv shim, and the job's Python {python} has "
                                   f"no {os.path.basename(found)} beside it: the shim would run "
                                   "another environment's")
        head = _head(found)
    if TORCHRUN_MARK not in head:
        raise GuardUnavailable(f"{found} is not torch's torchrun script (a wrapper or another "
                               "program: the guard runs torch's own torchrun only)")
    interpreter = launcher_python(found, head, path)
    if interpreter is None:
        raise GuardUnavailable(f"{found} names its Python in no form bv knows")
    _same_python(interpreter, python, found)
    return [python, "-P", "-m", "bluevela.launch.rdzv_guard", found, *argv[1:]]


def _same_python(interpreter: str, python: str, what: str) -> None:
    if _real_dir(interpreter) != _real_dir(python):
        raise GuardUnavailable(f"{what} runs {interpreter}, another environment than bv's "
                               f"{python} (bluevela may not import there)")


def _real_dir(path: str) -> str:
    return os.path.realpath(os.path.dirname(os.path.abspath(path)))


def launcher_python(script: str, head: bytes, path: str | None = None) -> str | None:
    """The interpreter a console-script launcher (`head`: its first bytes) runs: a plain
    ``#!/path/python`` line, ``#!/usr/bin/env python3.11`` (found on `path`), or the
    ``#!/bin/sh`` trampoline pip, uv and conda write for a path over 127 bytes or with a space
    (uv's relocatable form: the Python beside `script`). None when it says none of these."""
    import shlex
    import shutil

    lines = head.split(b"\n", 2)
    first = lines[0].rstrip(b"\r")
    if not first.startswith(b"#!"):
        return None
    words = first[2:].decode("utf-8", "replace").split()
    if words[:1] in (["/bin/sh"], ["/usr/bin/sh"]) and len(lines) > 1:
        match = TRAMPOLINE.match(lines[1])
        if match is None:
            return None
        cmd = match.group("cmd")
        try:
            for prefix, real in RELOCATABLE:
                if cmd.startswith(prefix):
                    base = os.path.realpath(script) if real else os.path.abspath(script)
                    rest = shlex.split(cmd[len(prefix):].decode("utf-8", "replace"))
                    return os.path.join(os.path.dirname(base), rest[0]) if len(rest) == 1 else None
            words = shlex.split(cmd.decode("utf-8", "replace"))
        except ValueError:  # unbalanced quotes
            return None
    if not words:
        return None
    if words[0] in ENV_PROGRAMS:
        names = [w for w in words[1:] if not w.startswith("-") and "=" not in w]
        return shutil.which(names[0], path=path) if names else None
    return words[0]


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
    rdzv = rdzv_args(args[1:])
    held: list[HeldStore] = []
    handlers: list[Any] = []
    if rdzv.backend == "static":
        # No pickled state: the static rendezvous keeps none (the agents exchange JSON role
        # infos and a barrier count in the store). The store's host is node rank 0, named by
        # bv's go; only the linger below still matters.
        handlers = hold_static_store(held)
    else:
        install()
        if not hold_store(held) and os.environ.get(HOST_ENV) in ("0", "1"):
            sys.stderr.write("bv rdzv_guard: this torch makes its c10d store another way: the "
                             "store's host is torch's guess, not bv's (a taken port is "
                             "joined)\n")
    from torch.distributed.run import main as torchrun_main

    sys.argv = [args[0], *args[1:]]
    result = torchrun_main(args[1:])
    # Only a torchrun that returned: a failure or a signal ends without waiting for anyone.
    held += held_static(handlers)
    if rdzv.nnodes > 1 and held:
        note = finish_rendezvous(held[0], rdzv.nnodes)
        if note:
            sys.stderr.write(note)
    return int(result) if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(main())
