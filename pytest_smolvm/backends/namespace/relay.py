"""The shell door's relay: the guest command's stdio are fds the host made, never the user's.

A guest process that holds the user's terminal can write to it after the shell returns and read
what the user types into the host shell afterwards. So the host makes the command's stdio: a
pseudo-terminal (when the user's stdin is a terminal) or three pipes (a script's stdin), and
copies bytes between them and its own stdin/stdout/stderr while the command runs. When the
command exits (or the shell ends any other way) the host kills the command's process group,
takes what is already queued, and closes its ends: a daemon that left the group holds a hung-up
pty or broken pipes, and nothing the user types afterwards is read by anyone but the host shell.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import select
import signal
import termios
import time
import tty
from collections.abc import Callable, Iterator
from types import FrameType

CHUNK = 65536
# After the command exits: what its output already queued is taken for at most this long (a
# daemon writing without pause must not hold the shell open), each read waiting this long.
DRAIN_LIMIT = 1.0
DRAIN_IDLE = 0.05


class Stdio:
    """The guest command's fds 0-2 (``theirs``, sent once and closed here) and the host's ends."""

    def __init__(self, pty: bool) -> None:
        self.pty = pty
        self.outputs: dict[int, int] = {}  # host end -> the host fd its bytes go to
        if pty:
            master, slave = os.openpty()
            self.input: int | None = master
            self.outputs[master] = 1
            self.theirs = [slave, slave, slave]
            with contextlib.suppress(termios.error):  # the user's settings (echo, erase) for the guest's terminal
                termios.tcsetattr(slave, termios.TCSANOW, termios.tcgetattr(0))
            self.resize()
        else:
            in_r, in_w = os.pipe2(os.O_CLOEXEC)
            out_r, out_w = os.pipe2(os.O_CLOEXEC)
            err_r, err_w = os.pipe2(os.O_CLOEXEC)
            self.input = in_w
            self.outputs = {out_r: 1, err_r: 2}
            self.theirs = [in_r, out_w, err_w]
        for fd in (self.input, *self.outputs):
            os.set_blocking(fd, False)
        self.pending = b""  # typed, not yet taken by the guest's side

    def sent(self) -> None:
        for fd in set(self.theirs):
            os.close(fd)
        self.theirs = []

    def resize(self, *_: object) -> None:
        """The user's window size for the guest's terminal (at start and on SIGWINCH)."""
        if self.pty and self.input is not None:
            with contextlib.suppress(OSError):
                size = fcntl.ioctl(1 if os.isatty(1) else 0, termios.TIOCGWINSZ, b"\0" * 8)
                fcntl.ioctl(self.input, termios.TIOCSWINSZ, size)

    def close(self) -> None:
        for fd in {*self.theirs, *self.outputs, *([self.input] if self.input is not None else [])}:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.theirs, self.outputs, self.input = [], {}, None

    def relay(self, status: int, on_reply: Callable[[bytes], int | None]) -> int:
        """Copy bytes until ``on_reply`` (fed each status message) returns the exit status."""
        stdin_open = True
        while True:
            wanted: dict[int, int] = {status: select.POLLIN}
            for fd in self.outputs:
                wanted[fd] = select.POLLIN
            if self.input is not None and self.pending:  # a pty's master is both: one registration
                wanted[self.input] = wanted.get(self.input, 0) | select.POLLOUT
            elif stdin_open and self.input is not None:
                wanted[0] = select.POLLIN
            poller = select.poll()
            for fd, mask in wanted.items():
                poller.register(fd, mask)
            for fd, events in _poll(poller):
                if fd == status:
                    code = on_reply(os.read(status, CHUNK))
                    if code is not None:
                        return code
                elif fd == 0:
                    stdin_open = self._typed()
                    continue
                if fd == self.input and (events & select.POLLOUT or fd not in self.outputs):
                    self._feed()  # or learn (EPIPE) that the command closed its stdin
                if events & ~select.POLLOUT and fd in self.outputs:
                    self._copy_out(fd)

    def drain(self) -> None:
        """Take what the command queued before it ended, within ``DRAIN_LIMIT``."""
        deadline = time.monotonic() + DRAIN_LIMIT
        while self.outputs and time.monotonic() < deadline:
            ready = select.select(list(self.outputs), [], [], DRAIN_IDLE)[0]
            if not ready:
                return
            for fd in ready:
                self._copy_out(fd)

    def _typed(self) -> bool:
        try:
            data = os.read(0, CHUNK)
        except OSError:
            data = b""
        if not data:  # the user's stdin ended: the command's does too (a pty keeps its own)
            if not self.pty and self.input is not None:
                os.close(self.input)
                self.input = None
            return False
        self.pending += data
        self._feed()
        return True

    def _feed(self) -> None:
        assert self.input is not None
        try:
            written = os.write(self.input, self.pending)
        except BlockingIOError:
            return
        except OSError:  # the command closed its stdin: what is typed goes nowhere
            written = len(self.pending)
        self.pending = self.pending[written:]

    def _copy_out(self, fd: int) -> None:
        try:
            data = os.read(fd, CHUNK)
        except BlockingIOError:
            return
        except OSError:  # EIO: a pty whose every slave is closed
            data = b""
        if not data:
            del self.outputs[fd]
            os.close(fd)
            if fd == self.input:
                self.input = None
            return
        target = self.outputs[fd]
        view = memoryview(data)
        while view:
            try:
                view = view[os.write(target, view):]
            except BlockingIOError:
                select.select([], [target], [])
            except OSError:  # the user's terminal went away: keep relaying nothing
                return


def _poll(poller: select.poll) -> list[tuple[int, int]]:
    try:
        return poller.poll()
    except InterruptedError:  # a signal (SIGWINCH) with no handler raising
        return []


@contextlib.contextmanager
def user_terminal(stdio: Stdio) -> Iterator[None]:
    """The user's terminal in raw mode while the guest's pty runs (keys go to the guest's line
    discipline, as through ssh), restored on every way out; SIGWINCH resizes the guest's."""
    if not stdio.pty:
        yield
        return
    saved = termios.tcgetattr(0)
    previous = signal.signal(signal.SIGWINCH, stdio.resize)
    try:
        tty.setraw(0, termios.TCSANOW)
        yield
    finally:
        signal.signal(signal.SIGWINCH, previous)
        termios.tcsetattr(0, termios.TCSADRAIN, saved)


@contextlib.contextmanager
def ended_by_signals() -> Iterator[None]:
    """SIGTERM and SIGHUP end the shell through its ``finally``: the terminal is restored and
    the guest command killed, not left running with a terminal in raw mode."""
    def leave(signum: int, _frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    previous = {sig: signal.signal(sig, leave) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def wants_pty() -> bool:
    """A terminal for the guest command when the user types into one and reads from it: with
    stdout redirected (``shell NAME cat f > copy``) the bytes must come out as the guest wrote
    them, not with a terminal's CRLFs."""
    try:
        return os.isatty(0) and os.isatty(1) and bool(termios.tcgetattr(0))
    except (OSError, termios.error):
        return False

