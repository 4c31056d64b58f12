"""A genuinely hung mount for tests: a FUSE mount whose daemon never answers.

`mount_hung(path)` opens /dev/fuse and mounts it at `path` (mount(2), type `fuse.bvhung`),
then never reads the device: the kernel's FUSE_INIT and every later request (statfs, lookup,
getattr) wait for an answer that never comes, exactly as on a Lustre/GPFS/NFS mount whose
servers are gone, and the mount is listed in /proc/mounts all the while. The waits are
killable (SIGKILL), as Lustre's are. Closing the returned fd aborts the connection (then
every call fails with ENOTCONN, "Transport endpoint is not connected").

Run it in a private mount namespace (`unshare -m --propagation private`, or a dev cluster
node's namespace, whose propagation is private) so the host never sees the mount.

    python tests/fuse_hang.py MOUNTPOINT   # mount, print "mounted", hold it until killed
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys


def fuse_available() -> bool:
    return os.geteuid() == 0 and os.path.exists("/dev/fuse")


def mount_hung(path: str) -> int:
    """Mount a never-answering FUSE file system at `path`; returns the /dev/fuse fd to hold.

    Raises:
        OSError: /dev/fuse cannot be opened or mount(2) fails.
    """
    os.makedirs(path, exist_ok=True)
    fd = os.open("/dev/fuse", os.O_RDWR)
    libc = ctypes.CDLL(None, use_errno=True)
    opts = f"fd={fd},rootmode=40000,user_id=0,group_id=0".encode()
    if libc.mount(b"bvhung", path.encode(), b"fuse.bvhung", 0, opts) != 0:
        err = ctypes.get_errno()
        os.close(fd)
        raise OSError(err, f"mount fuse at {path}: {os.strerror(err)}")
    return fd


def main() -> int:
    fd = mount_hung(sys.argv[1])
    print("mounted", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    while True:
        signal.pause()
    os.close(fd)  # pragma: no cover


if __name__ == "__main__":
    raise SystemExit(main())
