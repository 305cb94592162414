"""Admission control, the one host-wide slot system: a bound on guests being created at once
and on guests alive (``--smol-max-vms``, where given, is that bound).

Every pytest process of every run on this host shares the bounds (all xdist workers
included): each admitted guest holds one slot, an fcntl lock on one of N files in the state
dir, so a process that dies releases its slots with it and a crash never leaks capacity.

The bounds default from what the host can hold: guests alive from the memory available
(``MemAvailable``) over the backend's per-guest host cost (``guest_host_mb``: what one guest
costs this host, not what it may use), creates at once from the backend's
``creates_at_once`` for this host's cores. ``--smol-max-vms`` replaces the alive bound (its
slots are the same files: it counts every guest alive on this host).

A slot is always the lowest free one, so a process holding slot k found slots 0..k-1 held
when it took it: the largest k+1 any process saw is the peak held host-wide, which the
terminal summary reports (max over the run's workers, through ``workeroutput``).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import select
import threading
from collections.abc import Callable

from pytest_smolvm import limits
from pytest_smolvm.errors import ProvisionError
from pytest_smolvm.host.paths import state_dir

BACKSTOP_SECONDS = 1.0  # a waiter's rescan when no release was seen: a holder that died (see _Freed)
POLL_SECONDS = 0.02  # the rescan where inotify is unavailable
MEMORY_SHARE = 0.8  # of MemAvailable the default lets guests take; the rest is the host's own
CLOUD_GUEST_HOST_MB = 4  # a cloud guest costs this host a connection and a thread or two
CLOUD_CREATES_AT_ONCE = 64  # requests in flight to the control plane; it queues the rest itself
ALIVE, CREATING = "alive", "creating"
_IN_CLOSE_WRITE = 0x8
_IN_NONBLOCK_CLOEXEC = os.O_NONBLOCK | os.O_CLOEXEC


class Gate:
    """N host-wide slots named ``name``; one process's view of them.

    A slot is held by an fcntl lock on its file, kept open only while held: a scan opens each
    file it tries and closes it at once when another holds it (an fd per slot scanned past,
    kept, made a second process fail with EMFILE while another held hundreds of guests).
    """

    def __init__(self, name: str, size: int) -> None:
        self.name = name
        self.size = size
        self.peak = 0  # the largest slot index + 1 this process took
        self._fds: dict[int, int] = {}  # the slots this process holds: their locked files
        self._lock = threading.Lock()
        self._turn = threading.Lock()  # held by this process's one waiter that watches for a free slot
        self._dir = state_dir() / "admission"
        self._freed: _Freed | None = None

    def acquire(self, waiting: Callable[[], None] | None = None) -> Slot:
        """The lowest free slot; ``waiting()`` is called once if there is none yet. Raises
        ProvisionError if the slot files cannot be opened (a full fd table, the state dir)."""
        slot = self._try()
        if slot is not None:
            return slot
        if waiting is not None:
            waiting()
        # One waiter of this process watches; the others queue on _turn without burning CPU.
        # It sleeps until a slot file is closed after a write, which every release does (in
        # any process: _release_file), and rescans then; a holder that died releases without
        # that, so it rescans every BACKSTOP_SECONDS too. It used to rescan every 20 ms.
        with self._turn:
            if self._freed is None:  # watching before the next scan: a release after it is seen
                self._dir.mkdir(parents=True, exist_ok=True)
                self._freed = _Freed.watching(self._dir)
            while True:
                slot = self._try()
                if slot is not None:
                    return slot
                if self._freed is None:
                    threading.Event().wait(POLL_SECONDS)
                else:
                    self._freed.wait(BACKSTOP_SECONDS)

    def on_wait(self, waiting: Callable[[str], None] | None) -> Callable[[], None] | None:
        """``waiting(why)`` as :meth:`acquire`'s ``waiting``, saying which bound holds the caller back."""
        return (lambda: waiting(f"{self.size} guests {self.name} on this host")) if waiting is not None else None

    def _path(self, index: int) -> str:
        return str(self._dir / f"{self.name}-{index}.lock")

    def _try(self) -> Slot | None:
        with self._lock:
            for index in range(self.size):
                if index in self._fds:
                    continue  # flock is per open file: this process's own holders are counted here
                path = self._path(index)
                try:
                    try:
                        fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
                    except FileNotFoundError:
                        self._dir.mkdir(parents=True, exist_ok=True)
                        fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
                except OSError as exc:  # one clear line, not a raw OSError as the test's setup error
                    hint = ("raise the open-file limit (ulimit -n)" if exc.errno in (errno.EMFILE, errno.ENFILE)
                            else "check $PYTEST_SMOLVM_STATE_DIR")
                    raise ProvisionError(f"admission: cannot open {path} ({exc.strerror}, "
                                         f"{len(self._fds)} {self.name} slots held by this process): {hint}") from None
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    os.close(fd)
                    continue
                self._fds[index] = fd
                self.peak = max(self.peak, index + 1)
                return Slot(self, index)
        return None

    def release(self, index: int) -> None:
        with self._lock:
            fd = self._fds.pop(index, None)
            if fd is not None:
                os.close(fd)  # releases the lock
        if fd is not None:
            _release_file(self._path(index))

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)  # releases every lock still held
            self._fds.clear()
            freed, self._freed = self._freed, None
        if freed is not None:
            freed.close()


def _release_file(path: str) -> None:
    """Say that a slot is free to every waiter on this host: closing a file opened for writing
    is what their inotify watch wakes on (opening it read-only, as a scan does, wakes nobody)."""
    with contextlib.suppress(OSError):
        os.close(os.open(path, os.O_WRONLY | os.O_CLOEXEC))


class _Freed:
    """An inotify watch on the slot folder for files closed after a write (see _release_file)."""

    def __init__(self, fd: int) -> None:
        self._fd = fd

    @classmethod
    def watching(cls, directory: os.PathLike[str]) -> _Freed | None:
        """A watch on ``directory``, or None where inotify is unavailable (then: polling)."""
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fd = libc.inotify_init1(_IN_NONBLOCK_CLOEXEC)
            if fd < 0:
                return None
            if libc.inotify_add_watch(fd, os.fsencode(directory), _IN_CLOSE_WRITE) < 0:
                os.close(fd)
                return None
        except (OSError, AttributeError):
            return None
        return cls(fd)

    def wait(self, timeout: float) -> None:
        """Until a slot file is released (events drained), or ``timeout`` seconds."""
        poller = select.poll()  # not select(): this fd's number may be past 1,024 (hundreds of guests)
        poller.register(self._fd, select.POLLIN)
        if poller.poll(timeout * 1000):
            with contextlib.suppress(BlockingIOError):
                while os.read(self._fd, 4096):
                    pass

    def close(self) -> None:
        os.close(self._fd)


class Slot:
    def __init__(self, gate: Gate, index: int) -> None:
        self._gate: Gate | None = gate
        self.index = index

    def release(self) -> None:
        gate, self._gate = self._gate, None
        if gate is not None:
            gate.release(self.index)


def memory_available_mb() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) // 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def default_alive(guest_host_mb: float) -> int:
    """Guests this host can hold alive at once, from the memory available now."""
    available = memory_available_mb()
    if available is None:
        return 256
    return max(1, int(available * MEMORY_SHARE / max(guest_host_mb, 1)))


_gates: dict[tuple[str, str, int | None], Gate] = {}  # this process's view of the host-wide gates
_gates_lock = threading.Lock()


def gate(name: str, size: int, *, fixed: bool = False) -> Gate:
    """This process's gate ``name`` in this state dir: a default ``size`` is fixed by the first
    caller in this process (it is read from the memory available now); a ``fixed`` one (an
    explicit ``--smol-max-vms``) is its own, over the same slot files."""
    key = (name, str(state_dir()), size if fixed else None)
    with _gates_lock:
        found = _gates.get(key)
        if found is None:
            found = _gates[key] = Gate(name, size)
        return found


def peaks() -> dict[str, list[int]]:
    """``{gate: [peak held host-wide as this process saw it, bound]}`` for the summary."""
    found: dict[str, list[int]] = {}
    with _gates_lock:
        for g in _gates.values():
            if g.peak and g.peak >= found.get(g.name, [0])[0]:
                found[g.name] = [g.peak, g.size]
    return found


def bounds(backend: type, target: str) -> tuple[int, int]:
    """(guests alive, guests being created) this host admits at once, by default."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if target == "cloud":
        return default_alive(CLOUD_GUEST_HOST_MB), CLOUD_CREATES_AT_ONCE
    cost = getattr(backend, "guest_host_mb", limits.LIMITS.memory_mb)  # a microVM holds its whole RAM
    creating = getattr(backend, "creates_per_core", 4) * cores
    return default_alive(cost), max(2, creating)
