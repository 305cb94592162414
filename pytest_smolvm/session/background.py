"""The GuestPool's work off the test's path: destroys handed off, and a guest made ahead.

Both exist for speed (docs/performance.md): a test's teardown need not wait for its guest to
die, and where a core is idle the next test's guest can be made while this test runs. Both
are threads of the pytest process that owns the guests, so neither can outlive it: the pool
drains them before it closes, and a crash leaves only what the reaper already handles.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Hashable
from typing import Any, Generic, TypeVar

from pytest_smolvm.host.signals import start_thread

T = TypeVar("T")


TEARDOWN_THREADS = 16  # destroys at once, at most; more threads start only while destroys queue up


class Teardown(Generic[T]):
    """Runs ``destroy`` on handed-off items in background threads, started in hand-off order.

    One thread while destroys keep up (a serial run); another starts, up to ``threads``, each
    time an item is handed off with every thread busy. Under ``--smol-concurrency`` a worker
    ends up to N tests at once, and one thread destroying them one by one fell behind: the
    guests waiting for it stayed alive, held their admission slots, and were still being
    destroyed at session end (1,000 cloud episodes: 7 s of drain, benchmarks/cloud_concurrency.py).

    ``destroy`` returns None or the problem met; problems wait in :attr:`failures` until the
    pool reports them (as warnings, on the main thread).
    """

    def __init__(self, destroy: Callable[[T], str | None], describe: Callable[[T], str],
                 threads: int = TEARDOWN_THREADS) -> None:
        self._destroy = destroy
        self._describe = describe
        self._queue: queue.SimpleQueue[T] = queue.SimpleQueue()
        self._threads = 0
        self._max_threads = max(1, threads)
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._pending: list[T] = []  # handed off, not yet destroyed (oldest first)
        self.failures: list[tuple[str, str]] = []  # (what, problem)

    def submit(self, item: T) -> None:
        with self._lock:
            self._pending.append(item)
            if self._threads < min(len(self._pending), self._max_threads):
                self._threads += 1  # every thread is busy with an earlier item: one more
                start_thread(self._work, name="smolvm-teardown")
        self._queue.put(item)

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            try:
                problem = self._destroy(item)
            except BaseException as exc:  # never lose the thread: later guests still need it
                problem = f"{type(exc).__name__}: {exc}"
            with self._idle:
                if problem is not None:
                    self.failures.append((self._describe(item), problem))
                self._pending.remove(item)
                self._idle.notify_all()

    def drain(self, timeout: float) -> list[T]:
        """Wait, at most ``timeout`` seconds, until everything handed off so far is destroyed;
        returns what is still waiting (left to the reaper: the records stay)."""
        deadline = time.monotonic() + timeout
        with self._idle:
            while self._pending and (left := deadline - time.monotonic()) > 0:
                self._idle.wait(left)
            return list(self._pending)

    def take_failures(self) -> list[tuple[str, str]]:
        with self._lock:
            taken, self.failures = self.failures, []
        return taken


class _Order(Generic[T]):
    """One item to make ahead: made by the Ahead's thread, waited for by whoever takes it.

    An order nobody waits for any more (:meth:`abandon`) is discarded by the thread that
    makes it, when it is made: a create that overran a bound is still destroyed.
    """

    def __init__(self, make: Callable[[], T], discard: Callable[[T], None]) -> None:
        self.make = make
        self.discard = discard
        self.made: T | None = None
        self.done = threading.Event()
        self._lock = threading.Lock()
        self._abandoned = False

    def fulfil(self) -> None:
        try:
            made = self.make()
        except BaseException:
            made = None
        with self._lock:
            abandoned, self.made = self._abandoned, made
            self.done.set()
        if abandoned and made is not None:
            self.discard(made)

    def result(self, timeout: float | None = None) -> T | None:
        """The item made (None if its making failed); None too past ``timeout``, and then
        the order is abandoned: its item is discarded when it is made."""
        self.done.wait(timeout)
        with self._lock:
            if not self.done.is_set():
                self._abandoned = True
                return None
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
            self._threads.append(start_thread(self._work, name="smolvm-ahead"))
        while len(self._orders) < self.depth:
            order = _Order(make, self._discard)
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

    def cancel(self, timeout: float | None = None) -> None:
        """Wait for the items ordered, if any, and discard them; past ``timeout`` seconds (all
        of them together) an item still in the making is discarded by its thread once made."""
        orders, self._orders = self._orders, []
        deadline = None if timeout is None else time.monotonic() + timeout
        for order in orders:
            made = order.result(None if deadline is None else max(0.0, deadline - time.monotonic()))
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
            start_thread(_serve, name=self._name, args=(jobs,))
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
        self.late: Callable[[Any, BaseException | None], None] | None = None  # Shielded: caller gone
        self.finish: Callable[[_Job], None] | None = None
        self.lock = threading.Lock()  # done and finish change together


def _serve(jobs: queue.SimpleQueue[_Job | None]) -> None:
    while (job := jobs.get()) is not None:
        try:
            job.result = job.call()
        except BaseException as exc:  # the caller's to handle; this thread serves the next call
            job.error = exc
        with job.lock:
            job.done.set()
            finish = job.finish
        if finish is not None:
            try:
                finish(job)
            except BaseException:  # late's own errors are its to report; this thread serves on
                pass


class Shielded:
    """Runs a call the caller must not abandon halfway, on a kept thread the signals never reach.

    A guest create interrupted in the main thread (Ctrl-C, pytest-timeout's SIGALRM) would be
    cut off while the backend answers: the guest made but known to nobody. Here the call
    goes on in its own thread; the interrupt still reaches the caller at once, and whatever
    the call returns or raises later goes to ``late``, in that thread. :meth:`wait` bounds
    how long an ending process waits for such calls.
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._jobs: queue.SimpleQueue[_Job | None] | None = None
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._abandoned = 0  # calls whose caller was interrupted, still running

    def run(self, call: Callable[[], T], late: Callable[[T | None, BaseException | None], None]) -> T:
        if self._jobs is None:
            self._jobs = queue.SimpleQueue()
            start_thread(_serve, name=self._name, args=(self._jobs,))
        job = _Job(call)
        self._jobs.put(job)
        try:
            job.done.wait()
        except BaseException:
            with job.lock:
                job.late = late
                finished = job.done.is_set()
                if not finished:
                    with self._lock:
                        self._abandoned += 1
                    job.finish = self._finished
            if finished:  # it ended as the interrupt came: nobody else will hand it on
                late(job.result, job.error)
            raise
        if job.error is not None:
            raise job.error
        result: T = job.result
        return result

    def _finished(self, job: _Job) -> None:
        try:
            assert job.late is not None
            job.late(job.result, job.error)
        finally:
            with self._idle:
                self._abandoned -= 1
                self._idle.notify_all()

    def wait(self, timeout: float) -> bool:
        """Wait, at most ``timeout`` seconds, for interrupted calls to end; False if some did not."""
        deadline = time.monotonic() + timeout
        with self._idle:
            while self._abandoned and (left := deadline - time.monotonic()) > 0:
                self._idle.wait(left)
            return not self._abandoned


_attempt_runners = threading.local()  # each thread's background.Bounded for attempts_within


def attempts_within(action: Any, attempts: int, timeout: float) -> str | None:
    """Run ``action`` up to ``attempts`` times within ``timeout`` seconds; None or the last error.

    It runs on a daemon thread (background.Bounded): a delete the engine never answers must not
    hold the test process (and its blocked signals) forever. Past the bound the guest is left
    to the reaper.
    """

    def attempt_all() -> str | None:
        error: str | None = None
        for _ in range(attempts):
            try:
                action()
                return None
            except Exception as exc:  # a failed destroy must never replace the test's outcome
                error = f"{type(exc).__name__}: {exc}"
        return error

    runner = getattr(_attempt_runners, "runner", None)
    if runner is None:
        runner = _attempt_runners.runner = Bounded("smolvm-attempts")
    finished, error = runner.run(attempt_all, timeout)
    return error if finished else f"destroy did not finish within {timeout:g}s"
