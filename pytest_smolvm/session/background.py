"""The GuestPool's work off the test's path: destroys handed off, creates shielded from
interrupts, destroy attempts within a bound. (Guests made ahead of their tests are
session/ahead.py's, the one place that lives.) All of it runs on host/threads.py's
:class:`~pytest_smolvm.host.threads.Workers` (the one worker primitive: its guarantees are
written there); this module only says what each piece of work is.

Handed-off destroys exist for speed (docs/performance.md): a test's teardown need not wait for
its guest to die. All are threads of the pytest process that owns the guests, so none can
outlive it: the pool drains them before it closes, and a crash leaves only what the reaper handles.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from pytest_smolvm.host.threads import Job, Workers

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
        self._workers = Workers("smolvm-teardown", limit=threads)
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._pending: list[T] = []  # handed off, not yet destroyed (oldest first)
        self.failures: list[tuple[str, str]] = []  # (what, problem)

    def submit(self, item: T) -> None:
        with self._lock:
            self._pending.append(item)

        def done(job: Job[str | None]) -> None:
            problem = f"{type(job.error).__name__}: {job.error}" if job.error is not None else job.result
            with self._idle:
                if problem is not None:
                    self.failures.append((self._describe(item), problem))
                self._pending.remove(item)
                self._idle.notify_all()

        self._workers.start(lambda: self._destroy(item), done)

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


class Bounded:
    """Runs calls, each within a time bound, on kept threads (host/threads.py).

    A thread because a call the engine never answers (a hung destroy) must not hold its caller,
    and the signals it defers, forever: past the bound the call is left to its thread, which is
    never given another; the next call gets an idle thread or a new one. Kept threads because
    starting a thread per call costs CPU once per guest (docs/performance.md).
    """

    def __init__(self, name: str) -> None:
        self._workers = Workers(name)

    def run(self, call: Callable[[], T], timeout: float) -> tuple[bool, T | None]:
        """``(True, call())`` if it returned within ``timeout`` seconds, else ``(False, None)``;
        what it raised within the bound is raised here."""
        return self._workers.run(call, timeout)


class Shielded:
    """Runs a call the caller must not abandon halfway, on a kept thread the signals never reach.

    A guest create interrupted in the main thread (Ctrl-C, pytest-timeout's SIGALRM) would be
    cut off while the backend answers: the guest made but known to nobody. Here the call
    goes on in its own thread; the interrupt still reaches the caller at once, and whatever
    the call returns or raises later goes to ``late``, in that thread. :meth:`wait` bounds
    how long an ending process waits for such calls.
    """

    def __init__(self, name: str) -> None:
        self._workers = Workers(name)
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._abandoned = 0  # calls whose caller was interrupted, still running

    def run(self, call: Callable[[], T], late: Callable[[T | None, BaseException | None], None]) -> T:
        def counted(result: T | None, error: BaseException | None) -> None:
            try:
                late(result, error)
            finally:
                with self._idle:
                    self._abandoned -= 1
                    self._idle.notify_all()

        job = self._workers.start(call)
        try:
            job.wait()
        except BaseException:
            with self._lock:
                self._abandoned += 1
            if not job.abandon(counted):  # it ended as the interrupt came: nobody else will hand it on
                counted(job.result, job.error)
            raise
        return job.outcome()

    def wait(self, timeout: float) -> bool:
        """Wait, at most ``timeout`` seconds, for interrupted calls to end; False if some did not."""
        deadline = time.monotonic() + timeout
        with self._idle:
            while self._abandoned and (left := deadline - time.monotonic()) > 0:
                self._idle.wait(left)
            return not self._abandoned


_attempts = Workers("smolvm-attempts")  # attempts_within's threads: a stuck destroy keeps its own


def attempts_within(action: Any, attempts: int, timeout: float) -> str | None:
    """Run ``action`` up to ``attempts`` times within ``timeout`` seconds; None or the last error.

    It runs on a kept thread: a delete the engine never answers must not hold the test process
    (and its blocked signals) forever. Past the bound the guest is left to the reaper.
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

    finished, error = _attempts.run(attempt_all, timeout)
    return error if finished else f"destroy did not finish within {timeout:g}s"
