"""The GuestPool's work off the test's path: destroys handed off, and a guest made ahead.

Both exist for speed (docs/performance.md): a test's teardown need not wait for its guest to
die, and where a core is idle the next test's guest can be made while this test runs. Both
are threads of the pytest process that owns the guests, so neither can outlive it: the pool
drains them before it closes, and a crash leaves only what the reaper already handles.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Hashable
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class Teardown(Generic[T]):
    """Runs ``destroy`` on handed-off items in one background thread, in hand-off order.

    ``destroy`` returns None or the problem met; problems wait in :attr:`failures` until the
    pool reports them (as warnings, on the main thread).
    """

    def __init__(self, destroy: Callable[[T], str | None], describe: Callable[[T], str]) -> None:
        self._destroy = destroy
        self._describe = describe
        self._queue: queue.Queue[T] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.failures: list[tuple[str, str]] = []  # (what, problem)

    def submit(self, item: T) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name="smolvm-teardown", daemon=True)
                self._thread.start()
        self._queue.put(item)

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            try:
                problem = self._destroy(item)
            except BaseException as exc:  # never lose the thread: later guests still need it
                problem = f"{type(exc).__name__}: {exc}"
            if problem is not None:
                self.failures.append((self._describe(item), problem))
            self._queue.task_done()

    def drain(self) -> None:
        """Wait until everything handed off so far is destroyed (each destroy is time-bounded)."""
        self._queue.join()

    def take_failures(self) -> list[tuple[str, str]]:
        taken, self.failures = self.failures, []
        return taken


class _Order(Generic[T]):
    """One item to make ahead: made by the Ahead's thread, waited for by whoever takes it."""

    def __init__(self, make: Callable[[], T]) -> None:
        self.make = make
        self.made: T | None = None
        self.done = threading.Event()

    def fulfil(self) -> None:
        try:
            self.made = self.make()
        except BaseException:
            pass
        finally:
            self.done.set()

    def result(self) -> T | None:
        self.done.wait()
        made, self.made = self.made, None
        return made


class Ahead(Generic[T]):
    """Up to ``depth`` items made ahead at once in background threads, all for one key.

    ``take(key)`` returns the oldest item if it was made for ``key`` (waiting for it to finish),
    else None; items for another key, or one that failed, go to ``discard``. ``make``
    failures are not reported here: the caller makes the item itself, and meets them then.
    ``depth`` threads that live as long as the process, not one thread per item: a thread's
    start and exit per test is work the tests would wait for.
    """

    def __init__(self, discard: Callable[[T], None], depth: int = 1) -> None:
        self._discard = discard
        self.depth = depth
        self._key: Hashable | None = None
        self._orders: list[_Order[T]] = []  # oldest first; taken or cancelled only by the caller's thread
        self._queue: queue.Queue[_Order[T]] = queue.Queue()
        self._threads: list[threading.Thread] = []

    def start(self, key: Hashable, make: Callable[[], T]) -> None:
        """Order items for ``key`` until ``depth`` are made or in the making."""
        if key != self._key:
            self.cancel()
            self._key = key
        while len(self._threads) < self.depth:
            thread = threading.Thread(target=self._work, name="smolvm-ahead", daemon=True)
            thread.start()
            self._threads.append(thread)
        while len(self._orders) < self.depth:
            order = _Order(make)
            self._orders.append(order)
            self._queue.put(order)

    def _work(self) -> None:
        while True:
            self._queue.get().fulfil()

    def take(self, key: Hashable) -> T | None:
        if not self._orders:
            return None
        if key != self._key:
            self.cancel()
            return None
        return self._orders.pop(0).result()

    def cancel(self) -> None:
        """Wait for the items ordered, if any, and discard them."""
        orders, self._orders = self._orders, []
        for order in orders:
            made = order.result()
            if made is not None:
                self._discard(made)


class Bounded:
    """Runs calls one at a time, each within a time bound, on a daemon thread kept between calls.

    A thread because a call the engine never answers (a hung destroy) must not hold its caller,
    and the signals it defers, forever: past the bound the call is left to its thread. A kept
    one because starting a thread per call costs CPU once per guest (docs/performance.md). A thread
    left with a call past its bound is never given another: the next call starts a new one.
    One per calling thread: a call never waits behind another thread's.
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._jobs: queue.SimpleQueue[_Job | None] | None = None

    def run(self, call: Callable[[], T], timeout: float) -> tuple[bool, T | None]:
        """``(True, call())`` if it returned within ``timeout`` seconds, else ``(False, None)``;
        what it raised within the bound is raised here."""
        if self._jobs is None:
            jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
            threading.Thread(target=_serve, args=(jobs,), name=self._name, daemon=True).start()
            self._jobs = jobs
        job = _Job(call)
        self._jobs.put(job)
        if not job.done.wait(timeout):
            self._jobs.put(None)  # the stuck thread ends once its call returns, if ever
            self._jobs = None
            return False, None
        if job.error is not None:
            raise job.error
        return True, job.result


class _Job:
    def __init__(self, call: Callable[[], Any]) -> None:
        self.call = call
        self.result: Any = None
        self.error: BaseException | None = None
        self.done = threading.Event()


def _serve(jobs: queue.SimpleQueue[_Job | None]) -> None:
    while (job := jobs.get()) is not None:
        try:
            job.result = job.call()
        except BaseException as exc:  # the caller's to handle; this thread serves the next call
            job.error = exc
        finally:
            job.done.set()
