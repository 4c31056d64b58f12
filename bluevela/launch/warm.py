"""The warm start (issue 37): a node's ranks forked from a parent that has already imported
torch, so that a relaunch pays neither the interpreter's start nor torch's import.

Off unless site.yaml ``launch.warm_start: true`` (the batch script exports ``BV_WARM_START=1``).
Three processes, all the job's user's:

- the warm SERVER (``python -P -m bluevela.launch.warm serve``): one per node of the
  allocation, spares included, started by the supervisor at the job's start as one
  ``srun --overlap`` step that lives as long as the job (a relaunch is a new srun step with
  new agents: only a step of its own outlives them). Standard library only. It listens on a
  unix socket in a directory only the job's user can reach (`socket_dir`: mode 0700, owned
  by the user, never through a link), refuses a peer of another uid (SO_PEERCRED), and
  keeps one ZYGOTE. On a connection it answers ``handed`` (the zygote's pid, and whether it
  has finished its import) and passes the connection itself to the zygote (SCM_RIGHTS), then
  starts a fresh zygote for the next step. A zygote still importing is handed too (it serves
  the step once imported: sooner than a cold one started then, importing beside it). A
  zygote that dies is replaced (backing off to 30 s while they keep dying); while there is
  none it answers ``none`` at once.
- the ZYGOTE (``... warm zygote``): imports torch and torch._dynamo (``BV_WARM_PREIMPORT``,
  comma-separated; no CUDA, no process group), then waits for one connection. It serves ONE step: reads the
  agent's request (bounded, with the agent's stdout and stderr as descriptors), forks the
  node's local ranks and watches them as torchrun's agent would: the first rank that fails
  ends the others (SIGTERM, SIGKILL `STOP_GRACE_S` later), a SIGTERM to it is forwarded to
  them, and when they have all ended it reports ``exit`` (0, or 1 as torchrun's failure)
  and ends. A closed connection (the agent is gone: its step ended, Slurm killed it) kills
  the ranks at once, so no rank of a previous step outlives it into the next one.
- each RANK (a fork of the zygote): the environment torchrun gives a worker (`rank_envs`:
  RANK, LOCAL_RANK, WORLD_SIZE, ... TORCHELASTIC_*), the agent's working directory,
  ``sys.argv``, ``sys.path`` as ``python SCRIPT`` would have it, Python's and numpy's random
  state reseeded, bv's integrations started when armed (``BV_INTEGRATIONS=1``), then the
  script with runpy as ``__main__``; it exits as that interpreter would.

The agent's side (`launch`, `WarmRun`): at ``go`` the agent asks its node's server; when no
server answers (none on the node, or one with no zygote) it starts the same zygote itself,
COLD (it pays the import, as torchrun would). Either way every node of the step launches its ranks
the same way: their rendezvous is torch's ``env://`` (MASTER_ADDR: the step's rendezvous
node, MASTER_PORT: the port its agent picked, rank 0's TCPStore there), so a node whose
warm parent is gone still meets the others. A torchrun command this path cannot run
identically (``--max-restarts`` > 0, per-rank log files, a console filter, a non-numeric
``--nproc-per-node``, an option it does not know) runs torchrun on every node, as before:
that decision depends on the command alone, so every node makes the same one. `WarmRun`
stands in for torchrun's Popen in the agent: its pid is the zygote's (which leads a process
group holding the ranks), so the agent's SIGTERM to the group, kill of the tree, SIGUSR1 to
the workers and the wait for the end work unchanged. docs/resilience.md, "The warm start".
"""

from __future__ import annotations

import errno
import io
import json
import os
import selectors
import signal
import socket
import stat
import struct
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

WARM_ENV = "BV_WARM_START"  # "1": the job runs its ranks through the warm start
DIR_ENV = "BV_WARM_DIR"  # where the servers' sockets are (default: /tmp/bv-warm-<uid>)
PREIMPORT_ENV = "BV_WARM_PREIMPORT"  # modules a zygote imports before it is needed
# torch._dynamo: DistributedDataParallel imports it (and sympy: 800+ modules, ~3 s on a busy
# dev cluster) at its first construction, in every rank of every relaunch.
DEFAULT_PREIMPORT = "torch,torch._dynamo"
HOW_ENV = "BV_WARM_HOW"  # in each rank: "warm" (the node's warm parent) or "cold"
MAX_MSG = 1 << 20  # one message's bytes at most (a request holds the step's environment)
MAX_RANKS = 1024  # local ranks one request may ask for
CONNECT_S = 1.0  # the server's answer is awaited this long, then the agent goes cold
READ_S = 10.0  # a zygote waits this long for the request once it holds the connection
STOP_GRACE_S = 30.0  # SIGTERM to the ranks, SIGKILL this long after (torchrun's 30 s)
RESPAWN_MAX_S = 30.0
# A zygote that replaces one just handed over waits this long before its import, unless it is
# handed over first: the step just started needs the node's cores for its own start.
RESPAWN_DELAY_S = 10.0
# The nodes of the allocation outside the first step (the spares): their first zygote waits
# this long before its import, unless handed over first (a node of a step does not wait):
# no relaunch can need it before the first step has started.
LATER_ENV = "BV_WARM_LATER"
LATER_DELAY_S = 10.0
_HEAD = struct.Struct("!I")


class WarmError(Exception):
    """The warm start cannot be used here (a message for the job's output)."""


def _log(line: str) -> None:
    sys.stderr.write(f"bv warm: {line}\n")
    sys.stderr.flush()


def enabled(env: Mapping[str, str]) -> bool:
    return env.get(WARM_ENV, "") == "1"


# --------------------------------------------------------------------------------------------
# Where the sockets are


def socket_dir(env: Mapping[str, str], uid: int | None = None) -> str:
    """The directory of this user's warm sockets, made 0700 when missing. Refused (WarmError)
    when it is a link, not a directory, another user's, or open to group or others: whoever
    could write there could put a socket of theirs where the agent looks."""
    uid = os.getuid() if uid is None else uid
    path = env.get(DIR_ENV) or f"/tmp/bv-warm-{uid}"
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise WarmError(f"cannot make {path}: {exc.strerror or exc}") from exc
    try:
        st = os.lstat(path)
    except OSError as exc:
        raise WarmError(f"cannot read {path}: {exc.strerror or exc}") from exc
    if not stat.S_ISDIR(st.st_mode):
        raise WarmError(f"{path} is not a directory (a link or a file): refused")
    if st.st_uid != uid or st.st_mode & 0o077:
        raise WarmError(f"{path} is owned by uid {st.st_uid} with mode "
                        f"{stat.S_IMODE(st.st_mode):o}: refused (it must be uid {uid}'s, 0700)")
    return path


def socket_path(env: Mapping[str, str], node: str) -> str:
    """This node's server socket for the job (the nodes may share /tmp)."""
    job = env.get("SLURM_JOB_ID", "0")
    if not job.isdigit() or not node or not all(c.isalnum() or c in "-_." for c in node):
        raise WarmError(f"no socket name for job {job!r} on node {node!r}")
    path = os.path.join(socket_dir(env), f"{job}.{node}.sock")
    if len(path.encode()) > 100:
        raise WarmError(f"{path} is too long for a unix socket")
    return path


def peer_uid(sock: socket.socket) -> int:
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return int(struct.unpack("3i", creds)[1])


# --------------------------------------------------------------------------------------------
# Messages: a 4-byte length, then JSON; MAX_MSG bytes at most


def frame(msg: Mapping[str, object]) -> bytes:
    data = json.dumps(msg, separators=(",", ":")).encode()
    if len(data) > MAX_MSG:
        raise WarmError(f"a message of {len(data)} bytes (at most {MAX_MSG})")
    return _HEAD.pack(len(data)) + data


class Frames:
    """Messages out of a byte stream, as bytes come (bounded: a length over MAX_MSG or bytes
    that are not a JSON object end the stream)."""

    def __init__(self) -> None:
        self.buf = b""
        self.bad = False

    def feed(self, data: bytes) -> list[dict[str, object]]:
        self.buf += data
        out: list[dict[str, object]] = []
        while len(self.buf) >= _HEAD.size and not self.bad:
            (size,) = _HEAD.unpack_from(self.buf)
            if size > MAX_MSG:
                self.bad = True
                break
            if len(self.buf) < _HEAD.size + size:
                break
            body, self.buf = self.buf[_HEAD.size:_HEAD.size + size], self.buf[_HEAD.size + size:]
            try:
                msg = json.loads(body)
            except ValueError:
                msg = None
            if not isinstance(msg, dict):
                self.bad = True
                break
            out.append(msg)
        return out


def read_one(sock: socket.socket, deadline: float,
             max_fds: int = 0) -> tuple[dict[str, object] | None, list[int]]:
    """One message (and the descriptors that came with its first bytes) before `deadline`;
    (None, fds) on EOF, a timeout or a bad message."""
    frames, fds = Frames(), list[int]()
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return None, fds
        sock.settimeout(left)
        try:
            if max_fds and not fds:
                data, got, _, _ = socket.recv_fds(sock, 65536, max_fds)
                fds += got
            else:
                data = sock.recv(65536)
        except OSError:
            return None, fds
        if not data:
            return None, fds
        msgs = frames.feed(data)
        if frames.bad:
            return None, fds
        if msgs:
            return msgs[0], fds


# --------------------------------------------------------------------------------------------
# The torchrun command, and what each rank gets


@dataclass(frozen=True)
class Plan:
    """What a torchrun command runs on each node, when the warm start can run it the same."""

    nproc: int
    max_restarts: int
    module: bool
    target: str
    args: tuple[str, ...]


_KNOWN = {"--nnodes", "--rdzv-backend", "--nproc-per-node", "--max-restarts"}


def plan_of(torchrun: Sequence[str]) -> Plan | str:
    """The Plan of `torchrun` (torchrun's argv, as the agent gets it), or why the warm start
    cannot run it as torchrun would (then torchrun runs)."""
    words = list(torchrun)
    i = 3 if words[1:3] == ["-m", "torch.distributed.run"] else 1
    nproc, restarts, module = None, 0, False
    while i < len(words) and words[i].startswith("-"):
        word = words[i]
        if word in ("-m", "--module"):
            module, i = True, i + 1
            continue
        name, eq, value = word.partition("=")
        name = "--" + name.lstrip("-").replace("_", "-")
        if name not in _KNOWN:
            return f"torchrun option {word.split('=')[0]} is not one the warm start runs"
        if not eq:
            if i + 1 >= len(words):
                return f"torchrun option {word} has no value"
            value, i = words[i + 1], i + 1
        i += 1
        if name == "--nproc-per-node":
            if not value.isdigit() or not 1 <= int(value) <= MAX_RANKS:
                return f"--nproc-per-node={value} (the warm start needs a number)"
            nproc = int(value)
        elif name == "--max-restarts":
            if value != "0":
                return "--max-restarts > 0 (torchrun restarts the ranks itself)"
        elif name == "--rdzv-backend" and value not in ("c10d", "static"):
            return f"--rdzv-backend={value}"
    if nproc is None or i >= len(words):
        return "no --nproc-per-node or no script in the torchrun command"
    return Plan(nproc, restarts, module, words[i], tuple(words[i + 1:]))


def world_of(go: Mapping[str, object], env: Mapping[str, str], node: str,
             rdzv_node: str) -> tuple[int, int] | None:
    """This node's rank among the step's nodes and their count: the ``go`` message's
    (``node_rank``, ``nnodes``) when it carries them, else the step's node list with the
    rendezvous node first (rank 0's store is there); None when the node is not in it."""
    rank, count = go.get("node_rank"), go.get("nnodes")
    if (isinstance(rank, int) and isinstance(count, int) and not isinstance(rank, bool)
            and 0 <= rank < count <= 1 << 16):
        return rank, count
    from bluevela.launch.attempts import expand

    nodelist = env.get("BV_STEP_NODELIST") or env.get("SLURM_STEP_NODELIST") or ""
    try:
        nodes = expand(nodelist) if nodelist else []
    except Exception:  # noqa: BLE001 - hostlist's own errors: no world, then torchrun
        return None
    order = [rdzv_node, *(n for n in nodes if n != rdzv_node)]
    if node not in order or rdzv_node not in nodes:
        return None
    return order.index(node), len(order)


def rank_envs(plan: Plan, node_rank: int, nnodes: int, master: tuple[str, int],
              run_id: str, omp: str | None) -> list[dict[str, str]]:
    """Each local rank's variables, as torch's elastic agent sets them for its workers
    (torch/distributed/elastic/agent/server/local_elastic_agent.py `_start_workers`; the
    role is torchrun's `default`, a warm start is no restart: TORCHELASTIC_RESTART_COUNT 0)."""
    world = nnodes * plan.nproc
    out = []
    for local in range(plan.nproc):
        rank = node_rank * plan.nproc + local
        env = {
            "RANK": str(rank), "LOCAL_RANK": str(local), "GROUP_RANK": str(node_rank),
            "ROLE_RANK": str(rank), "ROLE_NAME": "default",
            "LOCAL_WORLD_SIZE": str(plan.nproc), "WORLD_SIZE": str(world),
            "GROUP_WORLD_SIZE": str(nnodes), "ROLE_WORLD_SIZE": str(world),
            "MASTER_ADDR": master[0], "MASTER_PORT": str(master[1]),
            "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_MAX_RESTARTS": str(plan.max_restarts),
            "TORCHELASTIC_RUN_ID": run_id,
            "TORCHELASTIC_USE_AGENT_STORE": "False",
        }
        if omp is not None:
            env["OMP_NUM_THREADS"] = omp
        out.append(env)
    return out


def request_of(torchrun: Sequence[str], env: Mapping[str, str], go: Mapping[str, object],
               node: str, rdzv_node: str, port: int) -> dict[str, object] | str:
    """The zygote's request for this node's ranks, or why the warm start cannot run them."""
    plan = plan_of(torchrun)
    if isinstance(plan, str):
        return plan
    world = world_of(go, env, node, rdzv_node)
    if world is None:
        return f"{node} is not in the step's node list"
    omp = env.get("OMP_NUM_THREADS") or ("1" if plan.nproc > 1 else None)
    common = dict(env)
    common.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    return {"t": "run", "python": sys.executable, "cwd": os.getcwd(),
            "target": plan.target, "module": plan.module, "args": list(plan.args),
            "env": common,
            "ranks": rank_envs(plan, world[0], world[1], (rdzv_node, port),
                               env.get("PET_RDZV_ID", ""), omp)}


# --------------------------------------------------------------------------------------------
# The agent's side


class WarmRun:
    """A step's ranks on this node, forked by a zygote (the node's warm one: `how` "warm", or
    "warming" when it was still importing; or one the agent started: "cold"), standing in for
    torchrun's Popen: `pid` is the zygote's (it leads the process group the ranks are in),
    `poll` gives its exit status (0, 1 when a rank failed, -9 when the zygote vanished
    without saying), `workers` the ranks."""

    def __init__(self, sock: socket.socket, pid: int, how: str,
                 popen: subprocess.Popen[bytes] | None = None) -> None:
        self.sock = sock
        self.pid = pid
        self.how = how
        self.popen = popen
        self.frames = Frames()
        self.ranks: list[int] = []
        self.rc: int | None = None
        self.why = ""
        self.eof = False
        sock.setblocking(False)

    def _read(self) -> None:
        while not self.eof:
            try:
                data = self.sock.recv(65536)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                data = b""
            if not data:
                self.eof = True
                break
            for msg in self.frames.feed(data):
                pids = msg.get("pids")
                if msg.get("t") == "started" and isinstance(pids, list):
                    self.ranks = [p for p in pids if isinstance(p, int)]
                elif msg.get("t") == "exit" and isinstance(msg.get("rc"), int):
                    self.rc = int(msg["rc"])  # type: ignore[call-overload]
                    self.why = str(msg.get("why", ""))[:500]
            if self.frames.bad:
                self.eof = True

    def poll(self) -> int | None:
        self._read()
        if self.popen is not None and self.popen.poll() is not None and self.rc is None:
            self._read()
            if self.rc is None:
                code = self.popen.returncode
                self.rc = code if code != 0 else -signal.SIGKILL
                self.eof = True
        if self.rc is None and self.eof:
            self.rc = -signal.SIGKILL
        if self.rc is not None and self.popen is not None:
            self.popen.poll()  # reap a cold zygote
        return self.rc

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            rc = self.poll()
            gone = (self.popen.poll() is not None if self.popen is not None
                    else not _alive(self.pid))
            if rc is not None and gone:
                return rc
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"warm zygote {self.pid}", timeout or 0.0)
            time.sleep(0.05)

    def workers(self) -> list[int]:
        """The ranks still running: the zygote's children it named."""
        from bluevela.launch.proctree import children

        self._read()  # the zygote's "started" (the ranks' pids) may be waiting
        return sorted(set(self.ranks) & set(children(self.pid)))

    def close(self) -> None:
        self.sock.close()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    try:  # a zombie of ours is gone for this purpose
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return False


def _from_server(path: str) -> tuple[socket.socket, int, bool] | None:
    """A connection now owned by the node's zygote, its pid and whether it was ready (its
    import done); None when no server answers, it has no zygote, or the peer is not this
    user."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(CONNECT_S)
        sock.connect(path)
        if peer_uid(sock) != os.getuid():
            raise OSError("the warm socket's peer is another user")
        msg, _ = read_one(sock, time.monotonic() + CONNECT_S)
    except OSError:
        sock.close()
        return None
    pid = msg.get("pid") if msg else None
    if not msg or msg.get("t") != "handed" or not isinstance(pid, int) or pid <= 1:
        sock.close()
        return None
    return sock, pid, msg.get("ready") is True


def zygote_argv(python: str = sys.executable) -> list[str]:
    return [python, "-P", "-m", "bluevela.launch.warm", "zygote"]


def _cold(env: Mapping[str, str]) -> tuple[socket.socket, subprocess.Popen[bytes]]:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 * MAX_MSG)
        popen = subprocess.Popen([*zygote_argv(), "--conn", str(theirs.fileno())],
                                 pass_fds=(theirs.fileno(),), start_new_session=True,
                                 stdin=subprocess.DEVNULL, env=dict(env))
    except OSError:
        ours.close()
        raise
    finally:
        theirs.close()
    return ours, popen


def connect(env: Mapping[str, str], node: str) -> WarmRun:
    """A zygote for this node's ranks: the node's warm one, else one started here (cold).

    Raises:
        OSError: no zygote could be started.
    """
    got = None
    try:
        got = _from_server(socket_path(env, node))
    except WarmError:
        pass
    if got is not None:
        return WarmRun(got[0], got[1], "warm" if got[2] else "warming")
    return cold_run()


def cold_run() -> WarmRun:
    """A zygote started here, a child of the agent (it imports as torchrun would)."""
    sock, popen = _cold(os.environ)
    return WarmRun(sock, popen.pid, "cold", popen)


def send_request(run: WarmRun, request: Mapping[str, object]) -> None:
    """The request, with this process's stdout and stderr for the ranks.

    Raises:
        OSError: it could not be sent (the zygote is gone; a cold one is killed).
    """
    data = frame(request)
    run.sock.setblocking(True)
    run.sock.settimeout(CONNECT_S if run.popen is None else None)
    try:
        socket.send_fds(run.sock, [data[:65536]], [1, 2])
        run.sock.sendall(data[65536:])
    except OSError:
        run.close()
        if run.popen is not None:
            run.popen.kill()
            run.popen.wait()
        raise
    run.sock.setblocking(False)


def launch(torchrun: Sequence[str], env: Mapping[str, str], go: Mapping[str, object],
           node: str, rdzv_node: str, port: int) -> WarmRun | str:
    """This node's ranks for the step: forked by the node's warm zygote, else by one started
    here (cold). A string says why torchrun must run instead (the same on every node).

    Raises:
        OSError: no zygote could be reached or started (the step's failure, as a torchrun
            that cannot start: falling back to torchrun on this node alone would split the
            step's rendezvous).
    """
    request = request_of(torchrun, env, go, node, rdzv_node, port)
    if isinstance(request, str):
        return request
    run = connect(env, node)
    try:
        send_request(run, request)
    except OSError:
        if run.how == "cold":
            raise
        # The warm zygote died between the handover and the request: nothing of this step
        # runs on this node yet, so a cold one is as good.
        run = cold_run()
        send_request(run, request)
    return run


# --------------------------------------------------------------------------------------------
# The zygote


@dataclass
class RankJob:
    """What a forked rank runs (returned up the zygote's stack to `main`, in the child only)."""

    env: dict[str, str]
    cwd: str
    target: str
    module: bool
    args: list[str]
    out: int
    err: int


def _preimport(env: Mapping[str, str]) -> None:
    """Import what the ranks will (site.yaml launch.warm_preimport). A module the job's
    Python does not have is left out (a site's list names frameworks some jobs lack; their
    ranks never import it); one that fails otherwise fails the zygote (the ranks would fail on
    it too). One whose import made a CUDA context is refused (the zygote goes, the node's ranks
    start cold): a forked rank cannot use its parent's context ("Cannot re-initialize CUDA in
    forked subprocess")."""
    import importlib

    for name in (n.strip() for n in (env.get(PREIMPORT_ENV, DEFAULT_PREIMPORT) or "").split(",")):
        if not name:
            continue
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name is None or not (name + ".").startswith(exc.name + "."):
                raise  # the module is there and imports one that is not: broken
    cuda = getattr(sys.modules.get("torch"), "cuda", None)
    if cuda is not None and cuda.is_initialized():
        raise WarmError("the import initialised CUDA, which a forked rank cannot use")


def _real_dir(path: str) -> str:
    return os.path.realpath(os.path.dirname(os.path.abspath(path)))


def check_request(msg: Mapping[str, object]) -> str:
    """Why a request cannot be served ('' when it can): every field's type and bounds."""
    if msg.get("t") != "run":
        return "not a run request"
    ranks, env, args = msg.get("ranks"), msg.get("env"), msg.get("args")
    if not isinstance(ranks, list) or not 1 <= len(ranks) <= MAX_RANKS:
        return "no ranks"
    for item in [env, *ranks]:
        if not isinstance(item, dict) or not all(
                isinstance(k, str) and isinstance(v, str) and "\0" not in k + v and "=" not in k
                for k, v in item.items()):
            return "an environment that is not names and texts"
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        return "arguments that are not texts"
    if not isinstance(msg.get("target"), str) or not msg["target"] \
            or not isinstance(msg.get("cwd"), str) or not isinstance(msg.get("module"), bool):
        return "no script or working directory"
    python = msg.get("python")
    if not isinstance(python, str) or _real_dir(python) != _real_dir(sys.executable):
        return f"the step's Python is not this zygote's {sys.executable}"
    return ""


def _fork_ranks(conn: socket.socket, msg: dict[str, object], fds: list[int]) -> RankJob | list[int]:
    """Fork one process per rank: the child returns its RankJob, the zygote the pids."""
    env: dict[str, str] = msg["env"]  # type: ignore[assignment]
    pids: list[int] = []
    for rank in msg["ranks"]:  # type: ignore[attr-defined]
        pid = os.fork()
        if pid == 0:
            conn.close()
            return RankJob({**env, **rank, HOW_ENV: str(msg.get("how", "warm"))},
                           str(msg["cwd"]), str(msg["target"]), bool(msg["module"]),
                           list(msg["args"]), fds[0], fds[1])  # type: ignore[call-overload]
        pids.append(pid)
    return pids


class _Ranks:
    """The zygote's ranks of one step, watched as torchrun's agent watches its workers."""

    def __init__(self, pids: list[int]) -> None:
        self.left = set(pids)
        self.codes: dict[int, int] = {}
        self.stop_at: float | None = None
        self.killed = False

    def signal_all(self, sig: int) -> None:
        for pid in self.left:
            try:
                os.kill(pid, sig)
            except OSError:
                pass

    def stop(self) -> None:
        if self.stop_at is None:
            self.stop_at = time.monotonic() + STOP_GRACE_S
            self.signal_all(signal.SIGTERM)

    def reap(self) -> None:
        for pid in list(self.left):
            try:
                done, status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                done, status = pid, 0
            if done:
                self.left.discard(pid)
                code = os.waitstatus_to_exitcode(status)
                self.codes[pid] = code
                if code != 0:
                    self.stop()  # the first failure ends the node's other ranks
        if self.stop_at is not None and self.left and not self.killed \
                and time.monotonic() > self.stop_at:
            self.killed = True
            self.signal_all(signal.SIGKILL)


def _watch(conn: socket.socket, pids: list[int]) -> int:
    """Until the ranks have ended (reported) or the agent is gone (ranks killed)."""
    ranks = _Ranks(pids)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    os.set_blocking(wake_r, False)
    signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
    got_term = []
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.signal(signal.SIGTERM, lambda *_: got_term.append(1))
    conn.setblocking(False)
    sel = selectors.DefaultSelector()
    sel.register(conn, selectors.EVENT_READ)
    sel.register(wake_r, selectors.EVENT_READ)
    try:
        conn.sendall(frame({"t": "started", "pids": pids}))
    except OSError:
        pass
    while ranks.left:
        for key, _ in sel.select(0.5):
            if key.fileobj is conn:
                try:
                    data = conn.recv(4096)
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError:
                    data = b""
                if not data:  # the agent is gone: so is its step, and every rank of it
                    ranks.signal_all(signal.SIGKILL)
                    for pid in list(ranks.left):
                        try:
                            os.waitpid(pid, 0)
                        except ChildProcessError:
                            pass
                    return 1
            else:
                try:
                    os.read(wake_r, 1024)
                except BlockingIOError:
                    pass
        if got_term:
            got_term.clear()
            ranks.stop()
        ranks.reap()
    failed = [code for code in ranks.codes.values() if code != 0]
    try:
        conn.setblocking(True)
        conn.settimeout(5.0)
        conn.sendall(frame({"t": "exit", "rc": 1 if failed else 0,
                            "codes": sorted(ranks.codes.values())}))
    except OSError:
        pass
    return 0


def _serve_step(conn: socket.socket, how: str) -> RankJob | int:
    """The zygote's one step on `conn`: the request, the ranks, their end."""
    msg, fds = read_one(conn, time.monotonic() + READ_S, max_fds=2)
    why = "no request" if msg is None else ("no output descriptors" if len(fds) != 2
                                            else check_request(msg))
    if msg is None or why:
        for fd in fds:
            os.close(fd)
        try:
            conn.settimeout(2.0)
            conn.sendall(frame({"t": "exit", "rc": 1, "why": why}))
        except OSError:
            pass
        _log(f"zygote {os.getpid()}: request refused: {why}")
        return 1
    msg["how"] = how
    got = _fork_ranks(conn, msg, fds)
    if isinstance(got, RankJob):
        return got
    for fd in fds:
        os.close(fd)
    return _watch(conn, got)


def zygote(link: int | None, conn_fd: int | None, delay: float = 0.0) -> RankJob | int:
    """The zygote's life: import, then one step (on the agent's connection, handed over by
    the server through `link`, or given at the start: `conn_fd`, a cold start). With a
    `delay`, the import waits that long or until a connection is handed over."""
    if link is not None and delay > 0:
        import select

        select.select([link], [], [], delay)
    try:
        _preimport(os.environ)
    except Exception as exc:  # noqa: BLE001 - said, and the step told why
        why = f"cannot import {os.environ.get(PREIMPORT_ENV, DEFAULT_PREIMPORT)}: {exc}"
        _log(why)
        if conn_fd is not None:
            conn = socket.socket(fileno=conn_fd)
            read_one(conn, time.monotonic() + READ_S, max_fds=2)
            try:
                conn.sendall(frame({"t": "exit", "rc": 1, "why": why}))
            except OSError:
                pass
        return 1
    if conn_fd is not None:
        return _serve_step(socket.socket(fileno=conn_fd), "cold")
    assert link is not None
    server = socket.socket(fileno=link)
    try:
        server.sendall(b"R")
    except OSError:
        pass  # handed over before its import ended: the server has let go of this link
    try:
        _, fds, _, _ = socket.recv_fds(server, 16, 1)
    except OSError:
        return 0
    if not fds:  # the server is gone (the job ends): a zygote that never got its turn
        return 0
    server.close()
    return _serve_step(socket.socket(fileno=fds[0]), "warm")


def run_rank(job: RankJob) -> None:
    """In a forked rank: become the script's process, then run it as ``__main__`` (its exit,
    an exception included, is this process's as with ``python SCRIPT``)."""
    import random
    import runpy

    signal.set_wakeup_fd(-1)
    for sig in (signal.SIGTERM, signal.SIGCHLD, signal.SIGUSR1, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.stdout.flush()
    sys.stderr.flush()
    for fd, std in ((job.out, 1), (job.err, 2)):
        os.dup2(fd, std)
        if fd not in (1, 2):
            os.close(fd)
    os.environ.clear()
    os.environ.update(job.env)
    os.chdir(job.cwd)
    random.seed()
    if job.env.get("PYTHONUNBUFFERED"):
        for stream in (sys.stdout, sys.stderr):
            if isinstance(stream, io.TextIOWrapper):
                stream.reconfigure(write_through=True)
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    head = os.getcwd() if job.module else _real_dir(job.target) if os.path.exists(job.target) \
        else os.path.dirname(os.path.abspath(job.target))
    extra = [p for p in job.env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [head, *extra, *(p for p in sys.path if p not in extra and p != head)]
    sys.argv = [job.target, *job.args]
    if job.env.get("BV_INTEGRATIONS") == "1":
        try:
            from bluevela.integrations import boot

            boot.start()
        except Exception as exc:  # noqa: BLE001 - as the start-up hook: the training runs
            sys.stderr.write(f"bv: integrations off in this process ({type(exc).__name__}: "
                             f"{exc})\n")
    try:
        if job.module:
            runpy.run_module(job.target, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(job.target, run_name="__main__")
    except SystemExit:
        raise
    except BaseException as exc:  # noqa: BLE001 - printed as `python SCRIPT` would, exit 1
        import traceback

        tb = exc.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename in (__file__, runpy.__file__,
                                                                     "<frozen runpy>"):
            tb = tb.tb_next  # the script's frames first, as in torchrun's ranks
        traceback.print_exception(type(exc), exc, tb)
        raise SystemExit(1) from None


# --------------------------------------------------------------------------------------------
# The server


def clear_stale(path: str) -> list[str]:
    """Remove the sockets of earlier jobs' servers on this node that nobody listens on any
    more (a server killed at its job's end leaves its socket): this user's sockets only."""
    folder, name = os.path.split(path)
    node = name.split(".", 1)[1]
    gone = []
    for entry in os.listdir(folder):
        if entry == name or not entry.endswith("." + node) \
                or not entry.split(".", 1)[0].isdigit():
            continue
        full = os.path.join(folder, entry)
        try:
            st = os.lstat(full)
            if not stat.S_ISSOCK(st.st_mode) or st.st_uid != os.getuid():
                continue
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
                probe.settimeout(0.2)
                probe.connect(full)
        except ConnectionRefusedError:
            try:
                os.unlink(full)
                gone.append(entry)
            except OSError:
                pass
        except OSError:
            continue
    return gone


class Server:
    """One node's warm server: the socket, one zygote, the used ones reaped."""

    def __init__(self, path: str) -> None:
        self.path = path
        clear_stale(path)
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            st = os.lstat(path)
            if stat.S_ISSOCK(st.st_mode) and st.st_uid == os.getuid():
                os.unlink(path)  # a server of this job killed before (its stale socket)
        except FileNotFoundError:
            pass
        old = os.umask(0o177)
        try:
            self.listener.bind(path)
        finally:
            os.umask(old)
        self.listener.listen(64)
        self.listener.setblocking(False)
        self.zygote: subprocess.Popen[bytes] | None = None
        self.link: socket.socket | None = None
        self.ready = False
        # The link of a zygote handed over before its import ended: its successor is started
        # when that import ends (two imports at once would slow the step just started).
        self.importing: socket.socket | None = None
        self.used: list[subprocess.Popen[bytes]] = []
        self.backoff = 1.0
        self.next_spawn = 0.0
        self.spawned_at = 0.0
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.listener, selectors.EVENT_READ)
        self.stopping = False

    def spawn(self, delay: float = 0.0) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        wait = ["--delay", f"{delay:g}"] if delay > 0 else []
        try:
            self.zygote = subprocess.Popen([*zygote_argv(), "--link", str(theirs.fileno()), *wait],
                                           pass_fds=(theirs.fileno(),), start_new_session=True,
                                           stdin=subprocess.DEVNULL)
        except OSError as exc:
            ours.close()
            _log(f"cannot start a zygote: {exc.strerror or exc}")
            self.next_spawn = time.monotonic() + self.backoff
            return
        finally:
            theirs.close()
        self.link, self.ready, self.spawned_at = ours, False, time.monotonic()
        self.sel.register(ours, selectors.EVENT_READ)

    def _drop_zygote(self, kill: bool) -> None:
        if self.link is not None:
            self.sel.unregister(self.link)
            self.link.close()
        if self.zygote is not None:
            if kill:
                _killpg(self.zygote.pid, signal.SIGKILL)
            self.used.append(self.zygote)
        self.link, self.zygote, self.ready = None, None, False

    def on_link(self) -> None:
        assert self.link is not None
        try:
            data = self.link.recv(16)
        except OSError:
            data = b""
        if data == b"R":
            self.ready, self.backoff = True, 1.0
            return
        self._zygote_died()

    def on_imported(self) -> None:
        """The zygote handed over while importing has imported (or died): its successor now,
        after RESPAWN_DELAY_S as any successor."""
        assert self.importing is not None
        self.sel.unregister(self.importing)
        self.importing.close()
        self.importing = None
        if self.zygote is None and not self.stopping:
            self.spawn(RESPAWN_DELAY_S)

    def _zygote_died(self) -> None:
        """Replaced: at once, or later while they keep dying within 5 s of their start."""
        early = time.monotonic() - self.spawned_at < 5
        self._drop_zygote(kill=True)
        self.next_spawn = time.monotonic() + (self.backoff if early else 0)
        self.backoff = min(RESPAWN_MAX_S, self.backoff * 2) if early else 1.0

    def on_accept(self) -> None:
        try:
            conn, _ = self.listener.accept()
        except OSError:
            return
        with conn:
            try:
                conn.settimeout(1.0)
                if peer_uid(conn) != os.getuid():
                    _log("a connection from another user: refused")
                    return
                if self.zygote is None or self.link is None:
                    conn.sendall(frame({"t": "none", "why": "no zygote (replacing a dead one)"}))
                    return
            except OSError:
                return
            # One still importing is handed too: it serves the step once imported, sooner
            # than a cold one started now, which would import beside it on the same cores.
            try:
                socket.send_fds(self.link, [b"C"], [conn.fileno()])
            except OSError:  # it died since: replaced, and this agent goes cold
                self._zygote_died()
                try:
                    conn.sendall(frame({"t": "none", "why": "the zygote died"}))
                except OSError:
                    pass
                return
            pid, ready = self.zygote.pid, self.ready
            if ready:
                self._drop_zygote(kill=False)  # the step's now, whatever the agent does next
                self.spawn(RESPAWN_DELAY_S)
            else:
                self.importing, self.link = self.link, None
                self.used.append(self.zygote)
                self.zygote, self.next_spawn = None, float("inf")
            try:
                # Said once the zygote holds the connection: it reads nothing before the
                # request, which the agent sends only after this.
                conn.sendall(frame({"t": "handed", "pid": pid, "ready": ready}))
            except OSError:
                pass

    def reap(self) -> None:
        self.used = [p for p in self.used if p.poll() is None]
        if self.zygote is None and time.monotonic() >= self.next_spawn and not self.stopping:
            self.spawn()

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, self._stop)
        node = os.path.basename(self.path).split(".", 1)[1].removesuffix(".sock")
        later = node in os.environ.get(LATER_ENV, "").split(",")
        self.spawn(LATER_DELAY_S if later else 0.0)
        try:
            while not self.stopping:
                for key, _ in self.sel.select(0.5):
                    if key.fileobj is self.listener:
                        self.on_accept()
                    elif key.fileobj is self.link:
                        self.on_link()
                    elif key.fileobj is self.importing:
                        self.on_imported()
                self.reap()
        finally:
            self.close()
        return 0

    def _stop(self, *_: object) -> None:
        self.stopping = True

    def close(self) -> None:
        """The job ends: the socket goes, and every zygote with its ranks."""
        try:
            os.unlink(self.path)
        except OSError:
            pass
        self.listener.close()
        if self.importing is not None:
            self.importing.close()
        self._drop_zygote(kill=True)
        for popen in self.used:
            _killpg(popen.pid, signal.SIGKILL)
        for popen in self.used:
            try:
                popen.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass


def _killpg(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except OSError as exc:
        if exc.errno not in (errno.ESRCH, errno.EPERM):
            raise


# --------------------------------------------------------------------------------------------
# The supervisor's side


def server_step_argv(alloc: Sequence[str], python: str = sys.executable) -> list[str]:
    """The srun step that keeps a warm server on every node of the allocation for the job's
    life: it overlaps the training steps (``--overlap``), a node lost does not end it
    (``--no-kill``), nor does a server that ends (``--kill-on-bad-exit=0``)."""
    return ["srun", "--overlap", "--no-kill", "--quiet", "--kill-on-bad-exit=0", f"--nodes={len(alloc)}",
            f"--ntasks={len(alloc)}", "--ntasks-per-node=1", f"--nodelist={','.join(alloc)}",
            "--export=ALL", "--job-name=bv-warm", python, "-P", "-m", "bluevela.launch.warm",
            "serve"]


def start_servers(alloc: Sequence[str], env: Mapping[str, str],
                  first: Sequence[str] = ()) -> subprocess.Popen[bytes] | None:
    """The warm servers' step, when the job asks for the warm start; None otherwise or when
    srun cannot start (then every node starts its ranks cold: said once). The nodes outside
    `first` (the first step's) import later (`LATER_ENV`)."""
    if not enabled(env):
        return None
    later = ",".join(n for n in alloc if first and n not in first)
    try:
        return subprocess.Popen(server_step_argv(alloc), env={**env, LATER_ENV: later},
                                stdin=subprocess.DEVNULL, start_new_session=True)
    except OSError as exc:
        _log(f"no warm servers ({exc.strerror or exc}): the ranks start cold")
        return None


def stop_servers(proc: subprocess.Popen[bytes] | None, wait_s: float = 0.5) -> None:
    """At the job's end: SIGTERM to the servers' srun (it forwards it: each server removes
    its socket and kills its zygotes). Not waited for beyond `wait_s`: srun may wait for a
    node that is gone, and the job's end is Slurm's kill of the step anyway."""
    if proc is None or proc.poll() is not None:
        return
    try:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=wait_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# --------------------------------------------------------------------------------------------
# Entry


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["serve"]:
        node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
        try:
            path = socket_path(os.environ, node)
            server = Server(path)
        except (WarmError, OSError) as exc:
            _log(f"no warm server on {node}: {exc}")
            return 1
        return server.run()
    delay = 0.0
    if args[:1] == ["zygote"] and len(args) == 5 and args[1] == "--link" and args[3] == "--delay":
        try:
            delay = min(3600.0, max(0.0, float(args[4])))
        except ValueError:
            delay = 0.0
        args = args[:3]
    if args[:1] == ["zygote"] and len(args) == 3 and args[1] in ("--link", "--conn") \
            and args[2].isdigit():
        fd = int(args[2])
        got = zygote(fd if args[1] == "--link" else None, fd if args[1] == "--conn" else None,
                     delay)
        if isinstance(got, RankJob):
            run_rank(got)
            return 0
        return got
    _log("usage: python -m bluevela.launch.warm serve | zygote --link FD [--delay S] | "
         "zygote --conn FD")
    return 2


if __name__ == "__main__":
    sys.exit(main())
