"""The per-pytest-process helper that forks guests on request and cleans up after its owner.

Part of the namespace backend's helper (see ``__init__``): standard library only.
"""

from __future__ import annotations

import array
import contextlib
import ctypes
import gc
import json
import os
import select
import shutil
import signal
import socket
import sys
import time
from typing import Any

from pytest_smolvm.backends.namespace.helper.disk import Disk, DiskError
from pytest_smolvm.backends.namespace.helper.diskpool import QUIET_MS, DiskPool
from pytest_smolvm.backends.namespace.helper.kernel import (
    CLONE_NEWPID,
    IDENTITY_MAP,
    JANITOR_WAIT,
    MAP_REQUEST,
    PR_SET_CHILD_SUBREAPER,
    _check,
    _libc,
    _prctl,
    _recv,
    _send,
    _unshare,
    _write_small,
)
from pytest_smolvm.backends.namespace.helper.setup import _setup_guest


class _Creating:
    """A guest whose setup process is at work: the zygote serves other requests meanwhile."""

    def __init__(self, req: dict[str, Any], own_pid_ns: int, disks: DiskPool) -> None:
        self.id = req.get("id")
        self.janitor = _janitor(req, [os.path.dirname(p) for p in req["cgroup_procs"]])
        one_fork = not req["userns"]
        # An ext4 disk lent to this guest (helper/disk.py); its setup mounts it through this fd.
        # Only as root, where the setup process is the guest's init: its pidfd says when it is free.
        self.disk: Disk | None = disks.take(req["disk"]) if req.get("disk") and one_fork else None
        self.pidfd = -1
        if self.disk is not None:
            req["disk_fd"] = self.disk.loop
        # As root the init moves into a user namespace of its own and asks us, on its report
        # pipe, to write its maps (helper/kernel.py _own_user_namespace); we say so on this one.
        self.mapped_w = -1
        try:
            host_end, guest_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            report_r, report_w = os.pipe2(os.O_CLOEXEC)
            if one_fork and req.get("owner_uid") is not None:
                req["mapped_fd"], self.mapped_w = os.pipe2(os.O_CLOEXEC)
        except BaseException:
            if self.disk is not None:
                disks.give_back(self.disk, clean=False)
            raise
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
                if req.get("mapped_fd") is not None:
                    os.close(req["mapped_fd"])
                if pid < 0:
                    self._mapped()
                    os.close(report_r)
                    host_end.close()
                    if self.disk is not None:
                        disks.give_back(self.disk, clean=False)
        if pid == 0:
            os.close(report_r)
            host_end.close()
            if self.mapped_w >= 0:
                os.close(self.mapped_w)
            _setup_guest(req, guest_end, report_w)
        if self.disk is not None:
            self.pidfd = os.pidfd_open(pid)  # our unreaped child: its pid cannot be another's yet
        self.pid, self.report_r, self.host_end, self.raw = pid, report_r, host_end, b""

    def read(self) -> tuple[dict[str, Any], list[int]] | None:
        """Read what the setup process reported so far; the reply once it is all there.

        The reply comes as soon as the guest has reported, without waiting for a setup process
        to exit: tearing down its copy of our address space takes time, and the host need
        not wait for that. The zygote's loop reaps it (_reap_children) like any other child.
        """
        chunk = os.read(self.report_r, 1 << 16)
        self.raw += chunk
        if self.raw[:1] == MAP_REQUEST:
            self.raw = self.raw[1:]
            self._mapped(_map_identity(self.pid))
        reply: dict[str, Any] | None = None
        if chunk:
            try:
                reply = json.loads(self.raw)  # a prefix of a JSON object never parses: wait for the rest
            except ValueError:
                return None
        os.close(self.report_r)
        self._mapped()
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

    def _mapped(self, done: bool = False) -> None:
        """Tell the init its maps are written (``done``), or close the pipe unsaid: it fails."""
        if self.mapped_w >= 0:
            if done:
                with contextlib.suppress(OSError):
                    os.write(self.mapped_w, MAP_REQUEST)
            os.close(self.mapped_w)
            self.mapped_w = -1


def _map_identity(pid: int) -> bool:
    """Map every uid and gid of ``pid``'s new user namespace to itself (we are root outside it)."""
    try:
        for name in ("uid_map", "gid_map"):
            _write_small(f"/proc/{pid}/{name}", IDENTITY_MAP)
    except OSError:
        return False
    return True


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
    timeout). A guest's init exits by itself when its own socket closes; we wait for that, all
    of them at once, then SIGKILL the inits still running (a wedged init never sees its socket
    close: a guest must not outlive its owner, nor hold up the others' cleanup), and take away
    each guest's scratch dir, cgroups and registry record. A kept guest keeps all three.
    ``expected`` guests were announced but never asked for (the owner died in between): no
    process, only what the owner had made for them so far.
    """
    todo: list[tuple[int | None, dict[str, Any], str, dict[str, Any] | None]] = []
    for pid, guest in [*guests.items(), *((None, guest) for guest in expected.values())]:
        record_path = os.path.join(guest["state"], "registry", f"{guest['name']}.json")
        try:
            with open(record_path) as f:
                record = json.load(f)
        except (OSError, ValueError):
            record = None
        if record is not None and (record.get("kept") or record.get("data", {}).get("pid") not in (None, pid)):
            continue
        todo.append((pid, guest, record_path, record))
    running = {pid for pid, *_ in todo if pid is not None}
    _wait_exited(running, time.monotonic() + JANITOR_WAIT)
    for pid in running:  # still our unreaped children: their pids cannot have been reused
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)  # the kernel then kills the guest's whole pid namespace
    _wait_exited(running, time.monotonic() + JANITOR_WAIT)
    for pid, guest, record_path, record in todo:
        if pid in running:
            continue  # not gone even so (a process stuck in the kernel): left to 'pytest-smolvm reap'
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
        # A branch's copy of its parent's files (backends/namespace/branch.py): a tree the host
        # made, links in it never followed (shutil.rmtree's fd-based walk).
        layers = os.path.join(guest["state"], "layers", guest["name"])
        if os.path.isdir(layers) and not os.path.islink(layers):
            try:
                shutil.rmtree(layers)
            except OSError:
                removed_all = False
        if removed_all:  # otherwise the record stays for 'pytest-smolvm reap'
            # With any save the owner was killed in the middle of (registry.Record.save's temp file).
            partial = os.path.join(guest["state"], "registry", f".{guest['name']}.{owner}.tmp")
            for path in ([record_path] if record is not None else []) + [partial]:
                with contextlib.suppress(OSError):
                    os.unlink(path)


def _wait_exited(running: set[int], deadline: float) -> None:
    """Reap the children in ``running`` as they exit (removing them), until none is left or
    ``deadline``: all of them at once, so one that never exits costs the others nothing."""
    while running:
        for pid in list(running):
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                done = pid  # not (or no longer) our child: reaped already
            if done == pid:
                running.discard(pid)
        if not running or time.monotonic() >= deadline:
            return
        time.sleep(0.005)


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
    disks = DiskPool()
    lent: dict[int, tuple[int, Disk]] = {}  # pidfd of a guest's init -> its pid and the disk lent to it
    own_pid_ns = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    owner_gone = False
    while not owner_gone or creating:
        _reap_children()
        events = poller.poll(QUIET_MS if disks.unsettled() else None)
        if not events:  # nothing to serve for a while: the moment for the work between guests
            disks.settle()
            continue
        for fd, _events in events:
            if fd in creating:
                done = creating[fd].read()
                if done is not None:
                    poller.unregister(fd)
                    job = creating.pop(fd)
                    _reply(sock, job, *done, guests)
                    _lend(job, "pid" in done[0], disks, lent, poller)
                continue
            if fd in lent:  # a guest's init exited: its whole pid namespace, and every mount of it, is gone
                pid, disk = lent.pop(fd)
                poller.unregister(fd)
                os.close(fd)
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, os.WNOHANG)
                disks.give_back(disk)
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
                    try:
                        job = _Creating(message, own_pid_ns, disks)
                    except DiskError as exc:
                        raise _Refused(str(exc)) from None
                    creating[job.report_r] = job
                    poller.register(job.report_r, select.POLLIN)
                    continue
                if message["op"] == "ping":  # answered once the work between guests is done: tests wait on it
                    while disks.unsettled():
                        disks.settle()
                    reply: dict[str, Any] = {"ok": True}
                else:
                    reply = {"error": f"unknown op {message['op']!r}"}
            except _Refused as exc:
                reply = {"error": str(exc)}
            except Exception as exc:  # the zygote must outlive any one failed request
                reply = {"error": f"{type(exc).__name__}: {exc}"}
            reply["id"] = message.get("id")
            with contextlib.suppress(OSError):
                _send(sock, reply)
    _clean_after_owner(guests, expected, owner)


class _Refused(Exception):
    """A request refused with a message of its own (no exception type before it)."""


def _lend(job: _Creating, made: bool, disks: DiskPool, lent: dict[int, tuple[int, Disk]], poller: select.poll) -> None:
    """Watch the init of a guest made on a disk, to take the disk back when it is gone; a disk
    whose guest was not made is dropped (its setup process exited before its reply was read)."""
    if job.disk is None:
        return
    if made:
        lent[job.pidfd] = (job.pid, job.disk)
        poller.register(job.pidfd, select.POLLIN)
    else:
        os.close(job.pidfd)
        disks.give_back(job.disk, clean=False)


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
    page tables of what this process holds, and its exit unmaps them."""
    gc.collect()
    trim = getattr(_libc, "malloc_trim", None)  # glibc's; other C libraries may not have it
    if trim is not None:
        trim(ctypes.c_size_t(0))


def main() -> None:
    # argv (see namespace.Zygote): "-c" "_nsguest.py" FD TAG; the tag only marks whose helper this is.
    # A signal mask is inherited through fork and exec, and the host thread that started us may
    # block SIGINT/SIGTERM/SIGHUP (host/signals.py): every guest process would inherit that, and
    # a guest's `kill -TERM $$` would do nothing. Guests start with nothing blocked.
    signal.pthread_sigmask(signal.SIG_SETMASK, ())
    _preload()
    _shed_boot_memory()
    zygote(socket.socket(fileno=int(sys.argv[2])))
