"""The kernel floor: what a confined namespace guest cannot cost less than, with no plugin and no helper.

Run as ``python -I -S _floor.py LOWER WORKDIR N BPF [guest-mounts]``: a small interpreter, like
the backend's own zygote. Each iteration: the guest's cgroups with their limits (the backend's own
``cgroups.create``: the same mkdirs and writes); fork; join them; unshare
mount/pid/net/uts/ipc/cgroup; a private tmpfs and an overlay of LOWER; load the seccomp filter
in BPF (the file the backend would send, compiled by libseccomp); one process spawned as pid 1
of the new pid namespace; wait; the kernel tears the namespaces down when the forked process
exits; remove the cgroups. Prints one JSON list: seconds per iteration.

With ``guest-mounts`` the tmpfs and overlay are made by the backend's own code, with
everything else a hardened guest mounts: its /dev (nodes, links, a /dev/shm tmpfs), its /proc
with Docker's masked and read-only paths, its hostname and loopback, and the pivot into its
root (``helper.setup._mount_root`` and ``_enter_root``, imported in-process: the helper's
module, in the helper's interpreter, without the package). The /proc is mounted by the
forked process, not by a pid 1 of the new namespace: the same mounts, made one process up.

``python -I -S _floor.py serve LOWER WORKDIR BPF ARGV...`` serves iterations with the guest's
mounts, one per line read on stdin, whose pid 1 runs ARGV inside the guest's root and whose
output (a pipe's worth at most) is written back as one line: a hardened namespace per test with
no plugin and no guest helper, for benchmarks/scaling_floor.py.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from pytest_smolvm.backends.namespace import cgroups  # standard library only, as the zygote

CLONE_FLAGS = 0x00020000 | 0x04000000 | 0x08000000 | 0x20000000 | 0x40000000 | 0x02000000  # NS UTS IPC PID NET CGROUP
MS_REC_PRIVATE = 0x4000 | 0x40000
PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2


class SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

libc = ctypes.CDLL("libc.so.6", use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _guest_module() -> Any:
    """The helper's setup module: what a guest's setup process runs to make its root."""
    from pytest_smolvm.backends.namespace.helper import setup

    return setup


def one(lower: str, workdir: str, limits: cgroups.Limits, bpf: bytes, guest: Any,
        argv: tuple[str, ...] = ("/bin/true",), stdout_fd: int | None = None) -> None:
    os.mkdir(workdir)
    groups = cgroups.create(limits, os.path.basename(workdir), cpus=None, memory_mb=None)
    pid = os.fork()
    if pid == 0:
        try:
            for group in groups:
                with open(os.path.join(group, "cgroup.procs"), "wb", buffering=0) as f:
                    f.write(b"0")
            _check(libc.unshare(ctypes.c_int(CLONE_FLAGS)), "unshare")
            if guest is not None:
                req = {"scratch": workdir, "lower": [lower], "userns": False, "disk_mb": 64,
                       "hostname": "floor", "network": False}
                guest._enter_root(guest._mount_root(req), req)
            else:
                _check(libc.mount(None, b"/", None, ctypes.c_ulong(MS_REC_PRIVATE), None), "mount --make-rprivate")
                _check(libc.mount(b"floor", workdir.encode(), b"tmpfs", ctypes.c_ulong(0), b"size=64m"), "tmpfs")
                for sub in ("upper", "work", "root"):
                    os.mkdir(os.path.join(workdir, sub))
                options = f"lowerdir={lower},upperdir={workdir}/upper,workdir={workdir}/work"
                _check(libc.mount(b"floor", f"{workdir}/root".encode(), b"overlay", ctypes.c_ulong(0),
                                  options.encode()), "overlay")
            if bpf:
                program = ctypes.create_string_buffer(bpf, len(bpf))
                fprog = SockFprog(len(bpf) // 8, ctypes.addressof(program))
                _check(libc.prctl(ctypes.c_int(PR_SET_SECCOMP), ctypes.c_ulong(SECCOMP_MODE_FILTER),
                                  ctypes.byref(fprog), ctypes.c_ulong(0), ctypes.c_ulong(0)), "seccomp")
            actions = [(os.POSIX_SPAWN_DUP2, stdout_fd, 1)] if stdout_fd is not None else []
            child = os.posix_spawn(argv[0], list(argv), {}, file_actions=actions)  # pid 1 of the new pid namespace
            os.waitpid(child, 0)
            os._exit(0)
        except BaseException as exc:
            os.write(2, f"floor: {exc}\n".encode())
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    if status != 0:
        raise SystemExit(f"floor iteration failed (status {status})")
    for group in groups:
        cgroups.remove(group)
    os.rmdir(workdir)


def serve(lower: str, base: str, bpf: bytes, argv: tuple[str, ...]) -> None:
    guest, limits = _guest_module(), cgroups.detect()
    for i, _request in enumerate(sys.stdin):
        read_end, write_end = os.pipe()
        try:
            one(lower, os.path.join(base, f"floor-{os.getpid()}-{i}"), limits, bpf, guest, argv, write_end)
        finally:
            os.close(write_end)
        with os.fdopen(read_end, "rb") as output:
            sys.stdout.write(json.dumps(output.read().decode(errors="replace")) + "\n")
        sys.stdout.flush()


def main() -> None:
    if sys.argv[1] == "serve":
        with open(sys.argv[4], "rb") as f:
            serve(sys.argv[2], sys.argv[3], f.read(), tuple(sys.argv[5:]))
        return
    lower, base, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
    with open(sys.argv[4], "rb") as f:
        bpf = f.read()
    guest = _guest_module() if sys.argv[5:] == ["guest-mounts"] else None
    limits = cgroups.detect()
    times = []
    for i in range(count):
        started = time.perf_counter()
        one(lower, os.path.join(base, f"floor-{os.getpid()}-{i}"), limits, bpf, guest)
        times.append(time.perf_counter() - started)
    print(json.dumps(times))


if __name__ == "__main__":
    main()
