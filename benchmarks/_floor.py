"""The kernel floor: what a namespace guest cannot cost less than, with no plugin and no helper.

Run as ``python -I -S _floor.py LOWER WORKDIR N``: a small interpreter, like the backend's own
zygote. Each iteration: fork; unshare mount/pid/net/uts/ipc; a private tmpfs and an overlay of
LOWER; one process spawned as pid 1 of the new pid namespace; wait; the kernel tears it all
down when the forked process exits. Prints one JSON list: seconds per iteration.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import time

CLONE_FLAGS = 0x00020000 | 0x04000000 | 0x08000000 | 0x20000000 | 0x40000000  # NS UTS IPC PID NET
MS_REC_PRIVATE = 0x4000 | 0x40000

libc = ctypes.CDLL("libc.so.6", use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def one(lower: str, workdir: str) -> None:
    os.mkdir(workdir)
    pid = os.fork()
    if pid == 0:
        try:
            _check(libc.unshare(ctypes.c_int(CLONE_FLAGS)), "unshare")
            _check(libc.mount(None, b"/", None, ctypes.c_ulong(MS_REC_PRIVATE), None), "mount --make-rprivate")
            _check(libc.mount(b"floor", workdir.encode(), b"tmpfs", ctypes.c_ulong(0), b"size=64m"), "tmpfs")
            for sub in ("upper", "work", "root"):
                os.mkdir(os.path.join(workdir, sub))
            options = f"lowerdir={lower},upperdir={workdir}/upper,workdir={workdir}/work"
            _check(libc.mount(b"floor", f"{workdir}/root".encode(), b"overlay", ctypes.c_ulong(0),
                              options.encode()), "overlay")
            child = os.posix_spawn("/bin/true", ["true"], {})  # pid 1 of the new pid namespace
            os.waitpid(child, 0)
            os._exit(0)
        except BaseException as exc:
            os.write(2, f"floor: {exc}\n".encode())
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    if status != 0:
        raise SystemExit(f"floor iteration failed (status {status})")
    os.rmdir(workdir)


def main() -> None:
    lower, base, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
    times = []
    for i in range(count):
        started = time.perf_counter()
        one(lower, os.path.join(base, f"floor-{os.getpid()}-{i}"))
        times.append(time.perf_counter() - started)
    print(json.dumps(times))


if __name__ == "__main__":
    main()
