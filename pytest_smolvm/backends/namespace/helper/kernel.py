"""Syscalls, constants and the message framing every helper process uses (standard library only).

Part of the namespace backend's helper (see ``__init__``): standard library only.
"""

from __future__ import annotations

import array
import ctypes
import errno
import json
import os
import resource
import socket
import struct
from typing import Any

CLONE_NEWNS = 0x00020000


CLONE_NEWCGROUP = 0x02000000


CLONE_NEWUTS = 0x04000000


CLONE_NEWIPC = 0x08000000


CLONE_NEWUSER = 0x10000000


CLONE_NEWPID = 0x20000000


CLONE_NEWNET = 0x40000000


MS_RDONLY = 0x1


MS_NOSUID = 0x2


MS_NODEV = 0x4


MS_NOEXEC = 0x8


MS_REMOUNT = 0x20


MS_BIND = 0x1000


MS_REC = 0x4000


MS_PRIVATE = 0x40000


MNT_DETACH = 0x2


PR_SET_DUMPABLE = 4


PR_SET_SECCOMP = 22
PR_SET_NO_NEW_PRIVS = 38


SECCOMP_MODE_FILTER = 2


PR_CAPBSET_DROP = 24


PR_SET_CHILD_SUBREAPER = 36


CAP_LAST_CAP_FALLBACK = 40


LINUX_CAPABILITY_VERSION_3 = 0x20080522


# What a guest's root keeps: Docker's default set without CAP_MKNOD. Everything that reaches
# beyond the guest's namespaces (modules, raw I/O, mounts, ptrace, time) is gone.
GUEST_CAPABILITIES = (0, 1, 3, 4, 5, 6, 7, 8, 10, 13, 18, 29, 31)


DEVICES = ("null", "zero", "full", "random", "urandom", "tty")  # a guest's /dev, as Docker's


SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}.get(os.uname().machine, 155)


MAX_MESSAGE = 1 << 20


SIGNAL_EXIT_BASE = 128


KILL_PASSES = 64


JANITOR_WAIT = 5.0  # seconds for orphaned guests' inits to exit after their owner died


# The C library through the interpreter's own symbols, not ctypes.util.find_library: that
# imports subprocess and tempfile, whose threading and random register at-fork hooks, and
# every guest's fork would then run them.
_libc = ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _close_all_but(keep: set[int]) -> None:
    """Close every fd >= 3 not in ``keep``: a few close_range(2) calls, no /proc/self/fd listing."""
    low = 3
    for fd in sorted(k for k in keep if k >= low):
        os.closerange(low, fd)
        low = fd + 1
    os.closerange(low, os.sysconf("SC_OPEN_MAX"))


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None) -> None:
    _check(
        _libc.mount(
            source.encode() if source else None,
            target.encode(),
            fstype.encode() if fstype else None,
            ctypes.c_ulong(flags),
            data.encode() if data else None,
        ),
        f"mount {fstype or source} on {target}",
    )


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def _load_seccomp(bpf: bytes) -> None:
    """Install a filter libseccomp compiled on the host (raw BPF: 8-byte sock_filter entries).

    Loaded while the init still has CAP_SYS_ADMIN in its user namespace, so no
    PR_SET_NO_NEW_PRIVS is needed and setuid programs in the guest keep working.
    """
    if not bpf or len(bpf) % 8:
        raise RuntimeError("seccomp: the filter from the host is not a BPF program")
    program = ctypes.create_string_buffer(bpf, len(bpf))
    fprog = _SockFprog(len(bpf) // 8, ctypes.addressof(program))
    _check(_libc.prctl(ctypes.c_int(PR_SET_SECCOMP), ctypes.c_ulong(SECCOMP_MODE_FILTER),
                       ctypes.byref(fprog), ctypes.c_ulong(0), ctypes.c_ulong(0)), "seccomp filter")


def _set_rlimits(req: dict[str, Any], key: str = "rlimits") -> None:
    """The guest's rlimits: ``rlimits`` where no cgroup could be had (processes and file size;
    in a user namespace RLIMIT_NPROC counts the guest's own uid in its own namespace), and
    ``user_counted_rlimits``, its share of what the kernel counts per user."""
    for name, value in (req.get(key) or {}).items():
        limit = int(value)
        resource.setrlimit(getattr(resource, name), (limit, limit))


def _unshare(flags: int) -> None:
    _check(_libc.unshare(ctypes.c_int(flags)), "unshare")


def _prctl(option: int, arg: int) -> int:
    return int(_libc.prctl(ctypes.c_int(option), ctypes.c_ulong(arg), ctypes.c_ulong(0),
                           ctypes.c_ulong(0), ctypes.c_ulong(0)))


def _send(sock: socket.socket, message: dict[str, Any], fds: list[int] | None = None) -> None:
    data = json.dumps(message).encode()
    if fds:
        socket.send_fds(sock, [data], fds)
    else:
        sock.send(data)


def _recv(sock: socket.socket) -> tuple[dict[str, Any] | None, list[int]]:
    # Close-on-exec from the start: a command the init spawns must inherit no fd but its own
    # 0/1/2. (socket.recv_fds drops its flags argument before Python 3.12: recvmsg directly.)
    fds = array.array("i")
    data, ancdata, _flags, _addr = sock.recvmsg(MAX_MESSAGE, socket.CMSG_LEN(8 * fds.itemsize),
                                                socket.MSG_CMSG_CLOEXEC)
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[:len(payload) - len(payload) % fds.itemsize])
    if not data:
        for fd in fds:
            os.close(fd)
        return None, []
    return json.loads(data), list(fds)


def _write_small(path: str, data: bytes) -> None:
    """One write to a kernel file (cgroupfs, procfs). os.open/os.write, not open(): a file
    object costs an fstat, an ioctl and two lseeks more, and these run per guest or per exec."""
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


MAP_REQUEST = b"M"  # on a root-mode init's report pipe, before its report: "write my maps" (and the answer)
IDENTITY_MAP = b"0 0 4294967295"  # every uid (gid) to itself


def _own_user_namespace(owner: int, mapped_fd: int, report_w: int) -> None:
    """Root mode: move this process (the guest's init, every mount made) into a user namespace
    of its own, owned by the uid ``owner`` and mapping every uid and gid to itself. Files,
    uids and capabilities read as before; but what the kernel counts per user for the guest's
    processes (inotify instances and watches, message-queue bytes, queued signals) it charges
    at the host's level to the namespace's owner, never to host root's own count. A process
    may map no uid but its own from inside: the zygote, root outside, writes the maps when we
    ask on ``report_w`` and says so on ``mapped_fd`` (zygote.py)."""
    try:
        os.seteuid(owner)  # the kernel makes the namespace's owner our effective uid
        _unshare(CLONE_NEWUSER)
        os.write(report_w, MAP_REQUEST)
        if os.read(mapped_fd, 1) != MAP_REQUEST:
            raise OSError(errno.EPERM, "the zygote could not map the guest's user namespace")
    finally:
        os.close(mapped_fd)
    os.setresgid(0, 0, 0)
    os.setresuid(0, 0, 0)  # root in it, every capability in it: _drop_capabilities bounds them next


def _write_id_map(uid: int, gid: int) -> None:
    with open("/proc/self/setgroups", "w") as f:
        f.write("deny")
    with open("/proc/self/uid_map", "w") as f:
        f.write(f"0 {uid} 1")
    with open("/proc/self/gid_map", "w") as f:
        f.write(f"0 {gid} 1")


def _last_capability() -> int:
    try:
        with open("/proc/sys/kernel/cap_last_cap") as f:
            return int(f.read())
    except OSError:
        return CAP_LAST_CAP_FALLBACK


LAST_CAP = _last_capability()  # read once, while the host's /proc is still ours


def _drop_capabilities() -> None:
    for cap in range(LAST_CAP + 1):
        if cap not in GUEST_CAPABILITIES:
            _prctl(PR_CAPBSET_DROP, cap)
    mask = sum(1 << c for c in GUEST_CAPABILITIES)
    header = struct.pack("Ii", LINUX_CAPABILITY_VERSION_3, 0)
    data = struct.pack("6I", mask & 0xFFFFFFFF, mask & 0xFFFFFFFF, 0, mask >> 32, mask >> 32, 0)
    _check(_libc.capset(ctypes.c_char_p(header), ctypes.c_char_p(data)), "capset")
