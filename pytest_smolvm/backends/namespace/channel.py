"""The host side of one request to a namespace guest's init (see ``_nsguest.py``, ``Init``).

Each request brings its own fds (stdin, stdout, stderr and a status socket) and the init
answers on that status socket only, so any number of requests run at once from any number
of threads: nothing is shared but the control socket, and sending on it is one atomic
message. A request too big for one message (argv and env near ARG_MAX) travels as a memfd.
"""

from __future__ import annotations

import fcntl
import json
import os
import select
import socket
import struct
import termios
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import IO, Any

from pytest_smolvm import limits
from pytest_smolvm.backends.base import Cancel, OutputCallback
from pytest_smolvm.backends.output import BoundedBuffer
from pytest_smolvm.errors import GuestError, GuestUserError, ProvisionError
from pytest_smolvm.host.procs import kill_stopped_vfork_children

# Beyond this a request goes as a memfd: a SOCK_SEQPACKET message must fit the socket's
# send buffer (~208 KiB by default), and a bigger one fails with EMSGSIZE.
INLINE_LIMIT = 64 << 10
HELD_SPAWN_LOOK = 1.0  # seconds a call waits for its command's pid before it looks for a held init


class Unanswered(GuestError):
    """The guest's init took no request, or reported no end within ``guest_answer_grace`` of a
    kill: it is wedged, and the guest's owner gives it up (``NamespaceGuest``)."""


class Channel:
    """The host end of one guest's control socket. It sends; replies come on status sockets."""

    def __init__(self, ctl: socket.socket, name: str, init_pid: int = 0) -> None:
        self._ctl = ctl
        self._name = name
        self._init_pid = init_pid
        self._lock = threading.Lock()

    def send(self, message: dict[str, Any], fds: Sequence[int] = ()) -> None:
        data = json.dumps(message).encode()
        body = -1
        if len(data) > INLINE_LIMIT:
            body = os.memfd_create("smolvm-request", os.MFD_CLOEXEC)
            view = memoryview(data)
            while view:
                view = view[os.write(body, view):]
            data, fds = b'{"body": true}', [*fds, body]
        try:
            with self._lock:  # fds and message leave together; one sender at a time keeps that simple
                self._send_within_grace(data, fds)
        except OSError as exc:
            raise GuestError(f"guest {self._name} is gone: {exc}") from exc
        finally:
            if body >= 0:
                os.close(body)

    def _send_within_grace(self, data: bytes, fds: Sequence[int]) -> None:
        """An init that takes no message lets a few queue, then blocks the sender: wait for room
        within ``guest_answer_grace`` (a send that fits costs one syscall, as before)."""
        deadline = 0.0
        while True:
            try:
                if fds:
                    socket.send_fds(self._ctl, [data], list(fds), socket.MSG_DONTWAIT)
                else:
                    self._ctl.send(data, socket.MSG_DONTWAIT)
                return
            except BlockingIOError:
                now = time.monotonic()
                deadline = deadline or now + limits.LIMITS.guest_answer_grace
                poller = select.poll()
                poller.register(self._ctl, select.POLLOUT)
                if now >= deadline or not poller.poll(int((deadline - now) * 1000) + 1):
                    raise Unanswered(f"guest {self._name} stopped answering: its init took no request "
                                     f"within {limits.LIMITS.guest_answer_grace:.0f}s") from None

    def free_held(self) -> None:
        """The init starts commands with posix_spawn, whose vfork holds it until the child
        execs: a child that a guest process stopped in between (``kill -STOP -1`` in a loop
        catches one) held the init, which then served no request, not even the kill that would
        free it. Only the host can end that child; a child that ran on to its program is never
        touched."""
        if self._init_pid > 0:
            kill_stopped_vfork_children(self._init_pid)

    def kill(self, pid: int) -> None:
        """Have the init kill a request's child (and its group), freeing the init first."""
        self.free_held()
        self.send({"op": "kill", "pid": pid})

    def close(self) -> None:
        self._ctl.close()


@dataclass(frozen=True)
class Outcome:
    exit_code: int
    stdout: bytes
    stderr: bytes
    timed_out: bool
    truncated: tuple[str, ...]
    cancelled: bool
    error: dict[str, Any] | None  # the init's or the child's structured refusal, if any


def _status(data: bytes, name: str) -> dict[str, Any]:
    """One status message. The init writes them, but a request's child (in the guest) can too:
    anything malformed is the guest's fault, reported as a broken guest, never a crash here."""
    try:
        reply = json.loads(data)
        if not isinstance(reply, dict):
            raise ValueError("not an object")
        for key in ("pid", "exit"):
            if key in reply:
                reply[key] = int(reply[key])
    except (ValueError, TypeError) as exc:
        raise GuestError(f"guest {name} sent a malformed status message: {exc}") from None
    return reply


def raise_error(error: dict[str, Any], name: str, what: str) -> None:
    """Turn a structured refusal from the guest into the exception a caller branches on."""
    if "user" in error:
        raise GuestUserError(str(error["user"]))
    number = error.get("errno")
    if not isinstance(number, int):
        raise GuestError(f"{what} in {name}: {str(error.get('message', error))[:2000]}")
    filename = error.get("filename")
    raise OSError(number, str(error.get("strerror") or os.strerror(number))[:2000],
                  filename if isinstance(filename, str) else None)


def run(channel: Channel, message: dict[str, Any], *, name: str, stdin: bytes | IO[bytes] | None,
        output_limit: int, timeout: float | None, on_output: OutputCallback | None = None,
        cancel: Cancel | None = None, stdout_sink: Callable[[bytes], None] | None = None,
        stdout_fd: int | None = None) -> Outcome:
    """Send one request that starts a guest child, feed its stdin, collect its output and status.

    ``stdin`` as a file with a descriptor (a pipe) goes to the child as is: no copy through
    this process; so does ``stdout_fd`` (this call closes it once sent; the caller reads the
    other end). ``cancel`` kills the child's process group, as a timeout does.
    """
    if isinstance(stdin, (bytes, bytearray)) or stdin is None:
        in_r, in_w = os.pipe()
        own_in_r = True
    else:
        in_r, in_w, own_in_r = stdin.fileno(), -1, False
    out_r, out_w = os.pipe() if stdout_fd is None else (-1, stdout_fd)
    err_r, err_w = os.pipe()
    status, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    ours = [fd for fd in (in_r if own_in_r else -1, out_w, err_w) if fd >= 0]
    try:
        channel.send(message, (in_r, out_w, err_w, theirs.fileno()))
    except BaseException:
        for fd in (*ours, in_w, out_r, err_r):
            if fd >= 0:
                os.close(fd)
        status.close()
        raise
    finally:
        theirs.close()
    for fd in ours:
        os.close(fd)
    call = _Call(channel, status, name, stdin, in_w, out_r, err_r, output_limit, on_output, stdout_sink)
    try:
        return call.wait(timeout, cancel)
    finally:
        call.close()


class _Call:
    """One request in flight: its pipes, its status socket, and what has come back so far."""

    def __init__(self, channel: Channel, status: socket.socket, name: str, stdin: bytes | IO[bytes] | None,
                 in_w: int, out_r: int, err_r: int, output_limit: int, on_output: OutputCallback | None,
                 stdout_sink: Callable[[bytes], None] | None) -> None:
        self.channel, self.status, self.name = channel, status, name
        self.in_w, self.out_r, self.err_r = in_w, out_r, err_r
        self.stdout = BoundedBuffer(output_limit)
        self.stderr = BoundedBuffer(output_limit)
        self.pending = memoryview(bytes(stdin or b"")) if isinstance(stdin, (bytes, bytearray)) else memoryview(b"")
        self.sinks: dict[int, Callable[[bytes], None]] = {
            err_r: self._sink("stderr", self.stderr.add, on_output)}
        if out_r >= 0:
            self.sinks[out_r] = self._sink("stdout", stdout_sink or self.stdout.add, on_output)
        self.poller = select.poll()
        self.pid: int | None = None
        self.kill_pending = False
        self.wake_r = self.wake_w = -1  # a pipe that wakes the poll on cancel, when one can come
        self.wake_lock = threading.Lock()

    @staticmethod
    def _sink(stream: str, keep: Callable[[bytes], None],
              on_output: OutputCallback | None) -> Callable[[bytes], None]:
        if on_output is None:
            return keep

        def both(data: bytes) -> None:
            on_output(stream, data)
            keep(data)
        return both

    def _wake(self) -> None:
        # From another thread (a Cancel), maybe while the call is ending: a full pipe, or one
        # whose reader is gone, means nobody needs waking.
        with self.wake_lock:
            if self.wake_w >= 0:
                try:
                    os.write(self.wake_w, b"x")
                except (BlockingIOError, BrokenPipeError):
                    pass

    def kill(self) -> None:
        if self.pid is None:
            self.kill_pending = True  # the pid has not arrived yet: kill as soon as it does
            self.channel.free_held()  # the init may be held starting it
        elif self.pid > 1:
            self.channel.kill(self.pid)

    def wait(self, timeout: float | None, cancel: Cancel | None) -> Outcome:
        if self.in_w >= 0:
            os.set_blocking(self.in_w, False)
            if not self.pending:
                os.close(self.in_w)
                self.in_w = -1
        for fd in self.sinks:
            os.set_blocking(fd, False)
            self.poller.register(fd, select.POLLIN)
        self.poller.register(self.status, select.POLLIN)
        if self.in_w >= 0:
            self.poller.register(self.in_w, select.POLLOUT)
        if cancel is not None:
            self.wake_r, self.wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
            self.poller.register(self.wake_r, select.POLLIN)
            cancel.add(self._wake)
        try:
            return self._loop(timeout, cancel)
        finally:
            if cancel is not None:
                cancel.remove(self._wake)

    def _loop(self, timeout: float | None, cancel: Cancel | None) -> Outcome:
        exit_code: int | None = None
        error: dict[str, Any] | None = None
        timed_out = cancelled = False
        status_open = True
        deadline = time.monotonic() + timeout if timeout is not None else None
        answer_by: float | None = None  # once killed: when the init must have reported the end
        look_for_held = time.monotonic() + HELD_SPAWN_LOOK  # while no pid came: see below
        while exit_code is None and status_open:
            wait_ms = None
            if deadline is not None and not timed_out:
                wait_ms = max(0, int((deadline - time.monotonic()) * 1000) + 1)
            elif answer_by is not None:
                wait_ms = max(0, int((answer_by - time.monotonic()) * 1000) + 1)
            if self.pid is None:
                held_ms = max(0, int((look_for_held - time.monotonic()) * 1000) + 1)
                wait_ms = held_ms if wait_ms is None else min(wait_ms, held_ms)
            events = self.poller.poll(wait_ms)
            if self.pid is None and time.monotonic() >= look_for_held:
                # No pid yet: the init may be held in the command's spawn by a child a guest
                # process stopped, and with no timeout nothing else would ever free it.
                self.channel.free_held()
                look_for_held = time.monotonic() + HELD_SPAWN_LOOK
            if deadline is not None and not timed_out and time.monotonic() >= deadline:
                timed_out = True
                self.kill()
            for fd, _events in events:
                if fd == self.status.fileno():
                    try:
                        data = self.status.recv(1 << 16)
                    except OSError:
                        data = b""
                    if not data:
                        status_open = False
                        self.poller.unregister(fd)
                        continue
                    reply = _status(data, self.name)
                    if "pid" in reply:
                        self.pid = int(reply["pid"])
                        if self.kill_pending:
                            self.kill()
                    if "exit" in reply:
                        exit_code = int(reply["exit"])
                    if isinstance(reply.get("error"), dict):
                        error = reply["error"]
                elif fd == self.wake_r:
                    try:
                        os.read(self.wake_r, 64)
                    except BlockingIOError:
                        pass
                    if cancel is not None and cancel.cancelled and not cancelled:
                        cancelled = True
                        self.kill()
                elif fd == self.in_w:
                    self._feed()
                elif fd in self.sinks:
                    self._drain(fd)
            if (timed_out or cancelled) and exit_code is None and status_open:
                # Killed: the init reports the end within its own 2 s (GROUP_GONE_WAIT). One that
                # does not is wedged, and nothing it holds may hold this call for ever.
                if answer_by is None:
                    answer_by = time.monotonic() + limits.LIMITS.guest_answer_grace
                elif time.monotonic() >= answer_by:
                    raise Unanswered(f"guest {self.name} stopped answering: no end reported within "
                                     f"{limits.LIMITS.guest_answer_grace:.0f}s of killing a request")
        if exit_code is None and error is None:
            raise GuestError(f"guest {self.name} is gone (its init exited)")
        # The command is done: take what it already wrote, but never wait for a
        # background process that inherited its stdout, nor read for as long as one writes
        # (a `yes &` refills the pipe as fast as it is read): only what is queued now, and
        # within a bound.
        until = time.monotonic() + limits.LIMITS.exec_output_drain
        for fd in list(self.sinks):
            self._drain_queued(fd, until)
        truncated = tuple(s for s, b in (("stdout", self.stdout), ("stderr", self.stderr)) if b.dropped)
        code = 124 if timed_out else exit_code if exit_code is not None else -1
        return Outcome(code, self.stdout.value(), self.stderr.value(), timed_out, truncated, cancelled, error)

    def _feed(self) -> None:
        try:
            written = os.write(self.in_w, self.pending[:65536])
            self.pending = self.pending[written:]
        except BlockingIOError:
            pass
        except BrokenPipeError:  # the command does not read its stdin: fine
            self.pending = memoryview(b"")
        if not self.pending:
            self.poller.unregister(self.in_w)
            os.close(self.in_w)
            self.in_w = -1

    def _drain(self, fd: int, most: int = 1 << 16) -> int:
        """One read of up to ``most`` bytes from ``fd`` into its sink; the bytes read (0: none now)."""
        try:
            data = os.read(fd, most)
        except BlockingIOError:
            return 0
        if not data:
            self.poller.unregister(fd)
            del self.sinks[fd]
            return 0
        self.sinks[fd](data)
        return len(data)

    def _drain_queued(self, fd: int, until: float) -> None:
        """Read what ``fd`` holds now (at most a pipe's capacity), stopping at ``until``."""
        try:
            queued: int = struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0" * 4))[0]
        except OSError:
            queued = 1 << 20  # the most a pipe holds without CAP_SYS_RESOURCE
        while queued > 0 and time.monotonic() < until:
            read = self._drain(fd, min(queued, 1 << 16))
            if not read:
                return
            queued -= read

    def close(self) -> None:
        with self.wake_lock:  # first: a late _wake then finds no pipe, never half of one
            if self.wake_w >= 0:
                os.close(self.wake_w)
            self.wake_w = -1
        for fd in (self.in_w, self.out_r, self.err_r, self.wake_r):
            if fd >= 0:
                os.close(fd)
        self.status.close()


def receive_fds(ctl: socket.socket, most: int, failure: str) -> tuple[bytes, list[int]]:
    """A message and at most ``most`` fds the guest's setup sends on its control socket, within
    ``LIMITS.network_ready``; else ProvisionError("``failure``: why")."""
    ctl.settimeout(limits.LIMITS.network_ready)
    try:
        data, fds, _flags, _addr = socket.recv_fds(ctl, 4096, most)
    except OSError as exc:
        raise ProvisionError(f"{failure}: {exc}") from None
    finally:
        ctl.settimeout(None)
    return data, fds
