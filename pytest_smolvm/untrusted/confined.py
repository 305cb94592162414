"""The first wall around unpacking guest- and image-made tar streams: a helper that reaches
nothing but its destination (moby's ``pkg/chrootarchive`` is the model).

:func:`extract` runs :func:`pytest_smolvm.untrusted.hostfs.extract` (the second wall: an fd walk that
follows no link the stream made) in a short-lived child process fed the stream on a pipe, forked
by this process's unpacker (:mod:`.unpacker`, started once, everything imported). The child
enters a mount namespace of its own (and a user
namespace when not root), makes the destination its root, drops every capability but the few
creating files with kept owners needs, sets ``no_new_privs``, caps its memory, open files and
CPU time, and loads a seccomp filter that refuses exec, fork, sockets, mounts, ``mknod`` and
``chroot``. A flaw in the walker then still writes nothing outside the destination, and reads
nothing outside it either.

Errors come back as the same :class:`~pytest_smolvm.untrusted.UnsafeArchive` messages as the
in-process walker raises.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import resource
import select
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

from pytest_smolvm import limits
from pytest_smolvm.errors import UnsafeArchive
from pytest_smolvm.untrusted import rules

MEMORY_CAP = 1 << 30  # RLIMIT_AS of the helper: Python plus 1 MiB buffers and capped metadata
CLONE_NEWNS, CLONE_NEWUSER = 0x00020000, 0x10000000
MS_REC, MS_PRIVATE = 0x4000, 1 << 18
PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 24, 38, 47, 4
CAP_CHOWN, CAP_DAC_OVERRIDE, CAP_FOWNER, CAP_FSETID, CAP_LAST = 0, 1, 3, 4, 63
_LINUX_CAPABILITY_VERSION_3 = 0x20080522
DENIED = (
    "execve", "execveat", "fork", "vfork", "clone", "ptrace", "process_vm_readv", "process_vm_writev",
    "socket", "socketpair", "connect", "bind", "listen", "accept", "accept4", "sendto", "sendmsg",
    "mknod", "mknodat", "chroot", "pivot_root", "unshare", "setns", "mount", "umount2", "move_mount",
    "open_tree", "fsopen", "fsmount", "fspick", "mount_setattr", "open_by_handle_at", "name_to_handle_at",
    "keyctl", "add_key", "request_key", "bpf", "perf_event_open", "userfaultfd", "io_uring_setup",
    "io_uring_enter", "io_uring_register", "kexec_load", "init_module", "finit_module", "reboot",
)
# -S: no site-packages scan (a tenth of the helper's start); the paths it needs come in argv.
_BOOT = ("import sys; sys.path[:0] = sys.argv[1].split(':'); "
         "from pytest_smolvm.untrusted.unpacker import main; main()")


def extract(stream: IO[bytes], dest: str | os.PathLike[str], policy: rules.Policy,
            caps: rules.Caps | None = None) -> None:
    """Unpack ``stream`` under the existing directory ``dest`` in a confined helper child."""
    caps = caps or rules.Caps()
    config = json.dumps({"policy": vars(policy), "caps": vars(caps)}).encode()
    direct = _pipe_fd(stream)
    read_end = write_end = -1
    if direct < 0:
        read_end, write_end = os.pipe()
    result_r, result_w = os.pipe2(os.O_CLOEXEC)
    root_fd = os.open(dest, rules.DIR_FLAGS)
    try:
        _UNPACKER.send(config, [root_fd, direct if direct >= 0 else read_end, result_w])
    except BaseException:
        for fd in (result_r, write_end):
            if fd >= 0:
                os.close(fd)
        raise
    finally:
        for fd in (root_fd, result_w, read_end):
            if fd >= 0:
                os.close(fd)
    pump = None
    unreadable: list[BaseException] = []  # what reading the stream raised, in the pump
    if write_end >= 0:
        pump = threading.Thread(target=_pump, args=(stream, write_end, unreadable), daemon=True,
                                name="smolvm-unpack-pump")
        pump.start()
    try:
        lines = _read_result(result_r, caps.timeout + limits.LIMITS.unpacker_grace, policy)
    finally:
        os.close(result_r)
        if pump is not None:
            pump.join(timeout=5)
    if unreadable:
        # The helper saw an end of stream where reading failed: what it unpacked may look whole
        # (the failure fell between members) and must not be taken for the whole stream.
        raise UnsafeArchive(f"{policy.what}: reading the stream failed: {unreadable[0]!r}")
    last = lines[-1] if lines else {}
    if last.get("ok"):
        return
    raise UnsafeArchive(str(last.get("error") or f"{policy.what}: the unpacking helper died before it finished "
                                                   "(its memory or CPU cap, or a signal)"))


def _read_result(fd: int, timeout: float, policy: rules.Policy) -> list[dict[str, Any]]:
    """The child's status lines, until it closes its end; past ``timeout`` it is killed."""
    deadline = time.monotonic() + timeout
    data = b""
    pid = 0
    # poll, not select: a process with hundreds of guests in flight (--smol-concurrency) holds
    # descriptors past select's FD_SETSIZE (1024), where select raises ValueError.
    readable = select.poll()
    readable.register(fd, select.POLLIN)
    try:
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not readable.poll(remaining * 1000):
                raise UnsafeArchive(f"{policy.what}: the guest's stream took longer than "
                                    f"{timeout - limits.LIMITS.unpacker_grace:.0f}s; refused")
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                break
            data += chunk
            if not pid and b"\n" in data:
                pid = int(json.loads(data.split(b"\n", 1)[0]).get("pid") or 0)
            if data.endswith(b"\n") and data.count(b"\n") >= 2:
                break  # the verdict: the child is only exiting now, no need to wait for it
    except BaseException:
        if pid > 0:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)  # a timeout, Ctrl-C: the child stops writing now
        raise
    lines = []
    for line in data.splitlines():
        with contextlib.suppress(ValueError):
            lines.append(json.loads(line))
    return lines


class _Unpacker:
    """This process's unpacker (:mod:`.unpacker`), started on first use and again if it died."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._owner = 0
        self.process: subprocess.Popen[bytes] | None = None

    def send(self, config: bytes, fds: list[int]) -> None:
        with self._lock:
            for attempt in (1, 2):
                sock = self._ready()
                try:
                    socket.send_fds(sock, [config], fds)
                    return
                except OSError:
                    self._sock = None  # it died (killed, OOM): start another once
                    sock.close()
                    if attempt == 2:
                        raise

    def _ready(self) -> socket.socket:
        if self._sock is not None and self._owner == os.getpid():
            return self._sock
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with theirs:
            self.process = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _BOOT, _import_paths(), str(theirs.fileno())],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                pass_fds=(theirs.fileno(),), close_fds=True, start_new_session=True)
        self._sock, self._owner = ours, os.getpid()
        return ours


    def stop(self) -> None:
        """End the unpacker (it exits at the end of its socket) and reap it; the next use starts
        another. Children it forked for unpacks under way finish those on their own."""
        with self._lock:
            sock, process, owner = self._sock, self.process, self._owner
            self._sock = self.process = None
        if sock is None or owner != os.getpid():
            return  # none, or the parent's (a fork inherited it): not ours to end
        sock.close()
        if process is not None:
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


_UNPACKER = _Unpacker()


def stop_unpacker() -> None:
    """End this process's unpacker, if it started one (the end of a run: a library session's too)."""
    _UNPACKER.stop()


def _import_paths() -> str:
    paths = [str(Path(__file__).resolve().parents[2])]  # the package's own root
    try:
        import pyseccomp
        paths.append(str(Path(pyseccomp.__file__).resolve().parent))
    except (ImportError, OSError):
        pass  # the helper runs without its seccomp filter; every other wall holds
    return ":".join(paths)


def _pipe_fd(stream: IO[bytes]) -> int:
    """The stream's fd if it is a pipe or socket, which the helper then reads itself (as the
    in-process walker does: a guest's stream is handed over before anything read it)."""
    try:
        fd = stream.fileno()
        mode = os.fstat(fd).st_mode
    except (AttributeError, OSError, ValueError):
        return -1
    return fd if stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode) else -1


def _pump(stream: IO[bytes], fd: int, unreadable: list[BaseException]) -> None:
    try:
        while True:
            try:
                chunk = stream.read(rules.CHUNK)
            except Exception as exc:  # a truncated gzip or zstd frame, a read error: the caller says so
                unreadable.append(exc)
                break
            if not chunk:
                break
            view = memoryview(chunk)
            while view:
                view = view[os.write(fd, view):]
    except OSError:
        pass  # the helper stopped reading: its own error says why
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------- in the helper's child


def confine(root_fd: int, policy: rules.Policy, caps: rules.Caps, seccomp: Any) -> None:
    libc = ctypes.CDLL(None, use_errno=True)

    def check(result: int, what: str) -> None:
        if result != 0:
            code = ctypes.get_errno()
            raise OSError(code, f"{what}: {os.strerror(code)}")

    euid, egid = os.geteuid(), os.getegid()
    if euid == 0:
        check(libc.unshare(CLONE_NEWNS), "unshare")
    else:
        # The same uid inside: what the helper makes is owned by the user, as before.
        check(libc.unshare(CLONE_NEWUSER | CLONE_NEWNS), "unshare")
        for name, text in (("setgroups", "deny"), ("uid_map", f"{euid} {euid} 1"), ("gid_map", f"{egid} {egid} 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
    check(libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None), "mount --make-rprivate /")
    os.fchdir(root_fd)
    os.chroot(".")
    os.chdir("/")
    os.closerange(3, 1 << 16)  # the root fd too: a dir fd from outside is a way back out
    keep = [CAP_CHOWN, CAP_DAC_OVERRIDE, CAP_FOWNER, CAP_FSETID] if policy.layer and euid == 0 else []
    for cap in range(CAP_LAST + 1):
        if cap not in keep and libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 and ctypes.get_errno() != errno.EINVAL:
            check(-1, "drop capabilities")
    libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    mask = sum(1 << cap for cap in keep)
    header = (ctypes.c_uint32 * 2)(_LINUX_CAPABILITY_VERSION_3, 0)
    data = (ctypes.c_uint32 * 6)(mask, mask, 0, 0, 0, 0)  # effective, permitted, inheritable (x2)
    check(libc.capset(header, data), "capset")
    check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_CAP, MEMORY_CAP))
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
    cpu = int(caps.timeout) + 5
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
    if seccomp is not None:
        filt = seccomp.SyscallFilter(seccomp.ALLOW)
        for name in DENIED:
            if seccomp.resolve_syscall(seccomp.Arch.NATIVE, name) >= 0:
                filt.add_rule(seccomp.ERRNO(errno.EPERM), name)
        filt.add_rule(seccomp.ERRNO(errno.ENOSYS), "clone3")
        filt.load()
