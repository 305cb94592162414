"""Admission control: a host-wide bound on guests being created at once and on guests alive.

Every pytest process of every run on this host shares the bounds (all xdist workers
included): each admitted guest holds one slot, an fcntl lock on one of N files in the state
dir, so a process that dies releases its slots with it and a crash never leaks capacity.

The bounds default from what the host can hold: guests alive from the memory available
(``MemAvailable``) over the backend's per-guest host cost (``guest_host_mb``: what one guest
costs this host, not what it may use), creates at once from the backend's
``creates_at_once`` for this host's cores. ``--smol-max-vms`` replaces the alive bound.

A slot is always the lowest free one, so a process holding slot k found slots 0..k-1 held
when it took it: the largest k+1 any process saw is the peak held host-wide, which the
terminal summary reports (max over the run's workers, through ``workeroutput``).
"""

from __future__ import annotations

import fcntl
import os
import threading
from collections.abc import Callable

from pytest_smolvm.host.paths import state_dir
from pytest_smolvm.limits import LIMITS

POLL_SECONDS = 0.02
MEMORY_SHARE = 0.8  # of MemAvailable the default lets guests take; the rest is the host's own
CLOUD_GUEST_HOST_MB = 4  # a cloud guest costs this host a connection and a thread or two
CLOUD_CREATES_AT_ONCE = 64  # requests in flight to the control plane; it queues the rest itself
ALIVE, CREATING = "alive", "creating"


class Gate:
    """N host-wide slots named ``name``; one process's view of them."""

    def __init__(self, name: str, size: int) -> None:
        self.name = name
        self.size = size
        self.peak = 0  # the largest slot index + 1 this process took
        self._fds: dict[int, int] = {}
        self._held: set[int] = set()
        self._lock = threading.Lock()
        self._turn = threading.Lock()  # held by this process's one waiter that polls
        self._freed = threading.Condition()  # notified when this process frees a slot
        self._dir = state_dir() / "admission"

    def acquire(self, waiting: Callable[[], None] | None = None) -> Slot:
        """The lowest free slot; ``waiting()`` is called once if there is none yet."""
        slot = self._try()
        if slot is not None:
            return slot
        if waiting is not None:
            waiting()
        # One waiter of this process polls the lock files; the others queue on _turn without
        # burning CPU. Each polling waiter used to try every slot every POLL_SECONDS: 136 of
        # them under --smol-concurrency=100 made ~400,000 flock calls a second on two cores.
        # A slot this process frees wakes the poller at once; another process's, within a poll.
        with self._turn:
            while True:
                slot = self._try()
                if slot is not None:
                    return slot
                with self._freed:
                    self._freed.wait(POLL_SECONDS)

    def on_wait(self, waiting: Callable[[str], None] | None) -> Callable[[], None] | None:
        """``waiting(why)`` as :meth:`acquire`'s ``waiting``, saying which bound holds the caller back."""
        return (lambda: waiting(f"{self.size} guests {self.name} on this host")) if waiting is not None else None

    def _try(self) -> Slot | None:
        with self._lock:
            for index in range(self.size):
                if index in self._held:
                    continue  # flock is per open file: this process's own holders are counted here
                fd = self._fd(index)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue
                self._held.add(index)
                self.peak = max(self.peak, index + 1)
                return Slot(self, index)
        return None

    def _fd(self, index: int) -> int:
        fd = self._fds.get(index)
        if fd is None:
            self._dir.mkdir(parents=True, exist_ok=True)
            fd = self._fds[index] = os.open(self._dir / f"{self.name}-{index}.lock",
                                            os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        return fd

    def release(self, index: int) -> None:
        with self._lock:
            if index in self._held:
                fcntl.flock(self._fds[index], fcntl.LOCK_UN)
                self._held.discard(index)
        with self._freed:
            self._freed.notify()

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)  # releases every lock still held
            self._fds.clear()
            self._held.clear()


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


_gates: dict[str, Gate] = {}  # this process's view of the host-wide gates
_gates_lock = threading.Lock()


def gate(name: str, size: int) -> Gate:
    """This process's gate ``name`` (its size is fixed by the first caller in this process)."""
    with _gates_lock:
        found = _gates.get(name)
        if found is None:
            found = _gates[name] = Gate(name, size)
        return found


def peaks() -> dict[str, list[int]]:
    """``{gate: [peak held host-wide as this process saw it, bound]}`` for the summary."""
    with _gates_lock:
        return {name: [g.peak, g.size] for name, g in _gates.items() if g.peak}


def bounds(backend: type, target: str) -> tuple[int, int]:
    """(guests alive, guests being created) this host admits at once, by default."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if target == "cloud":
        return default_alive(CLOUD_GUEST_HOST_MB), CLOUD_CREATES_AT_ONCE
    cost = getattr(backend, "guest_host_mb", LIMITS.memory_mb)  # a microVM holds its whole RAM
    creating = getattr(backend, "creates_per_core", 4) * cores
    return default_alive(cost), max(2, creating)
