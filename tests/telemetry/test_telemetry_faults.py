"""The node sampler under faults, each reproduced for real (issue 16, section 2).

- A hung NVML: a stand-in `libnvidia-ml.so.1` (built here from C, found first through
  LD_LIBRARY_PATH as the real one is found through ld.so.cache) whose `nvmlInitWithFlags`
  never returns, as the driver's does for a GPU fallen off the bus; and the recorded H100
  snapshot with a hung call (tests/data/health/h100-gpu-nvml-hang), which the replay blocks on.
- A full disk: a 64 KiB tmpfs mounted here (root only), filled up.
- A stuck sampling loop: `/proc/stat` under BV_SYSFS_ROOT swapped for a FIFO with no writer, so
  the loop's own read blocks, as a read from a dead NFS/FUSE mount would.
- A wrong clock: segments named in the future, and a clock that steps back.
- The systemd watchdog: the test binds the NOTIFY_SOCKET datagram socket itself.
"""

from __future__ import annotations

import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bluevela.health.context import ProbeContext
from bluevela.site import load_site
from bluevela.telemetry.format import Column, Header, SegmentWriter, list_segments, read_file
from bluevela.telemetry.sampler import Config, Sampler
from tests.conftest import build_standin_nvml, unix_dgram_listener

REPO = Path(__file__).resolve().parents[2]
H100 = REPO / "tests" / "data" / "health" / "h100-healthy"
HANG = REPO / "tests" / "data" / "health" / "h100-gpu-nvml-hang"

HUNG_NVML_C = r"""
#include <unistd.h>
/* nvmlInit as a GPU fallen off the bus leaves it: the call never returns. */
int nvmlInitWithFlags(unsigned int flags) { (void)flags; for (;;) pause(); return 0; }
int nvmlInit_v2(void) { for (;;) pause(); return 0; }
int nvmlInit(void) { for (;;) pause(); return 0; }
"""


def _ctx(root: Path = H100 / "root", snapshot: Path | None = H100 / "nvml.json") -> ProbeContext:
    site = load_site(REPO / "site.yaml")
    return ProbeContext(site.node_classes["h100"], "h100", root=root, nvml_snapshot=snapshot)


def _cfg(samples: Path, interval: float = 0.1, retain_s: float = 48 * 3600.0,
         max_bytes: int = 256 << 20) -> Config:
    return Config(samples, "gpu001", interval, retain_s, max_bytes)


@pytest.fixture(scope="module")
def hung_nvml_lib(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_standin_nvml(tmp_path_factory.mktemp("hung-nvml"), HUNG_NVML_C)


def _root(tmp: Path, proc_stat: bool = False) -> Path:
    """A sysfs root with the H100's IB ports; /proc is this machine's, but for `proc_stat`: a
    proc/stat of its own (a copy of this machine's) that the test can swap."""
    root = tmp / "root"
    shutil.copytree(H100 / "root" / "sys", root / "sys", symlinks=True)
    if proc_stat:
        (root / "proc").mkdir()
        (root / "proc" / "stat").write_text(Path("/proc/stat").read_text())
    return root


def _env(state: Path, root: Path, *, snapshot: Path | None, interval: float = 0.2,
         **more: str) -> dict[str, str]:
    env = dict(os.environ, BV_HOOK_ENV="none", BV_SITE=str(REPO / "site.yaml"),
               BV_CACHE_DIR="off", BV_NODE_CLASS="h100", BV_SYSFS_ROOT=str(root),
               BV_STATE_DIR=str(state), BV_SAMPLER_INTERVAL_S=str(interval),
               BV_NVML_SNAPSHOT=str(snapshot) if snapshot else "", BV_HOOK_LOG_LEVEL="INFO")
    for k in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "LD_LIBRARY_PATH"):
        env.pop(k, None)
    env.update(more)
    return env


def _start(env: dict[str, str]) -> subprocess.Popen[bytes]:
    # The package of this checkout (PYTHONPATH, so not -I as the shim runs it): an old
    # checkout's copy of this file then runs the old sampler.
    env = dict(env, PYTHONPATH=str(REPO))
    return subprocess.Popen([sys.executable, "-m", "bluevela.telemetry.sampler"],
                            env=env, cwd="/", stderr=subprocess.PIPE)


def _stop(p: subprocess.Popen[bytes], within_s: float) -> tuple[float, str]:
    """SIGTERM, then the seconds it took to exit and its log (SIGKILL past `within_s`)."""
    t = time.monotonic()
    p.send_signal(signal.SIGTERM)
    try:
        _, err = p.communicate(timeout=within_s)
    except subprocess.TimeoutExpired:
        p.kill()
        _, err = p.communicate()
        return math.inf, err.decode()
    return time.monotonic() - t, err.decode()


def _records(samples: Path) -> list[dict[str, float]]:
    out = []
    for _, name in list_segments(samples):
        try:
            seg = read_file(samples / name)
        except (OSError, ValueError):
            continue
        for t, vals in seg.records():
            out.append(dict(zip(seg.header.names, vals, strict=True), t=t))
    return out


def _wait(cond: object, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():  # type: ignore[operator]
            return True
        time.sleep(0.05)
    return False


# -- a hung NVML ------------------------------------------------------------------------------


def test_hung_live_nvml_leaves_gpus_missing_samples_the_rest_and_sigterm_stops(
        tmp_path: Path, hung_nvml_lib: Path) -> None:
    root = _root(tmp_path)
    samples = tmp_path / "samples"
    p = _start(_env(tmp_path, root, snapshot=None, LD_LIBRARY_PATH=str(hung_nvml_lib)))
    try:
        ok = _wait(lambda: len(_records(samples)) >= 6, 30)
    finally:
        took, log = _stop(p, 10)
    # Old code: no sample at all, and SIGTERM did not end it (SIGKILL after 10 s).
    assert ok and took < 5 and p.returncode == 0, (f"samples: {ok}, SIGTERM->exit: {took} s, "
                                                   f"rc {p.returncode}\n{log}")
    recs = _records(samples)
    assert not [k for k in recs[-1] if k.startswith("gpu")]  # never read: no GPU columns
    assert all(r["node.gpus_missing"] == 8 for r in recs)  # the class's 8 GPUs, every tick
    hung = [r["node.nvml_hung_s"] for r in recs]
    assert hung[0] > 0 and hung == sorted(hung) and hung[-1] - hung[0] > 0.5  # one call, growing
    assert all(math.isfinite(r["ib.mlx5_0/1.rx_bytes_per_s"]) for r in recs[1:])
    assert all(math.isfinite(r["node.cpu_busy_pct"]) for r in recs[1:])
    assert log.count("NVML has not answered") == 1 and "Traceback" not in log, log
    assert "stopped after" in log


def test_replayed_nvml_hang_mid_run_keeps_the_gpu_columns_as_nan(tmp_path: Path) -> None:
    """The recorded snapshot's hung call (nvmlDeviceGetTemperature on GPU3) replaces a healthy
    one under a running sampler: the GPUs go NaN in place (no new segment per tick), the node
    columns say so, and the GPUs come back when NVML answers again."""
    snap = tmp_path / "nvml.json"
    shutil.copy(H100 / "nvml.json", snap)
    s = Sampler(_ctx(snapshot=snap), _cfg(tmp_path / "samples", interval=0.2))
    stop = threading.Event()
    t = threading.Thread(target=s.run, args=(stop,), daemon=True)
    t.start()
    samples = tmp_path / "samples"
    try:
        assert _wait(lambda: len(_records(samples)) >= 3, 20)
        shutil.copy(HANG / "nvml.json", tmp_path / "hang.json")
        os.replace(tmp_path / "hang.json", snap)
        assert _wait(lambda: sum(r["node.gpus_missing"] == 8 for r in _records(samples)) >= 4, 20)
        assert t.is_alive() and s.gpu.hung
    finally:
        stop.set()
        t.join(10)
    assert not t.is_alive()  # stopped although the NVML thread is still blocked
    recs = _records(samples)
    good = [r for r in recs if r["node.gpus_missing"] == 0]
    missing = [r for r in recs if r["node.gpus_missing"] == 8]
    assert len(good) >= 3 and len(missing) >= 4
    assert all(r["gpu0.temp_c"] == 31.0 and r["node.nvml_hung_s"] == 0.0 for r in good)
    assert all(math.isnan(r["gpu0.temp_c"]) and r["node.nvml_hung_s"] > 0 for r in missing)
    assert all(math.isfinite(r["node.mem_used_bytes"]) for r in missing)
    assert len(list_segments(samples)) == 1  # the same columns: no roll per hung tick


# -- the systemd watchdog ---------------------------------------------------------------------


@pytest.fixture()
def notify_sock(tmp_path: Path) -> Iterator[tuple[socket.socket, Path]]:
    path = tmp_path / "notify.sock"
    sock = unix_dgram_listener(path, 0.1)
    yield sock, path
    sock.close()


def _messages(sock: socket.socket, seconds: float) -> list[str]:
    out, end = [], time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            out.extend(sock.recv(4096).decode().split("\n"))
        except TimeoutError:
            pass
    return out


def test_watchdog_pings_go_on_while_nvml_hangs_and_stop_when_the_loop_is_stuck(
        tmp_path: Path, hung_nvml_lib: Path, notify_sock: tuple[socket.socket, Path]) -> None:
    sock, path = notify_sock
    root = _root(tmp_path, proc_stat=True)
    stat = root / "proc" / "stat"
    p = _start(_env(tmp_path, root, snapshot=None, NOTIFY_SOCKET=str(path),
                    WATCHDOG_USEC="2000000", LD_LIBRARY_PATH=str(hung_nvml_lib)))
    try:
        first = _messages(sock, 4.0)
        assert "READY=1" in first, first
        # NVML hangs from the first call, yet the loop completes its ticks and pings.
        assert first.count("WATCHDOG=1") >= 5, first
        assert any(m.startswith("STATUS=NVML hung") for m in first), first
        # Now the loop itself blocks: its /proc/stat is a FIFO no one writes.
        os.mkfifo(tmp_path / "fifo")
        os.replace(tmp_path / "fifo", stat)
        _messages(sock, 0.5)  # a tick already past the read may still ping
        stuck = _messages(sock, 3.0)
        assert "WATCHDOG=1" not in stuck, stuck
        assert p.poll() is None  # alive, only stuck
        # Unblock the read: the pings come back (it was the stuck loop that stopped them).
        fd = os.open(stat, os.O_RDWR)
        (tmp_path / "stat").write_text(Path("/proc/stat").read_text())
        os.replace(tmp_path / "stat", stat)
        os.write(fd, Path("/proc/stat").read_bytes()[:4000])
        os.close(fd)
        again = _messages(sock, 2.0)
        assert again.count("WATCHDOG=1") >= 3, again
    finally:
        took, log = _stop(p, 10)
    assert took < 5 and p.returncode == 0, (took, log)
    assert "STOPPING=1" in _messages(sock, 0.3)


# -- a full disk ------------------------------------------------------------------------------


@pytest.fixture()
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "disk"
    mnt.mkdir()
    try:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k,mode=0755", "tmpfs", str(mnt)],
                       check=True, capture_output=True, timeout=30)
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"cannot mount a tmpfs here: {exc}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False, capture_output=True, timeout=30)


def _fill(directory: Path) -> Path:
    filler = directory / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        for size in (4096, 512, 8):
            while True:
                try:
                    os.write(fd, b"\0" * size)
                except OSError:
                    break
    finally:
        os.close(fd)
    return filler


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_full_disk_leaks_no_descriptor_leaves_no_file_and_recovers(
        tmp_path: Path, small_tmpfs: Path) -> None:
    state = small_tmpfs
    (state / "samples").mkdir()
    filler = _fill(state)
    p = _start(_env(state, H100 / "root", snapshot=H100 / "nvml.json", interval=0.05))
    try:
        time.sleep(1.5)  # start-up and its imports
        before = _fds(p.pid)
        time.sleep(3.0)  # 60 ticks on a full disk
        after = _fds(p.pid)
        assert after - before <= 1, (before, after)  # old code: one more per failed tick
        assert os.listdir(state / "samples") == []  # no empty segment left behind
        filler.unlink()  # space returns
        assert _wait(lambda: len(_records(state / "samples")) >= 3, 10)
        assert _fds(p.pid) - before <= 2  # the one open segment
    finally:
        _, log = _stop(p, 10)
    assert p.returncode == 0, log
    assert log.count("sample not written") == 1, log  # once, not per tick
    assert "writing samples again" in log and "Traceback" not in log, log
    for _, name in list_segments(state / "samples"):
        assert read_file(state / "samples" / name, strict=True).n_records >= 1


def test_full_disk_of_expired_segments_is_pruned_before_a_new_one_is_opened(
        tmp_path: Path, small_tmpfs: Path) -> None:
    """Old segments past retention fill the disk: pruning first makes the room."""
    samples = small_tmpfs / "samples"
    samples.mkdir()
    now = time.time()
    cols = tuple(Column(f"node.c{i}", "node", "1") for i in range(50))
    old = []
    for h in range(100):
        path = samples / f"seg-{int(now) - (200 - h) * 3600}.bvts"
        try:
            w = SegmentWriter(path, Header("gpu001", 10.0, cols, now - (200 - h) * 3600))
            for k in range(10):
                w.append(now - (200 - h) * 3600 + 10 * k, [1.0] * 50)
        except OSError:
            break  # the disk is full
        finally:
            if path.exists():
                w.close(sync=False)
        old.append(path.name)
    _fill(small_tmpfs)
    s = Sampler(_ctx(), _cfg(samples, interval=0.05, retain_s=3600.0))
    stop = threading.Event()
    assert s.run(stop, duration_s=0.5) == 0
    left = [name for _, name in list_segments(samples)]
    assert not set(left) & set(old)  # all past retention: gone
    assert left and read_file(samples / left[-1], strict=True).n_records >= 3


# -- a wrong clock ----------------------------------------------------------------------------


def _seg(samples: Path, start: float, n: int, ncols: int = 20) -> str:
    cols = tuple(Column(f"node.c{i}", "node", "1") for i in range(ncols))
    w = SegmentWriter(samples / f"seg-{int(start)}.bvts", Header("gpu001", 10.0, cols, start))
    for k in range(n):
        w.append(start + 10 * k, [float(k)] * ncols)
    w.close(sync=False)
    return f"seg-{int(start)}.bvts"


def test_a_future_dated_segment_is_pruned_and_never_costs_the_newest(tmp_path: Path) -> None:
    """A boot with the clock a month ahead wrote one big segment; the clock was corrected. The
    real segments of the last hours are within their bounds only without that one."""
    samples = tmp_path / "samples"
    samples.mkdir()
    now = time.time()
    real = [_seg(samples, now - h * 3600, 300) for h in (5, 4, 3, 2, 1)]
    future = _seg(samples, now + 30 * 86400, 1500)
    size = sum((samples / n).stat().st_size for n in real)
    s = Sampler(_ctx(), _cfg(samples, interval=0.05, max_bytes=size + 200_000))
    assert s.run(threading.Event(), duration_s=0.3) == 0
    left = [name for _, name in list_segments(samples)]
    assert future not in left
    assert left[:5] == real  # the newest real segments all kept
    assert len(left) == 6 and read_file(samples / left[-1]).n_records >= 2


def test_a_clock_stepped_back_starts_a_new_segment(tmp_path: Path) -> None:
    s = Sampler(_ctx(), _cfg(tmp_path / "samples", interval=10.0))
    t0 = 1_750_000_000.0
    for t in (t0, t0 + 10, t0 + 20, t0 + 5, t0 + 15):  # stepped back 15 s after the third
        s.record(t)
    s.store.writer.close()  # type: ignore[union-attr]
    for _, name in list_segments(tmp_path / "samples"):
        times = [t for t, _ in read_file(tmp_path / "samples" / name).records()]
        assert times == sorted(times), (name, times)
    assert len(list_segments(tmp_path / "samples")) == 2


def test_nvml_worker_slow_lags_a_tick_hung_costs_one_wait() -> None:
    """A slow NVML (0.3 s a reading, deadline 0.1 s) misses its first tick only, then each tick
    takes the reading the previous tick started; a hung one costs the asking tick its deadline
    and later ticks nothing."""
    from bluevela.telemetry.gpu import NVMLWorker

    calls: list[float] = []

    def slow() -> tuple[None, dict[int, dict[str, float]], str]:
        calls.append(time.monotonic())
        time.sleep(0.3)
        return None, {0: {"n": float(len(calls))}}, "live"

    w = NVMLWorker(slow)
    got = []
    for _ in range(5):
        got.append(w.get(0.1, 1.0))
        time.sleep(0.5)  # the interval
    assert got[0] is None and all(g is not None for g in got[1:]), got
    assert [g[1][0]["n"] for g in got[1:] if g] == [1.0, 2.0, 3.0, 4.0]
    assert len(calls) == 5  # one call per tick, never two at once

    release = threading.Event()

    def stuck() -> tuple[None, dict[int, dict[str, float]], str]:
        release.wait()
        return None, {}, "live"

    hung = NVMLWorker(stuck)
    t = time.monotonic()
    assert hung.get(0.2, 1.0) is None
    assert 0.2 <= time.monotonic() - t < 1.0
    t = time.monotonic()
    for _ in range(10):
        assert hung.get(0.2, 1.0) is None
    assert time.monotonic() - t < 0.1 and hung.in_flight_s() > 0.2  # no wait while it hangs
    release.set()
    assert _wait(lambda: hung.in_flight_s() == 0.0, 2)
    assert hung.get(0.2, 1.0) is not None  # it answered: read again


def test_a_new_segment_never_shows_without_its_header(tmp_path: Path) -> None:
    """The epilog may list the samples while the sampler opens a segment (on the hour, at a
    restart). The segment's name appears only once its header is on disk: a reader racing
    every start sees a whole header or no file (CI once read an empty new segment)."""
    samples = tmp_path / "samples"
    samples.mkdir()
    header = Header("gpu001", 1.0, (Column("cpu_busy_pct", "node", "%"),), 1_750_000_000.0)
    stop = threading.Event()
    bad: list[str] = []
    seen = [0]

    def reader() -> None:
        while not stop.is_set():
            for _, name in list_segments(samples):
                seen[0] += 1
                try:
                    read_file(samples / name)
                except FileNotFoundError:
                    pass
                except ValueError as exc:
                    bad.append(f"{name}: {exc}")

    t = threading.Thread(target=reader)
    t.start()
    try:
        for i in range(400):
            SegmentWriter(samples / f"seg-{1_750_000_000 + i}.bvts", header).close(sync=False)
            os.unlink(samples / f"seg-{1_750_000_000 + i}.bvts")
    finally:
        stop.set()
        t.join()
    assert seen[0] > 0  # the reader did race the writer
    assert bad == []
    assert [n for n in os.listdir(samples)] == []  # no temporary name left behind


def test_a_killed_starts_temporary_segment_is_pruned(tmp_path: Path) -> None:
    """A sampler killed between writing a header and linking it leaves `.seg-*.tmp`: the next
    sampler's prune removes it once it is a minute old, and never reads it as a segment."""
    samples = tmp_path / "samples"
    samples.mkdir()
    stale = samples / ".seg-1750000000.bvts.4242.tmp"
    fresh = samples / ".seg-1750000001.bvts.4243.tmp"
    for p in (stale, fresh):
        p.write_bytes(b"BVTS1\n")
    old = time.time() - 120
    os.utime(stale, (old, old))
    s = Sampler(_ctx(), _cfg(samples, interval=0.05))
    assert s.run(threading.Event(), duration_s=0.2) == 0
    assert not stale.exists()
    assert fresh.exists()  # another start may be under way
    assert all(not name.startswith(".") for _, name in list_segments(samples))
