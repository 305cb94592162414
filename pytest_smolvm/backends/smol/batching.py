"""Concurrent branches of one source coalesced into ``branch_batch`` calls.

With ``--smol-concurrency`` a worker asks for many guests at once, each a branch of the same warm
source. On smol cloud each branch is a control-plane round trip that queues per source; the SDK's
``Machine.branch_batch(names=[...])`` makes them in one transactional call (every child or none;
the SDK itself falls back from ``/branches/batch`` to ``/fork-batch`` on an older control plane).
This module is modelled on the SDK's own coalescer (``smol/harbor.py``, ``_ForkBatcher``): one
call in flight per source; requests that arrive while it is under way gather into the next batch,
made as soon as that call returns (or a full batch, ``MAX_BATCH``, is waiting). The control
plane queues branches per source anyway (``transport.py``: "Waits out the control plane's
per-source branch queue"), so a second call in flight would only wait in that queue; gathering
instead turns the queue into fewer, larger batches. A first request that finds nothing under way
waits a short window only if another branch of that source is under way (a fallback branch);
a lone request (a serial run) waits for nothing. Under ``--smol-concurrency`` the tests' creates
arrive one per item handed over (milliseconds apart, more than the window): the window alone
batched a third of them (1,000 cloud episodes: 437 branch calls and 228 batches).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

WINDOW_SECONDS = 0.005  # what a request may wait for others: a fraction of a branch's round trip
MAX_BATCH = 32  # the SDK's Harbor default; the control plane's batches are transactional


class _Batch:
    def __init__(self) -> None:
        self.names: list[str] = []
        self.full = threading.Event()
        self.done = threading.Event()
        self.children: dict[str, Any] = {}
        self.error: Exception | None = None  # a batch of one: what its plain branch raised
        self.failed = False


class BranchBatcher:
    """One per backend: batches per source, keyed by the source's name."""

    def __init__(self, window: float = WINDOW_SECONDS, max_size: int = MAX_BATCH) -> None:
        self.window = window
        self.max_size = max_size
        self._open: dict[str, _Batch] = {}
        self._lock = threading.Lock()
        self._busy: dict[str, int] = {}  # fallback branch calls under way, per source
        self._turns: dict[str, threading.Lock] = {}  # held by the one batch call in flight, per source
        self.calls = 0  # branch and branch_batch calls made (for tests and benchmarks)

    def branch(self, source: str, machine: Any, name: str, delete: Callable[[Any], None],
               sweep: Callable[[list[str]], None]) -> Any:
        """``machine.branch(name)``, made together with other threads' branches of ``source``.

        ``delete(child)`` removes a child nobody asked for; ``sweep(names)`` removes whichever
        machines of those names exist (after a failed batch call)."""
        with self._lock:
            batch = self._open.get(source)
            leader = batch is None
            if batch is None:
                batch = self._open[source] = _Batch()
            batch.names.append(name)
            turn = self._turns.setdefault(source, threading.Lock())
            if len(batch.names) >= self.max_size:
                del self._open[source]  # full: later requests open another
                batch.full.set()
        if leader:
            if not turn.acquire(blocking=False):
                turn.acquire()  # a call is under way: the batch gathers until it returns
            elif self._busy.get(source, 0) > 0:
                batch.full.wait(self.window)  # branches under way outside a batch: others may come
            try:
                with self._lock:
                    if self._open.get(source) is batch:
                        del self._open[source]
                self._make(batch, machine, delete, sweep)
            finally:
                turn.release()
        else:
            batch.done.wait()
        child = batch.children.pop(name, None)
        if child is not None:
            return child
        if batch.error is not None:
            raise batch.error
        with self._lock:  # the batch failed: this request makes its own branch
            self.calls += 1
            self._busy[source] = self._busy.get(source, 0) + 1
        try:
            return machine.branch(name)
        finally:
            with self._lock:
                self._busy[source] -= 1

    def _make(self, batch: _Batch, machine: Any, delete: Callable[[Any], None],
              sweep: Callable[[list[str]], None]) -> None:
        names = list(batch.names)
        try:
            if len(names) == 1:  # a batch of one is a plain branch: no batch route needed
                with self._lock:
                    self.calls += 1
                try:
                    batch.children = {names[0]: machine.branch(names[0])}
                except Exception as exc:
                    batch.error = exc
            else:
                with self._lock:
                    self.calls += 1
                children = machine.branch_batch(names=names)
                by_name = {str(getattr(child, "name", "")): child for child in children}
                if sorted(by_name) != sorted(names):
                    for child in children:  # not what was asked for: nobody may own them
                        delete(child)
                else:
                    batch.children = by_name
        except Exception:
            # The call may have made the children before it failed (an answer lost on the way
            # back, a readiness wait that broke): each request falls back to its own branch of
            # the same name, which would then be taken. What exists of them goes first.
            try:
                sweep(names)
            except Exception:
                pass  # then a fallback meets "name taken" and reports that as its own error
            batch.failed = True  # each request falls back to its own branch (and its own error)
        finally:
            batch.done.set()
