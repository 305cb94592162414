"""Kept threads for blocking calls made from an event loop, none of them taking the process's signals.

``smol_vm.aio`` runs each blocking guest call on a thread so that the loop never blocks, and
the concurrent runner makes each test's guest on one (plugin/premade.py). Starting a thread
per call made the loop's thread wait for the new thread to first run (``Thread.start`` waits
for it), a GIL hand-off that under ``--smol-concurrency`` (hundreds of threads busy in guest
calls, two cores) cost milliseconds per call on the one thread every test in flight shares.
Here a call goes to an idle kept thread when there is one, and starts one only when none is
idle; a thread idle for ``IDLE_SECONDS`` ends. A call that never returns keeps its thread,
exactly as a thread of its own would have been kept.

A call may return a second step, run after its thread counts itself idle again: the hand-back
of a result to the caller. Handed back first, the caller's next call could come before the
thread was idle and start another thread (up to 7 for 10 calls one after another, on a loaded
host); handed back after, calls one after another share one thread.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

from pytest_smolvm.host.signals import start_thread

# A call, and what it returns: the step to run once its thread is idle again, or None.
Call = Callable[[], Callable[[], None] | None]

IDLE_SECONDS = 30.0


class KeptThreads:
    """Runs each submitted call on an idle kept thread, or a new one if none is idle."""

    def __init__(self, name: str, idle_seconds: float = IDLE_SECONDS) -> None:
        self._name = name
        self._idle_seconds = idle_seconds
        self._jobs: queue.SimpleQueue[Call] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0  # threads waiting for a job and not yet promised one

    def submit(self, call: Call) -> None:
        """Run ``call()`` soon on another thread, then the step it returns, if any; what either
        raises is its own to report."""
        with self._lock:
            # The job is queued under the lock that promises it an idle thread: a thread whose
            # wait times out checks, under the same lock, that no job was promised to it.
            if self._idle:
                self._idle -= 1
            else:
                start_thread(self._work, name=self._name)
            self._jobs.put(call)

    def _work(self) -> None:
        while True:
            try:
                call = self._jobs.get(timeout=self._idle_seconds)
            except queue.Empty:
                with self._lock:
                    if self._jobs.empty():
                        self._idle -= 1
                        return
                continue  # a job was promised to an idle thread as this one timed out: take it
            then = None
            try:
                then = call()
            except BaseException:  # the call's own business; this thread serves the next
                pass
            with self._lock:
                self._idle += 1
            if then is not None:
                try:
                    then()
                except BaseException:
                    pass
