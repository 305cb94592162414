"""The namespace backend's helper process: a zygote that forks guests, and the guest's init.

This file runs as its own interpreter, started once per pytest process with an explicit,
minimal environment and an argv that names no host path (its code comes on stdin, compiled
by the host: the guest can read its init's ``/proc/1/cmdline``). It imports only the
standard library, and imports all of it *before* any guest exists: a guest's init pivots
into the guest's root, after which nothing from the host's filesystem (``sys.path``
included) can be imported.

What confines a guest (see docs/security.md): namespaces (mount, pid, net, uts, ipc, cgroup,
and user when not root), a cgroup of its own, a seccomp filter the host compiled with
libseccomp (sent as BPF in each create request), a reduced capability set, and helper
processes (setup, init, per-request children) that are not dumpable, so the guest can neither
ptrace them, read their memory or environment, nor take their fds with ``pidfd_getfd``.

Why a zygote: forking the pytest process itself is unsafe (xdist workers run threads) and
costs a copy of a large address space per guest, while starting a fresh interpreter per
guest costs ~70 ms here. A small single-threaded process that forks on request costs ~1 ms.

Processes per guest::

    zygote (child subreaper)
      └─ setup  (unshares namespaces, mounts the root, forks init, exits)
           └─ init  (pid 1 of the guest: reaps orphans, runs exec/file requests)
                └─ one child per request (setsid; execve, or a file operation)

The init serves a SOCK_SEQPACKET socket whose other end the pytest process holds. When that
end closes (the test process exited or crashed) the init exits, and the kernel kills every
process of the guest's pid namespace with it: a crashed test process cannot leave guest
processes or mounts behind. Only a guest marked ``keep`` outlives its owner.
"""

from __future__ import annotations

import array
import contextlib
import ctypes
import errno
import gc
import json
import os
import resource
import select
import shutil
import signal
import socket
import stat
import struct
import sys
import tarfile
import time
import traceback
from typing import Any

# tarfile looks owners up by name through NSS, which dlopen()s libraries from the *guest's*
# root once we are inside it. Never load guest-provided code into a privileged process.
tarfile.pwd = None  # type: ignore[attr-defined]
tarfile.grp = None  # type: ignore[attr-defined]

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
# every guest's fork would then run them (~0.6 ms a fork here).
_libc = ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


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


def _set_rlimits(req: dict[str, Any]) -> None:
    """Where no cgroup could be had: bound processes and file size per guest with rlimits.

    In a user namespace RLIMIT_NPROC counts the guest's own uid in its own namespace.
    """
    for name, value in (req.get("rlimits") or {}).items():
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


# --------------------------------------------------------------------------- guest setup


def _write_id_map(uid: int, gid: int) -> None:
    with open("/proc/self/setgroups", "w") as f:
        f.write("deny")
    with open("/proc/self/uid_map", "w") as f:
        f.write(f"0 {uid} 1")
    with open("/proc/self/gid_map", "w") as f:
        f.write(f"0 {gid} 1")


def _mount_root(req: dict[str, Any]) -> str:
    """Scratch tmpfs, overlay root and a minimal /dev, all in the guest's private mount ns."""
    scratch = req["scratch"]
    _mount(None, "/", None, MS_REC | MS_PRIVATE, None)
    _mount("smolvm-scratch", scratch, "tmpfs", MS_NOSUID | MS_NODEV, f"size={req['disk_mb']}m,mode=0755")
    upper, work, root = (os.path.join(scratch, d) for d in ("upper", "work", "root"))
    for d in (upper, work, root):
        os.mkdir(d)
    # The guest reads its root's mount options in /proc/self/mountinfo: name the layers by
    # fd and relative to the scratch dir, never by their host paths.
    lower_fds = [os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC) for path in req["lower"]]
    os.chdir(scratch)
    try:
        lower = ":".join(f"/proc/self/fd/{fd}" for fd in lower_fds)
        options = f"lowerdir={lower},upperdir=upper,workdir=work"
        if req["userns"]:
            options += ",userxattr"
        _mount("smolvm-root", "root", "overlay", 0, options)
    finally:
        os.chdir("/")
        for fd in lower_fds:
            os.close(fd)

    dev = os.path.join(root, "dev")
    os.makedirs(dev, exist_ok=True)
    _mount("smolvm-dev", dev, "tmpfs", MS_NOSUID | MS_NOEXEC, "mode=0755,size=1m")
    for node in DEVICES:
        target = os.path.join(dev, node)
        host = os.stat(f"/dev/{node}")
        if req["userns"]:
            # No CAP_MKNOD here: bind the host's node. The guest's root is not the host's, so
            # it cannot chmod, chown or touch that host inode through the bind.
            os.close(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644))  # a bind-mount target
            _mount(f"/dev/{node}", target, None, MS_BIND, None)
        else:
            # The guest's own inode, as runc makes it: through a bind of the host's node the
            # guest's root could chmod or chown the host's /dev/null. Also cheaper than a mount.
            os.mknod(target, stat.S_IMODE(host.st_mode) | stat.S_IFCHR, host.st_rdev)
            # mknod's mode went through the umask: a non-root guest user could not write /dev/null
            os.chmod(target, stat.S_IMODE(host.st_mode))  # our fresh tmpfs; the guest is not running yet
    for name, dest in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
                       ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2"),
                       ("ptmx", "pts/ptmx")):
        os.symlink(dest, os.path.join(dev, name))
    for sub in ("pts", "shm"):
        os.mkdir(os.path.join(dev, sub))
    _mount("smolvm-shm", os.path.join(dev, "shm"), "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777,size=64m")
    for sub in ("proc", "tmp", "workspace"):  # /workspace: as on every smol machine
        os.makedirs(os.path.join(root, sub), exist_ok=True)
    os.chmod(os.path.join(root, "tmp"), 0o1777)  # as a smol machine's tmpfs /tmp: every guest user may write
    return root


def _loopback_up() -> None:
    siocgifflags, siocsifflags, iff_up = 0x8913, 0x8914, 0x1
    import fcntl

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        ifreq = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(s, siocgifflags, ifreq))[1]
        fcntl.ioctl(s, siocsifflags, struct.pack("16sH14x", b"lo", flags | iff_up))


def _enter_root(root: str, req: dict[str, Any]) -> None:
    """Runs as the guest's pid 1: its own /proc, hostname, loopback, then pivot into root."""
    proc = os.path.join(root, "proc")
    _mount("proc", proc, "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
    # Host-wide knobs stay readable but not writable from the guest; what tells about the host
    # (its keys, kernel memory, timers) reads as empty: Docker's masked and read-only paths.
    for sub in ("keys", "kcore", "timer_list", "sched_debug", "latency_stats", "timer_stats"):
        path = os.path.join(proc, sub)
        if os.path.exists(path):
            try:
                _mount(os.path.join(root, "dev", "null"), path, None, MS_BIND, None)  # the guest's own
            except OSError:
                if not req["userns"]:
                    raise
    for sub in ("acpi", "scsi", "asound"):
        path = os.path.join(proc, sub)
        if os.path.isdir(path):
            try:
                _mount("smolvm-masked", path, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=0")
            except OSError:
                if not req["userns"]:
                    raise
    for sub in ("sys", "sysrq-trigger", "irq", "bus", "fs"):
        path = os.path.join(proc, sub)
        if os.path.exists(path):
            try:
                _mount(path, path, None, MS_BIND, None)
                _mount(None, path, None, MS_BIND | MS_REMOUNT | MS_RDONLY, None)
            except OSError:
                if not req["userns"]:
                    raise
    socket.sethostname(req["hostname"])
    if not req["network"]:
        _loopback_up()
    os.chdir(root)
    _check(_libc.syscall(ctypes.c_long(SYS_PIVOT_ROOT), b".", b"."), "pivot_root")
    _check(_libc.umount2(b".", ctypes.c_int(MNT_DETACH)), "umount old root")
    os.chdir("/")


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


# --------------------------------------------------------------------------- guest init


class Init:
    """pid 1 of one guest: serves requests from the host and reaps every orphan.

    Every request that starts a guest process brings its own fds: stdin, stdout, stderr and a
    *status* socket. The init reports on that socket only ({"pid"}, then {"exit"}, or an
    {"error"}), so requests never share a reply channel and the host can run any number of
    them at once. A request too big for one control message comes as a memfd (``body``).
    """

    def __init__(self, ctl: socket.socket) -> None:
        self.ctl = ctl
        self.children: dict[int, int] = {}  # pid -> that request's status fd
        self.keep = False
        rfd, self.wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.wake_r = rfd
        signal.set_wakeup_fd(self.wake_w)
        # SIGPIPE and SIGINT are caught by a no-op rather than ignored (Python and the zygote
        # ignore them) only so that execve gives spawned commands their default dispositions,
        # as the forked child that used to start them reset them. For this process it is the
        # same: nothing happens, and a write to a closed socket still fails with EPIPE.
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGPIPE, signal.SIGINT):
            signal.signal(sig, lambda *_: None)

    def serve(self) -> None:
        poller = select.poll()
        poller.register(self.ctl, select.POLLIN)
        poller.register(self.wake_r, select.POLLIN)
        while True:
            for fd, events in poller.poll():
                if fd == self.wake_r:
                    try:
                        os.read(self.wake_r, 4096)
                    except BlockingIOError:
                        pass
                    self.reap()
                elif events & (select.POLLHUP | select.POLLERR) and not events & select.POLLIN:
                    self.owner_gone()
                    poller.unregister(self.ctl)
                else:
                    try:
                        message, fds = _recv(self.ctl)
                    except OSError:
                        message, fds = None, []
                    if message is None:
                        self.owner_gone()
                        poller.unregister(self.ctl)
                    else:
                        self.handle_safely(message, fds)
            self.reap()

    def owner_gone(self) -> None:
        if not self.keep:
            os._exit(0)

    def reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            status_fd = self.children.pop(pid, None)
            if status_fd is not None:
                code = os.waitstatus_to_exitcode(status)
                if code < 0:
                    code = SIGNAL_EXIT_BASE - code
                _report(status_fd, {"exit": code})
                os.close(status_fd)

    def handle_safely(self, message: dict[str, Any], fds: list[int]) -> None:
        """pid 1 must outlive any one malformed request: its death would end the guest."""
        try:
            if message.get("body"):
                body_fd = fds.pop()
                try:
                    message = json.loads(_read_body(body_fd))
                finally:
                    os.close(body_fd)
            self.handle(message, fds)
        except Exception as exc:
            if len(fds) > 3:
                error = (_error(exc, None, str(message.get("op"))) if isinstance(exc, OSError)  # fork: EAGAIN
                         else {"message": f"bad request: {type(exc).__name__}: {exc}"})
                _report(fds[3], {"error": error})
            for fd in fds:
                try:
                    os.close(fd)
                except OSError:
                    pass

    def handle(self, message: dict[str, Any], fds: list[int]) -> None:
        op = message.get("op")
        if op == "kill":
            if message["pid"] <= 1:  # 0 stands for "never started"; killpg(0) would hit our own group
                return
            # Repeat: a forking group (a fork bomb) can outrun a single pass of killpg.
            for _ in range(KILL_PASSES):
                try:
                    os.killpg(message["pid"], signal.SIGKILL)
                except ProcessLookupError:
                    break
            return
        if op == "keep":
            self.keep = bool(message.get("keep", True))
            _report(fds[0], {"ok": True})
            os.close(fds[0])
            return
        if len(fds) != 4:
            raise ValueError(f"{op} needs 4 fds (stdin, stdout, stderr, status), got {len(fds)}")
        if op == "exec" and message.get("user") is None:
            self.spawn(message, fds)
            return
        # A file operation, or an exec as another user: the child runs this file's Python
        # code (user lookup, setuid, the operation) before anything else.
        pid = os.fork()
        if pid == 0:
            self.run_child(message, fds)  # never returns
        for fd in fds[:3]:
            os.close(fd)
        self.children[pid] = fds[3]
        _report(fds[3], {"pid": pid})

    def spawn(self, message: dict[str, Any], fds: list[int]) -> None:
        """Start an exec request's command through posix_spawn (vfork + execve), not os.fork.

        Why: os.fork() of this Python process copies its page tables, and then each side pays
        a copy-on-write fault for every page it touches until the child's execve; on this
        project's (paravirtualized) hosts that is ~2 ms per exec. posix_spawn uses vfork: no
        copy, and no Python runs between the two (subprocess.Popen's Python, in a freshly
        forked init, costs copy-on-write faults of its own). The command starts in a new
        session (its pid is its process group, for timeouts), with default dispositions for
        the signals this process catches or ignores, fds 0/1/2 from the request and no other
        fd (every fd of this process is close-on-exec), the cwd, and execvpe's PATH search
        over the request's env. A failed chdir or execve is reported on the status socket
        with its errno.
        """
        argv, env = message["argv"], message["env"]
        cwd = message.get("cwd") or "/"
        status_fd = fds[3]
        try:
            # The chdir happens here, not through Popen(cwd=): then every OSError Popen
            # raises is execve's, and a bad workdir is reported as the workdir's error.
            try:
                os.chdir(cwd)
            except OSError as exc:
                self.spawn_failed(fds, _error(exc, cwd, "workdir"))
                return
            try:
                pid = _spawn_vpe(argv, env, fds[:3])
            except OSError as exc:
                self.spawn_failed(fds, _error(exc, argv[0], "exec"))
                return
        finally:
            os.chdir("/")
        for fd in fds[:3]:
            os.close(fd)
        self.children[pid] = status_fd
        _report(status_fd, {"pid": pid})

    def spawn_failed(self, fds: list[int], error: dict[str, Any]) -> None:
        _report(fds[3], {"error": error})  # no process: no pid, no exit
        for fd in fds:
            os.close(fd)

    def run_child(self, message: dict[str, Any], fds: list[int]) -> None:
        code = 1
        try:
            os.setsid()
            for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGPIPE, signal.SIGINT):
                signal.signal(sig, signal.SIG_DFL)
            signal.set_wakeup_fd(-1)
            for target, fd in enumerate(fds[:3]):
                os.dup2(fd, target)
            os.dup2(fds[3], STATUS_FD, inheritable=False)  # closed by a successful execve
            os.closerange(STATUS_FD + 1, 65536)
            if message.get("user") is not None:
                _become(message)
            if message["op"] == "exec":
                _exec(message)
            code = FILE_OPS[message["op"]](message)
        except SystemExit as exc:
            code = int(exc.code or 0)
        except UserError as exc:
            _report(STATUS_FD, {"error": {"user": str(exc)}})
        except OSError as exc:
            _report(STATUS_FD, {"error": _error(exc, message.get("path"), message["op"])})
        except BaseException as exc:  # report anything to the host, never crash pid 1's loop
            try:
                os.write(2, f"{type(exc).__name__}: {exc}\n".encode(errors="replace"))
            except OSError:
                pass
        os._exit(code)


STATUS_FD = 3  # in a request's child: where it reports a structured error
MAX_BODY = 64 << 20  # a request body (memfd) beyond this is refused; ARG_MAX is at most 6 MiB


class UserError(Exception):
    """The request's user is not known in the guest, or cannot be switched to."""


def _report(fd: int, message: dict[str, Any]) -> None:
    try:
        os.write(fd, json.dumps(message).encode())
    except OSError:
        pass  # the host stopped listening: nothing to tell


def _error(exc: OSError, filename: Any, what: str) -> dict[str, Any]:
    error: dict[str, Any] = {"errno": exc.errno, "strerror": exc.strerror or str(exc),
                             "filename": exc.filename if isinstance(exc.filename, str) else filename,
                             "what": what}
    if exc.errno == errno.E2BIG:
        error["arg_max"] = os.sysconf("SC_ARG_MAX")
    return error


def _read_body(fd: int) -> bytes:
    size = os.fstat(fd).st_size
    if size > MAX_BODY:
        raise ValueError(f"request body of {size} bytes is over {MAX_BODY}")
    chunks, offset = [], 0
    while offset < size:
        chunk = os.pread(fd, size - offset, offset)
        if not chunk:
            break
        chunks.append(chunk)
        offset += len(chunk)
    return b"".join(chunks)


def _guest_table(path: str) -> list[list[str]]:
    """/etc/passwd or /etc/group of the guest, parsed here: the guest's NSS modules never load.

    This runs in the request's child, never in pid 1: a guest that made the file a FIFO or
    a huge file stalls only this request, which the host's timeout kills.
    """
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise UserError(f"{path} in the guest is not a regular file")
        data = os.read(fd, 4 << 20)
    finally:
        os.close(fd)
    return [line.split(":") for line in data.decode("utf-8", "replace").splitlines()
            if line and not line.startswith("#")]


def _lookup_user(user: str | int) -> tuple[str, int, int, list[int], str]:
    """(name, uid, gid, supplementary gids, home) of a guest user given by name or uid."""
    try:
        users = _guest_table("/etc/passwd")
    except FileNotFoundError:
        users = []
    wanted = str(user)
    entry = next((e for e in users if len(e) >= 6 and e[0] == wanted), None)
    if entry is None and wanted.isdigit():
        entry = next((e for e in users if len(e) >= 6 and e[2] == wanted), None)
    if entry is None:
        raise UserError(f"user {user!r} is not in the guest's /etc/passwd")
    try:
        name, uid, gid, home = entry[0], int(entry[2]), int(entry[3]), entry[5] or "/"
    except ValueError:
        raise UserError(f"user {user!r} has a malformed /etc/passwd entry in the guest") from None
    groups = {gid}
    try:
        for group in _guest_table("/etc/group"):
            if len(group) >= 4 and name in group[3].split(",") and group[2].isdigit():
                groups.add(int(group[2]))
    except FileNotFoundError:
        pass
    return name, uid, gid, sorted(groups), home


def _become(message: dict[str, Any]) -> None:
    """Switch this request's child to the request's user: groups, gid, uid, and its HOME."""
    name, uid, gid, groups, home = _lookup_user(message["user"])
    try:
        if (uid, gid) == (os.getuid(), os.getgid()):
            try:
                os.setgroups(groups)
            except PermissionError:
                pass  # already this user; a user namespace that maps only root cannot set groups
        else:
            os.setgroups(groups)
            os.setgid(gid)
            os.setuid(uid)
    except OSError as exc:
        raise UserError(f"cannot switch to user {message['user']!r} (uid {uid}): {exc.strerror}; "
                        "an unprivileged host's guest maps only root") from None
    if message["op"] == "exec":
        explicit = set(message.get("explicit", ()))
        for key, value in (("HOME", home), ("USER", name), ("LOGNAME", name)):
            if key not in explicit:
                message["env"][key] = value


# What a spawned command starts with: default dispositions for what the init catches (see
# Init.__init__) and for SIGXFSZ, which Python ignores and execve would pass on ignored.
SPAWN_DEFAULT_SIGNALS = (signal.SIGCHLD, signal.SIGTERM, signal.SIGPIPE, signal.SIGINT, signal.SIGXFSZ)


def _spawn_vpe(argv: list[str], env: dict[str, str], fds: list[int]) -> int:
    """posix_spawn with os.execvpe's PATH search: same candidates, same order, same error raised."""
    file = argv[0]
    candidates = [file] if os.path.dirname(file) else [os.path.join(d, file) for d in os.get_exec_path(env)]
    last_exc: OSError | None = None
    saved_exc: OSError | None = None
    for path in candidates:
        try:
            # A stat skips the candidates execve would refuse with ENOENT/ENOTDIR anyway:
            # a PATH search then costs one spawn, not one per PATH entry.
            os.stat(path)
        except (FileNotFoundError, NotADirectoryError) as exc:
            last_exc = exc
            continue
        except OSError:
            pass  # let execve itself say what is wrong
        try:
            return os.posix_spawn(path, argv, env, setsid=True, setsigdef=SPAWN_DEFAULT_SIGNALS,
                                  file_actions=[(os.POSIX_SPAWN_DUP2, fd, target) for target, fd in enumerate(fds)])
        except (FileNotFoundError, NotADirectoryError) as exc:
            last_exc = exc
        except OSError as exc:
            last_exc = exc
            if saved_exc is None:
                saved_exc = exc
    raise saved_exc or last_exc or FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), file)


def _open_regular(path: str, flags: int) -> int:
    """Open ``path`` in the guest, refusing anything but a regular file before any byte moves.

    O_NONBLOCK: opening a FIFO the guest planted must not wait for a writer (or reader).
    """
    fd = os.open(path, flags | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(errno.EISDIR, "Is a directory", path)
        raise OSError(errno.EINVAL, "not a regular file (a FIFO, device or socket)", path)
    os.set_blocking(fd, True)
    return fd


def _exec(message: dict[str, Any]) -> None:
    """Exec in a forked child (an exec as another user); errors go to the status socket."""
    env = message["env"]
    argv = message["argv"]
    cwd = message.get("cwd") or "/"
    try:
        os.chdir(cwd)
    except OSError as exc:
        _report(STATUS_FD, {"error": _error(exc, cwd, "workdir")})
        os._exit(126)
    try:
        os.execvpe(argv[0], argv, env)
    except OSError as exc:
        _report(STATUS_FD, {"error": _error(exc, argv[0], "exec")})
        os._exit(127 if exc.errno == errno.ENOENT else 126)


def _op_write(message: dict[str, Any]) -> int:
    path = message["path"]
    parent = os.path.dirname(path) or "/"
    os.makedirs(parent, exist_ok=True)
    fd = _open_regular(path, os.O_WRONLY | os.O_CREAT)
    os.ftruncate(fd, 0)
    with open(fd, "wb") as f, os.fdopen(0, "rb", closefd=False) as src:
        shutil.copyfileobj(src, f, 1 << 20)
        if message.get("mode") is not None:
            os.fchmod(f.fileno(), message["mode"])
    return 0


def _op_read(message: dict[str, Any]) -> int:
    limit = int(message.get("limit") or 0)
    with open(_open_regular(message["path"], os.O_RDONLY), "rb") as f, \
            os.fdopen(1, "wb", closefd=False) as dst:
        sent = 0
        while True:
            chunk = f.read(1 << 20)
            if not chunk:
                return 0
            sent += len(chunk)
            if limit and sent > limit:
                raise OSError(errno.EFBIG, f"File too large: over read_file's max_bytes={limit} "
                                           "(pass a larger max_bytes, or use copy_out)", message["path"])
            dst.write(chunk)


GUEST_TARS = ("/bin/tar", "/usr/bin/tar")


def _op_put_archive(message: dict[str, Any]) -> int:
    dest = message["path"]
    os.makedirs(dest, exist_ok=True)
    for tar_path in GUEST_TARS:
        if os.access(tar_path, os.X_OK):
            # The guest's own tar writes only into the guest, and it is ~10x faster than
            # tarfile per member; the archive is the host's own files. Every member is owned
            # by 0:0 already, so no chown per file (-o): ~18% of its time on a small-file tree.
            os.execv(tar_path, [tar_path, "-x", "-p", "-o", "-f", "-", "-C", dest])
    with os.fdopen(0, "rb", closefd=False) as src, tarfile.open(fileobj=src, mode="r|") as tar:
        # The archive comes from the host's own files; the guest root contains any link.
        tar.extractall(dest, numeric_owner=True, filter="fully_trusted")
    return 0


def _op_get_archive(message: dict[str, Any]) -> int:
    path = message["path"]
    st = os.lstat(path)  # a clear "No such file" before any byte of archive is written
    if stat.S_ISDIR(st.st_mode):
        for tar_path in GUEST_TARS:
            if os.access(tar_path, os.X_OK):
                return _tar_tree(tar_path, path)
    with os.fdopen(1, "wb", closefd=False) as dst, tarfile.open(fileobj=dst, mode="w|") as tar:
        tar.add(path, arcname=message["arcname"], recursive=True)
    return 0


def _tar_tree(tar_path: str, path: str) -> int:
    """A guest directory as a tar stream written by the guest's own tar (~8x faster than tarfile).

    The guest controls its tar, but it controls the stream anyway: the host parses it as
    hostile either way. Members are named relative to the tree (".", "./sub/file"), which the
    host puts under the name it asked for: BusyBox tar cannot rename members.
    """
    # Entered by fd without following a link: the tree is the directory that was checked,
    # and an unreadable top is a PermissionError, as tarfile would raise.
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        os.fchdir(fd)
    finally:
        os.close(fd)
    # Its stderr goes to a memfd, not a pipe: a process the guest's tar leaves behind could
    # hold a pipe open, and this child would wait for its end forever.
    err = os.memfd_create("tar-stderr", os.MFD_CLOEXEC)
    try:
        devnull = os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC)
        try:
            pid = os.posix_spawn(tar_path, [tar_path, "-c", "-f", "-", "."], dict(os.environ),
                                 setsigdef=SPAWN_DEFAULT_SIGNALS,
                                 file_actions=[(os.POSIX_SPAWN_DUP2, devnull, 0), (os.POSIX_SPAWN_DUP2, err, 2)])
        finally:
            os.close(devnull)
        code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        tail = os.pread(err, 1 << 16, max(0, os.fstat(err).st_size - (1 << 16)))
    finally:
        os.close(err)
    lines = [line for line in tail.decode(errors="replace").splitlines() if line.strip()]
    if code == 1 and lines and all("file changed as we read it" in line for line in lines):
        return 0  # GNU tar's "some files changed": the archive is complete, as tarfile's would be
    if code != 0:
        if any("Permission denied" in line for line in lines):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)
        os.write(2, tail)
        return code if code > 0 else SIGNAL_EXIT_BASE - code
    return 0


def _op_export_root(message: dict[str, Any]) -> int:
    """The guest's whole root filesystem as a tar, without what is mounted on it (/proc, /dev).

    This is how a prepared (warm) guest becomes a baseline: the host unpacks this tree once
    and forks later guests from it.
    """
    root_dev = os.lstat("/").st_dev
    with os.fdopen(1, "wb", closefd=False) as dst, tarfile.open(fileobj=dst, mode="w|") as tar:
        def add(path: str, arcname: str) -> None:
            info = tar.gettarinfo(path, arcname)
            if info.isreg():
                with open(path, "rb") as f:
                    tar.addfile(info, f)
                return
            if info.ischr() or info.isblk():
                return  # overlay whiteouts and devices: the baseline gets its own /dev
            tar.addfile(info)
            if info.isdir() and os.lstat(path).st_dev == root_dev:
                for entry in sorted(os.listdir(path)):
                    add(os.path.join(path, entry), f"{arcname}/{entry}")

        for entry in sorted(os.listdir("/")):
            add("/" + entry, entry)
    return 0


FILE_OPS = {"write": _op_write, "read": _op_read, "put_archive": _op_put_archive,
            "get_archive": _op_get_archive, "export_root": _op_export_root}


# --------------------------------------------------------------------------- zygote


def _close_all_but(keep: set[int]) -> None:
    """Close every fd >= 3 not in ``keep``: a few close_range(2) calls, no /proc/self/fd listing."""
    low = 3
    for fd in sorted(k for k in keep if k >= low):
        os.closerange(low, fd)
        low = fd + 1
    os.closerange(low, os.sysconf("SC_OPEN_MAX"))


def _join_cgroups(procs_files: list[str]) -> None:
    # os.open/os.write, not open(): a file object costs an fstat, an ioctl and two lseeks
    # more per file, and this runs three times per guest. "0" is the writer itself, whatever
    # pid namespace it is in.
    for path in procs_files:
        fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
        try:
            os.write(fd, b"0")
        finally:
            os.close(fd)


def _setup_guest(req: dict[str, Any], ctl: socket.socket, report_w: int) -> None:
    """Runs in the zygote's child; never returns. The child becomes the guest's init.

    As root the zygote made the pid namespace before forking: this process is already the
    guest's pid 1, and one fork per guest is all it takes. In a user namespace the pid
    namespace can only come after the user namespace, so this process makes both and forks
    the init (two forks; the first process reports the init's pid and exits).
    """
    try:
        keep = {ctl.fileno(), report_w}
        devnull = os.open("/dev/null", os.O_RDWR)
        for target in (0, 1, 2):
            os.dup2(devnull, target)
        _close_all_but(keep)
        _join_cgroups(req["cgroup_procs"])
        # The cgroup namespace starts at the guest's own cgroup (joined just above): the guest
        # sees "/" in /proc/self/cgroup and can never name, let alone kill, a host cgroup.
        flags = CLONE_NEWNS | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWCGROUP
        if not req["network"]:
            flags |= CLONE_NEWNET
        uid, gid = os.getuid(), os.getgid()
        if req["userns"]:
            flags |= CLONE_NEWUSER | CLONE_NEWPID
        _unshare(flags)
        if req["userns"]:
            _write_id_map(uid, gid)  # before the next line: it makes /proc/self/* root's
        # Not dumpable: no guest process may ptrace this process or the init, read their memory
        # or /proc/PID/environ, or take their sockets with pidfd_getfd. Inherited by every fork
        # (the init, per-request children); execve of a guest command resets it.
        _check(_prctl(PR_SET_DUMPABLE, 0), "prctl(PR_SET_DUMPABLE)")
        root = _mount_root(req)
        if not req["userns"]:
            _become_init(root, req, ctl, report_w)
        ready_r, ready_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(ready_r)
            os.close(report_w)
            _become_init(root, req, ctl, ready_w)
        os.close(ready_w)
        status = os.read(ready_r, 4096).decode(errors="replace")
        reply = json.loads(status) if status.startswith("{") else {"error": status or "guest init exited during setup"}
        if "error" not in reply:
            reply["pid"] = pid  # as the zygote sees it: this process is not in the guest's pid namespace
        os.write(report_w, json.dumps(reply).encode())
        os._exit(0)
    except BaseException as exc:
        detail = str(exc) if isinstance(exc, (OSError, RuntimeError)) else traceback.format_exc()
        os.write(report_w, json.dumps({"error": detail}).encode())
        os._exit(1)


def _become_init(root: str, req: dict[str, Any], ctl: socket.socket, report_w: int) -> None:
    """Finish the guest from inside its pid namespace, say so on ``report_w``, then serve; never returns."""
    try:
        _enter_root(root, req)
        _set_rlimits(req)
        bpf = bytes.fromhex(req["seccomp"]) if req.get("seccomp") else b""
        if bpf:
            _load_seccomp(bpf)  # after the last mount; before capabilities go
        _drop_capabilities()
    except BaseException as exc:
        os.write(report_w, json.dumps({"error": f"guest init failed: {exc}"[:4000]}).encode())
        os._exit(1)
    os.write(report_w, json.dumps({"ok": True}).encode())
    os.close(report_w)
    Init(ctl).serve()
    os._exit(0)


class _Creating:
    """A guest whose setup process is at work: the zygote serves other requests meanwhile."""

    def __init__(self, req: dict[str, Any], own_pid_ns: int) -> None:
        self.id = req.get("id")
        self.janitor = _janitor(req, [os.path.dirname(p) for p in req["cgroup_procs"]])
        host_end, guest_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        report_r, report_w = os.pipe2(os.O_CLOEXEC)
        one_fork = not req["userns"]
        pid = -1
        try:
            if one_fork:
                _unshare(CLONE_NEWPID)  # for our next child only: it starts as the guest's pid 1
            pid = os.fork()
        finally:
            if one_fork and pid != 0:
                # Back to our own pid namespace for children (the next unshare(CLONE_NEWPID)
                # needs it), whether the fork worked or not; never in the child, the guest's pid 1.
                _check(_libc.setns(ctypes.c_int(own_pid_ns), ctypes.c_int(CLONE_NEWPID)), "setns")
            if pid != 0:
                os.close(report_w)
                guest_end.close()
                if pid < 0:
                    os.close(report_r)
                    host_end.close()
        if pid == 0:
            os.close(report_r)
            host_end.close()
            _setup_guest(req, guest_end, report_w)
        self.pid, self.report_r, self.host_end, self.raw = pid, report_r, host_end, b""

    def read(self) -> tuple[dict[str, Any], list[int]] | None:
        """Read what the setup process reported so far; the reply once it is all there.

        The reply comes as soon as the guest has reported, without waiting for a setup process
        to exit: tearing down its copy of our address space takes ~1 ms here, and the host need
        not wait for that. The zygote's loop reaps it (_reap_children) like any other child.
        """
        chunk = os.read(self.report_r, 1 << 16)
        self.raw += chunk
        reply: dict[str, Any] | None = None
        if chunk:
            try:
                reply = json.loads(self.raw)  # a prefix of a JSON object never parses: wait for the rest
            except ValueError:
                return None
        os.close(self.report_r)
        if reply is None:
            reply = {"error": self.raw.decode(errors="replace") if self.raw else "guest setup died without a word"}
        if "error" in reply:
            with contextlib.suppress(ChildProcessError):  # reaped already by the zygote's loop
                os.waitpid(self.pid, 0)  # it exits right after reporting; then its cgroup can go
            self.host_end.close()
            return reply, []
        reply.setdefault("pid", self.pid)
        reply.pop("ok", None)
        return reply, [self.host_end.detach()]


def _reap_children() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _clean_after_owner(guests: dict[int, dict[str, Any]], expected: dict[str, dict[str, Any]], owner: int) -> None:
    """The pytest process that owned these guests is gone: remove what their destroy would have.

    Runs when our socket to that process reaches EOF: a clean close (all guests were destroyed
    already, so this finds nothing) or a crash (SIGKILL, os._exit, a pytest-timeout thread
    timeout). A guest's init exits by itself when its own socket closes; we wait for that, then
    take away its scratch dir, cgroups and registry record. A kept guest keeps all three.
    ``expected`` guests were announced but never asked for (the owner died in between): no
    process, only what the owner had made for them so far.
    """
    deadline = time.monotonic() + JANITOR_WAIT
    for pid, guest in [*guests.items(), *((None, guest) for guest in expected.values())]:
        record_path = os.path.join(guest["state"], "registry", f"{guest['name']}.json")
        try:
            with open(record_path) as f:
                record = json.load(f)
        except (OSError, ValueError):
            record = None
        if record is not None and (record.get("kept") or record.get("data", {}).get("pid") not in (None, pid)):
            continue
        while pid is not None and time.monotonic() < deadline:
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                done = pid  # not (or no longer) our child: reaped already
            if done == pid:
                break
            time.sleep(0.005)
        else:
            if pid is not None:
                continue  # still running: leave it to 'pytest-smolvm reap'
        removed_all = True
        for path in [*guest["cgroups"], guest["scratch"]]:
            for _ in range(200):
                try:
                    os.rmdir(path)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.005)  # a cgroup stays busy for a moment after its last task
            else:
                removed_all = False
        if removed_all:  # otherwise the record stays for 'pytest-smolvm reap'
            # With any save the owner was killed in the middle of (registry.Record.save's temp file).
            partial = os.path.join(guest["state"], "registry", f".{guest['name']}.{owner}.tmp")
            for path in ([record_path] if record is not None else []) + [partial]:
                with contextlib.suppress(OSError):
                    os.unlink(path)


def zygote(sock: socket.socket) -> None:
    """Serve the owner's requests; guests are set up concurrently, each reply sent when ready.

    Creates overlap: the zygote forks a guest's setup process and goes back to its socket, so
    a pytest process that makes guests ahead keeps both cores busy with setups, not one.
    """
    owner = os.getppid()  # read now: once the owner is dead, our parent is someone else
    _prctl(PR_SET_CHILD_SUBREAPER, 1)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the whole group; the host decides
    guests: dict[int, dict[str, Any]] = {}  # init pid -> what to remove if our owner dies
    expected: dict[str, dict[str, Any]] = {}  # guest name -> what to remove if our owner dies before its create
    creating: dict[int, _Creating] = {}  # report pipe -> a guest being set up
    own_pid_ns = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    owner_gone = False
    while not owner_gone or creating:
        _reap_children()
        for fd, _events in poller.poll():
            if fd in creating:
                done = creating[fd].read()
                if done is not None:
                    poller.unregister(fd)
                    _reply(sock, creating.pop(fd), *done, guests)
                continue
            try:
                message, fds = _recv(sock)
            except InterruptedError:
                continue
            except OSError:
                message, fds = None, []
            if message is None:
                # Our owner closed the socket or died: the one moment nobody else will clean up.
                # Guests still being set up are finished first, so that they are cleaned too.
                owner_gone = True
                poller.unregister(sock)
                continue
            for fd_ in fds:
                os.close(fd_)
            try:
                if message["op"] == "expect":  # no reply: the owner does not wait
                    expected[str(message["name"])] = _janitor(message, [str(d) for d in message["cgroups"]])
                    continue
                if message["op"] == "create":
                    expected.pop(str(message["name"]), None)
                    job = _Creating(message, own_pid_ns)
                    creating[job.report_r] = job
                    poller.register(job.report_r, select.POLLIN)
                    continue
                if message["op"] == "ping":
                    reply: dict[str, Any] = {"ok": True}
                else:
                    reply = {"error": f"unknown op {message['op']!r}"}
            except Exception as exc:  # the zygote must outlive any one failed request
                reply = {"error": f"{type(exc).__name__}: {exc}"}
            reply["id"] = message.get("id")
            with contextlib.suppress(OSError):
                _send(sock, reply)
    _clean_after_owner(guests, expected, owner)


def _janitor(req: dict[str, Any], cgroup_dirs: list[str]) -> dict[str, Any]:
    """What to remove for a guest if our owner dies: taken before the guest exists, so that a
    bad request fails here, never with a live guest whose socket nobody holds."""
    return {"name": str(req["name"]), "scratch": str(req["scratch"]), "state": str(req["state"]),
            "cgroups": cgroup_dirs}


def _reply(sock: socket.socket, job: _Creating, reply: dict[str, Any], out_fds: list[int],
           guests: dict[int, dict[str, Any]]) -> None:
    if "pid" in reply:
        guests[int(reply["pid"])] = job.janitor
    reply["id"] = job.id
    try:
        _send(sock, reply, out_fds)
    except OSError:
        pass  # our owner died while we worked (a guest made ahead): cleaned after the loop
    for fd in out_fds:
        os.close(fd)


def _preload() -> None:
    """Import now what guest-side code imports lazily later, when host paths are gone."""
    import fcntl  # noqa: F401

    b"".decode("utf-8", "replace")
    array.array("i")


def _shed_boot_memory() -> None:
    """Give back the heap that compiling this file left behind: every guest's fork copies the
    page tables of what this process holds, and its exit unmaps them (~0.1 ms a fork here)."""
    gc.collect()
    trim = getattr(_libc, "malloc_trim", None)  # glibc's; other C libraries may not have it
    if trim is not None:
        trim(ctypes.c_size_t(0))


if __name__ == "__main__":
    # argv (see namespace.Zygote): "-c" "_nsguest.py" FD TAG; the tag only marks whose helper this is.
    _preload()
    _shed_boot_memory()
    zygote(socket.socket(fileno=int(sys.argv[2])))
