"""Host process facts: is this pid still the process we recorded, and waiting for one to go."""

from __future__ import annotations

import functools
import os
import select
import signal
import subprocess
import time

HAVE_PROC = os.path.isdir("/proc/self")


def process_start_time(pid: int) -> int | None:
    """The kernel's start time of ``pid``, or None if it is gone.

    A pid alone is not an identity: pids are reused. (pid, start time) is. Linux: clock ticks
    since boot, from /proc. Elsewhere (macOS has no /proc; reading it there made every live
    run look dead to the reaper): seconds since the epoch, from ps.
    """
    if not HAVE_PROC:
        return _ps_start_time(pid)
    fields = stat_fields(pid)
    if fields is None or fields[0] == b"Z":
        return None  # a zombie has already released everything we care about
    return int(fields[19])


def stat_fields(pid: int) -> list[bytes] | None:
    """/proc/PID/stat's fields from the third (the state) on, or None if ``pid`` is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    # comm (field 2) may contain spaces and parentheses: split after its closing paren.
    return raw[raw.rfind(b")") + 2:].split()


def _ps_start_time(pid: int) -> int | None:
    try:
        done = subprocess.run(["ps", "-o", "stat=,lstart=", "-p", str(pid)], capture_output=True, text=True,
                              timeout=10, env={**os.environ, "LC_ALL": "C"}, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    fields = done.stdout.split()
    if done.returncode != 0 or len(fields) < 6 or fields[0].startswith("Z"):
        return None
    try:
        return int(time.mktime(time.strptime(" ".join(fields[1:6]), "%a %b %d %H:%M:%S %Y")))
    except ValueError:
        return None


def is_alive(pid: int, start_time: int | None) -> bool:
    return start_time is not None and process_start_time(pid) == start_time


SIGKILL_PENDING = 1 << (signal.SIGKILL - 1)  # SIGKILL's bit in /proc/PID/status's pending masks
PF_EXITING = 0x4  # the kernel's task flag, in /proc/PID/stat's ninth field


def is_dying(pid: int) -> bool:
    """Whether ``pid`` was killed and will not run again, though it may not be gone yet: a
    SIGKILL pending (a busy or frozen process acts on it later), or its exit under way (a
    namespace's pid 1 exits only once every process of its namespace has). Linux only: False
    where there is no /proc, and for a pid already gone (ask :func:`is_alive` that)."""
    if not HAVE_PROC:
        return False
    fields = stat_fields(pid)
    if fields is None:
        return False
    if int(fields[6]) & PF_EXITING:
        return True
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            status = f.read()
    except OSError:
        return False
    pending = 0
    for line in status.splitlines():
        if line.startswith((b"SigPnd:", b"ShdPnd:")):
            pending |= int(line.split()[1], 16)
    return bool(pending & SIGKILL_PENDING)


def kill_stopped_vfork_children(parent: int) -> None:
    """SIGKILL the children of ``parent`` that are stopped before their execve, sharing its memory
    (a vfork or posix_spawn child: vsize and rss are the parent's own; a forked child looks alike
    until it execs). Linux only. Identity by pidfd: a pid reused meanwhile fails the signal."""
    try:
        with open(f"/proc/{parent}/task/{parent}/children", "rb") as f:
            children = [int(pid) for pid in f.read().split()]
    except (OSError, ValueError):
        return
    ours = stat_fields(parent)
    if ours is None:
        return
    for child in children:
        try:
            pidfd = os.pidfd_open(child)
        except OSError:
            continue
        try:
            fields = stat_fields(child)  # read after the pidfd is held
            if (fields is not None and fields[0] in (b"T", b"t") and fields[1] == str(parent).encode()
                    and fields[20:22] == ours[20:22]):  # vsize, rss
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        except OSError:
            pass
        finally:
            os.close(pidfd)


def wait_gone(pid: int, timeout: float) -> bool:
    """Wait until ``pid`` has exited (it need not be our child)."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    except OSError:
        pidfd = -1
    try:
        if pidfd >= 0:
            poller = select.poll()
            poller.register(pidfd, select.POLLIN)
            return bool(poller.poll(int(timeout * 1000)))
        deadline = time.monotonic() + timeout  # no pidfd (not Linux): poll
        while time.monotonic() < deadline:
            if process_start_time(pid) is None:
                return True
            time.sleep(0.005)
        return False
    finally:
        if pidfd >= 0:
            os.close(pidfd)


@functools.lru_cache(maxsize=1)
def host_facts() -> tuple[str, str, str]:
    """(hostname, boot id, pid namespace) of this process: where its pids mean something.

    A pid and a start time identify a process only in the pid namespace of the kernel boot
    that gave them: the boot id tells a rebooted host (pids start over) and other machines
    apart, the pid namespace (its inode) containers sharing one kernel, and the hostname
    names the host for people. Read once per process: none of them changes under it.
    """
    import socket

    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "noboot"
    try:
        pidns = str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        pidns = "nopidns"
    return socket.gethostname(), boot, pidns


def host_identity() -> str:
    """This host, boot and pid namespace in one label value: pids in labels mean something
    only where this matches (see :func:`host_facts`)."""
    host, boot, pidns = host_facts()
    return f"{host[:40]}-{boot[:8]}-{pidns}"
