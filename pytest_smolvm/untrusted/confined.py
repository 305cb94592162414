"""The first wall around unpacking guest- and image-made tar streams: a helper that reaches
nothing but its destination (moby's ``pkg/chrootarchive`` is the model).

:func:`extract` runs :func:`pytest_smolvm.untrusted.hostfs.extract` (the second wall: an fd walk that
follows no link the stream made) in a short-lived child process fed the stream on a pipe. The
child, once everything it needs is imported, enters a mount namespace of its own (and a user
namespace when not root), makes the destination its root, drops every capability but the few
creating files with kept owners needs, sets ``no_new_privs``, caps its memory, open files and
CPU time, and loads a seccomp filter that refuses exec, fork, sockets, mounts, ``mknod`` and
``chroot``. A flaw in the walker then still writes nothing outside the destination, and reads
nothing outside it either.

Errors come back as the same :class:`~pytest_smolvm.untrusted.UnsafeArchive` messages as the
in-process walker raises.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import resource
import stat
import subprocess
import sys
import threading
from pathlib import Path
from typing import IO, Any

from pytest_smolvm import limits
from pytest_smolvm.errors import GuestError, UnsafeArchive
from pytest_smolvm.untrusted import hostfs, rules

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
         "from pytest_smolvm.untrusted.confined import _child; _child()")


def extract(stream: IO[bytes], dest: str | os.PathLike[str], policy: rules.Policy,
            caps: rules.Caps | None = None) -> None:
    """Unpack ``stream`` under the existing directory ``dest`` in the confined helper."""
    caps = caps or rules.Caps()
    config = json.dumps({"policy": vars(policy), "caps": vars(caps)})
    root_fd = os.open(dest, rules.DIR_FLAGS)
    direct = _pipe_fd(stream)
    read_end = write_end = -1
    if direct < 0:
        read_end, write_end = os.pipe()
    try:
        child = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _BOOT, _import_paths(), str(root_fd), config],
            stdin=direct if direct >= 0 else read_end, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            pass_fds=(root_fd,), close_fds=True)
    finally:
        os.close(root_fd)
        if read_end >= 0:
            os.close(read_end)
    pump = None
    unreadable: list[BaseException] = []  # what reading the stream raised, in the pump
    if write_end >= 0:
        pump = threading.Thread(target=_pump, args=(stream, write_end, unreadable), daemon=True,
                                name="smolvm-unpack-pump")
        pump.start()
    try:
        out, err = child.communicate(timeout=caps.timeout + limits.LIMITS.unpacker_grace)
    except subprocess.TimeoutExpired:
        child.kill()
        child.communicate()
        raise UnsafeArchive(f"{policy.what}: the guest's stream took longer than "
                                   f"{caps.timeout:.0f}s; refused") from None
    except BaseException:
        child.kill()
        child.wait()
        raise
    finally:
        if pump is not None:
            pump.join(timeout=5)
    if unreadable:
        # The helper saw an end of stream where reading failed: what it unpacked may look whole
        # (the failure fell between members) and must not be taken for the whole stream.
        raise UnsafeArchive(f"{policy.what}: reading the stream failed: {unreadable[0]!r}")
    if child.returncode == 0:
        return
    try:
        message = str(json.loads(out.decode().strip().splitlines()[-1])["error"])
    except (ValueError, IndexError, KeyError):
        tail = err.decode(errors="replace").strip().splitlines()[-1:] or [f"exit status {child.returncode}"]
        message = f"{policy.what}: the unpacking helper failed: {tail[0][:300]}"
    raise UnsafeArchive(message)


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


# ---------------------------------------------------------------------------- the helper


def _child() -> None:
    root_fd, config = int(sys.argv[2]), json.loads(sys.argv[3])
    policy = rules.Policy(**config["policy"])
    caps = rules.Caps(**config["caps"])
    try:
        import pyseccomp
    except (ImportError, OSError):
        pyseccomp = None
    try:
        _confine(root_fd, policy, caps, pyseccomp)
        hostfs.extract(os.fdopen(0, "rb", buffering=0), "/", policy, caps)
    except (GuestError, OSError) as exc:
        sys.stdout.write(json.dumps({"error": str(exc) if isinstance(exc, GuestError)
                                     else f"{policy.what}: cannot unpack: {exc}"}) + "\n")
        sys.stdout.flush()
        os._exit(1)
    os._exit(0)


def _confine(root_fd: int, policy: rules.Policy, caps: rules.Caps, seccomp: Any) -> None:
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
