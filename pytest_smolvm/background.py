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
from typing import Generic, TypeVar

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


class Ahead(Generic[T]):
    """At most one item made ahead in a background thread, for the key it was made for.

    ``take(key)`` returns the made item if it was made for ``key`` (waiting for it to finish),
    else None; an item for another key, or one that failed, goes to ``discard``. ``make``
    failures are not reported here: the caller makes the item itself, and meets them then.
    """

    def __init__(self, discard: Callable[[T], None]) -> None:
        self._discard = discard
        self._key: Hashable | None = None
        self._done = threading.Event()
        self._made: T | None = None
        self._thread: threading.Thread | None = None

    def start(self, key: Hashable, make: Callable[[], T]) -> None:
        if self._thread is not None:
            return  # one at a time: the one in flight is taken or discarded first
        self._key, self._made = key, None
        self._done.clear()

        def run() -> None:
            try:
                self._made = make()
            except BaseException:
                pass
            finally:
                self._done.set()

        self._thread = threading.Thread(target=run, name="smolvm-ahead", daemon=True)
        self._thread.start()

    def take(self, key: Hashable) -> T | None:
        if self._thread is None:
            return None
        self._done.wait()
        self._thread = None
        made, self._made = self._made, None
        if made is not None and key != self._key:
            self._discard(made)
            return None
        return made

    def cancel(self) -> None:
        """Wait for the one in flight, if any, and discard it."""
        if self._thread is None:
            return
        self._done.wait()
        self._thread = None
        made, self._made = self._made, None
        if made is not None:
            self._discard(made)
