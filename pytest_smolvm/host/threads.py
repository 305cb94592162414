"""The one worker primitive: :class:`Workers`, kept threads for blocking calls (trio's thread
cache is the model). Every thread the plugin runs work on comes from here: the async handle's
calls (handle/aio.py), the pool's destroys, shielded creates and bounded destroy attempts
(session/background.py), guests made ahead of their tests (session/ahead.py).

What it guarantees, for every call:

- **Bounded threads.** At most ``limit`` threads per :class:`Workers`; a call past it waits,
  in order, for one to be free (it is never refused).
- **Kept threads.** A call goes to an idle thread when there is one and starts one only when
  none is: starting a thread per call made the caller wait for the new thread to first run, a
  GIL hand-off that under ``--smol-concurrency`` (hundreds of calls, two cores) cost
  milliseconds per call on the one loop thread every test shares. A thread idle for
  ``idle_seconds`` ends.
- **No signals.** Every thread it starts blocks SIGINT/SIGTERM/SIGHUP (host/signals.py): the
  kernel hands them to the main thread, whose deferral (signals_deferred) sees them.
- **Every wait bounded.** :meth:`Job.wait` and :meth:`Workers.drain` take a timeout; a call
  that never returns keeps its thread (as a thread of its own would have been kept) and is
  never given another call.
- **Cancellation cleans up.** A caller that stops waiting (its timeout, Ctrl-C, a cancelled
  task) hands the call :meth:`Job.abandon` a ``late(result, error)``: whatever the call makes
  after its caller left goes there, on the worker thread (a guest made for a cancelled create
  is destroyed, never left running unowned).
- **Idle before done.** A call's thread counts itself idle *before* the caller hears the
  result (``done`` callbacks, :meth:`Job.wait`): the caller's next call finds that thread idle
  and reuses it, so calls one after another share one thread, however loaded the host.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from pytest_smolvm.host.signals import start_thread

T = TypeVar("T")
Late = Callable[[Any, BaseException | None], None]  # (what the call returned, what it raised)

IDLE_SECONDS = 30.0
MAX_THREADS = 1024  # per Workers, unless it says fewer: far past any --smol-concurrency in use


class Job(Generic[T]):
    """One call handed to :class:`Workers`: its outcome, once done."""

    def __init__(self, call: Callable[[], T], done: Callable[[Job[T]], None] | None) -> None:
        self._call = call
        self._done_callback = done
        self.result: T | None = None
        self.error: BaseException | None = None
        self._done = threading.Event()
        self._lock = threading.Lock()  # done and late change together
        self._late: Late | None = None

    def wait(self, timeout: float | None = None) -> bool:
        """Whether the call has ended, waiting up to ``timeout`` seconds for it."""
        return self._done.wait(timeout)

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def outcome(self) -> T:
        """What the call returned; what it raised is raised here. Only once :meth:`wait` said so."""
        if self.error is not None:
            raise self.error
        return self.result  # type: ignore[return-value]

    def abandon(self, late: Late) -> bool:
        """The caller stops waiting: ``late(result, error)`` runs on the worker once the call
        ends. False if it has ended already: the outcome is the caller's to handle after all."""
        with self._lock:
            if self._done.is_set():
                return False
            self._late = late
            return True

    def _run(self) -> None:
        try:
            self.result = self._call()
        except BaseException as exc:  # the caller's (or late's) to handle; the thread serves on
            self.error = exc

    def _finish(self) -> None:
        with self._lock:
            self._done.set()
            late = self._late
        try:
            if late is not None:
                late(self.result, self.error)
        except BaseException:  # its own errors are its to report; this thread serves on
            pass
        try:
            if self._done_callback is not None:
                self._done_callback(self)
        except BaseException:
            pass


class Workers:
    """Kept threads named ``name`` running calls; see the module docstring for the guarantees."""

    def __init__(self, name: str, *, limit: int = MAX_THREADS, idle_seconds: float = IDLE_SECONDS) -> None:
        self.name = name
        self._limit = max(1, limit)
        self._idle_seconds = idle_seconds
        self._lock = threading.Lock()
        self._settled = threading.Condition(self._lock)
        self._threads = 0
        # An idle thread waits on its own hand-off queue (trio's thread cache): a job goes to
        # one thread, named, and a thread that times out knows, under the lock, whether a job
        # was handed to it meanwhile. The last to go idle is the first reused (its stack warm).
        self._idle: list[queue.SimpleQueue[Job[Any]]] = []
        self._backlog: collections.deque[Job[Any]] = collections.deque()  # past the limit, in order
        self._running = 0  # jobs handed in and not yet finished

    def start(self, call: Callable[[], T], done: Callable[[Job[T]], None] | None = None) -> Job[T]:
        """Run ``call()`` on a kept thread; ``done(job)`` runs there after it, the thread idle again."""
        job = Job(call, done)
        with self._lock:
            self._running += 1
            if self._idle:
                self._idle.pop().put(job)
            elif self._threads < self._limit:
                self._threads += 1
                start_thread(self._work, name=self.name, args=(job,))
            else:
                self._backlog.append(job)
        return job

    def run(self, call: Callable[[], T], timeout: float | None = None,
            late: Late | None = None) -> tuple[bool, T | None]:
        """``(True, call())`` if it ended within ``timeout`` (what it raised is raised here),
        else ``(False, None)``: the call is abandoned to ``late`` (or dropped) on its thread.
        An interrupt of the wait (Ctrl-C) abandons it the same way, then goes on."""
        job = self.start(call)
        try:
            ended = job.wait(timeout)
        except BaseException:
            if not job.abandon(late or _drop) and late is not None:
                late(job.result, job.error)  # it ended as the interrupt came: nobody else will
            raise
        if not ended and job.abandon(late or _drop):
            return False, None
        return True, job.outcome()

    def submit(self, call: Callable[[], Callable[[], None] | None]) -> None:
        """Run ``call()``, then the step it returns, if any, once its thread is idle again (the
        hand-back of a result: handed back first, the caller's next call could come before the
        thread was idle and start another). What either raises is its own to report."""
        self.start(call, lambda job: job.result() if job.result is not None else None)

    def drain(self, timeout: float) -> bool:
        """Wait, at most ``timeout`` seconds, until every call handed in so far has ended."""
        deadline = time.monotonic() + timeout
        with self._settled:
            while self._running and (left := deadline - time.monotonic()) > 0:
                self._settled.wait(left)
            return not self._running

    def _work(self, job: Job[Any]) -> None:
        mine: queue.SimpleQueue[Job[Any]] = queue.SimpleQueue()
        while True:
            job._run()
            with self._lock:
                following = self._backlog.popleft() if self._backlog else None
                if following is None:
                    self._idle.append(mine)
            job._finish()
            with self._settled:
                self._running -= 1
                self._settled.notify_all()
            if following is None:
                try:
                    following = mine.get(timeout=self._idle_seconds)
                except queue.Empty:
                    with self._lock:
                        if mine in self._idle:  # nothing was handed to it: it ends
                            self._idle.remove(mine)
                            self._threads -= 1
                            return
                    following = mine.get()  # handed a job as it timed out: it is there already
            job = following


def _drop(_result: object, _error: BaseException | None) -> None:
    """What an abandoned call without a ``late`` made: nothing to clean up."""
