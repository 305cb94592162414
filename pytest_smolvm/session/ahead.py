"""Guests made ahead of the test that will take them: the one place this concern lives.

One keyed store (:class:`Ahead`) of guests being made, or made, for a future taker, one policy
(:class:`Pace`) saying how many, one cancellation path, all on host/threads.py's
:class:`~pytest_smolvm.host.threads.Workers`. Two callers use it:

- **The pool's next guests** (session/pool.py, every path): where making ahead costs the run
  nothing (:meth:`Pace.decide`), a test's create orders the next guests for whoever asks next
  with the same baseline and spec (orders without a taker, keyed by digest and spec); the next
  create takes the oldest.
- **A queued test's own guest** (``--smol-concurrency``; plugin/premade.py is only the pytest
  glue: which item, its spec, its waiting notes): the concurrent runner orders a test's guest
  for that test (a named taker) before its setup, as many tests ahead of the N slots as
  :meth:`Pace.beyond` says; the test's ``smol_vm`` factory takes it. Such an order is made by
  the pool's create, which takes a next-guest order of its key where there is one: the two
  kinds meet only here, in one store.

An order nobody will take (another key asked for, its taker gone or cancelled, the pool closing:
:meth:`Ahead.cancel`, :meth:`Ahead.cancel_all`) is discarded: its guest is destroyed now, or
by the thread making it the moment it exists. A taker whose wait is cut short (Ctrl-C, a test
timeout) discards its order the same way. Safe from many threads at once: the orders change
only under a lock, and no wait is made holding it (a close that cancels never waits behind a
take's create).
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

from pytest_smolvm.host.threads import Job, Workers

T = TypeVar("T")

AHEAD_DEPTH = 2  # next guests made at once where there are this many cores per worker


class Pace:
    """How many guests to make ahead, for both callers of :class:`Ahead`.

    The pool's next guests (:meth:`next_guests`): only where it costs the run nothing — the
    backend's idle guests are free (a namespace guest's are, a smol machine is billed), no
    ``--smol-max-vms`` cap counts them, and every pytest process has a core of its own beside
    one more (else they only compete with the tests) — two at once with two cores per process
    (docs/performance.md: two made ahead beat making each in turn, 0.6-0.8x of the bare loop).

    A queued test's guest (:meth:`beyond`): as many tests ahead of the N slots as slots free
    while one guest is made. Little's law: slots free at N / (time a test holds one), and a
    guest takes its make time to be ready, so that many made ahead keep every freed slot busy
    at once, and no more wait idle (billed on smol cloud, holding memory everywhere). Both
    times are moving averages of the run; nothing is made ahead so until one of each is known.
    """

    WEIGHT = 0.2  # of the newest measurement

    def __init__(self) -> None:
        self.free: bool | None = None  # making the next guests costs nothing: decided once
        self.depth = 1  # the next guests made at once, where free
        self.making: float | None = None  # seconds from ordering a test's guest to having it
        self.holding: float | None = None  # seconds a test holds its slot (setup to teardown)

    def decide(self, backend: object, *, capped: bool, workers: int) -> bool:
        """The rule for the next guests, once: ``backend``'s class says whether its idle guests
        are free (``idle_guests_are_free``), ``capped`` whether ``--smol-max-vms`` counts them."""
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        self.free = bool(getattr(backend, "idle_guests_are_free", False)) and not capped and cores >= max(2, workers)
        self.depth = AHEAD_DEPTH if cores >= AHEAD_DEPTH * workers else 1
        return self.free

    def next_guests(self) -> int:
        return self.depth if self.free else 0

    @classmethod
    def _average(cls, old: float | None, new: float) -> float:
        return new if old is None else old + cls.WEIGHT * (new - old)

    def made(self, seconds: float) -> None:
        self.making = self._average(self.making, seconds)

    def held(self, seconds: float) -> None:
        self.holding = self._average(self.holding, seconds)

    def beyond(self, limit: int) -> int:
        if self.making is None or not self.holding:
            return 0
        return min(limit, math.ceil(limit * self.making / self.holding))


class Order(Generic[T]):
    """One item being made (or made) for ``taker`` (None: whoever asks next with ``key``)."""

    def __init__(self, key: Hashable, taker: Hashable | None, discard: Callable[[T], None]) -> None:
        self.key = key
        self.taker = taker
        self._discard = discard
        self._cancelled = False
        self._lock = threading.Lock()
        self.job: Job[T]  # set by Ahead.order, before anyone else sees the order

    def outcome(self) -> T:
        """The item once made (what its making raised is raised here). A wait cut short (Ctrl-C,
        a test's timeout) cancels the order: the item is discarded the moment it exists."""
        try:
            self.job.wait()
        except BaseException:
            self.cancel()
            raise
        return self.job.outcome()

    def made(self) -> T | None:
        """The item once made, or None if its making failed (the caller makes its own)."""
        try:
            return self.outcome()
        except Exception:
            return None

    def cancel(self, timeout: float | None = 0.0) -> None:
        """Nobody takes it: discard it now (waiting up to ``timeout`` for it to be made), or the
        moment it exists, on its own thread. Once per order, however many paths cancel it."""
        with self._lock:
            if self._cancelled:
                return
            self._cancelled = True
        if not self.job.wait(timeout) and self.job.abandon(self._late):
            return  # still in the making: its thread discards it once made
        if self.job.error is None and self.job.result is not None:
            self._discard(self.job.result)

    def _late(self, made: T | None, _error: BaseException | None) -> None:
        if made is not None:
            self._discard(made)


class Ahead(Generic[T]):
    """The store: items ordered ahead, each for a taker or for the next with its key."""

    def __init__(self, discard: Callable[[T], None], pace: Pace | None = None) -> None:
        self._discard = discard
        self.pace = pace if pace is not None else Pace()
        self._orders: list[Order[T]] = []  # oldest first
        self._lock = threading.Lock()
        self._workers = Workers("smolvm-ahead")

    def order(self, key: Hashable, make: Callable[[], T], taker: Hashable | None = None,
              ready: Callable[[], None] | None = None) -> Order[T]:
        """Start making an item for ``taker`` (or the next :meth:`take` of ``key``); ``ready()``
        runs on the making thread once it is made or failed. A named order's make time is
        measured for :attr:`pace`."""
        asked = time.monotonic()

        def done(job: Job[T]) -> None:
            if taker is not None and job.error is None:
                self.pace.made(time.monotonic() - asked)
            if ready is not None:
                ready()

        with self._lock:
            return self._start(key, make, taker, done)

    def _start(self, key: Hashable, make: Callable[[], T], taker: Hashable | None,
               done: Callable[[Job[T]], None] | None) -> Order[T]:
        order: Order[T] = Order(key, taker, self._discard)  # under the lock: nobody sees it unstarted
        order.job = self._workers.start(make, done)
        self._orders.append(order)
        return order

    def top_up(self, key: Hashable, make: Callable[[], T], depth: int | None = None) -> None:
        """Order items for the next takers of ``key`` until ``depth`` (the pace's
        :meth:`Pace.next_guests`) are made or in the making; those for another key are cancelled."""
        depth = self.pace.next_guests() if depth is None else depth
        with self._lock:
            stale = [o for o in self._orders if o.taker is None and o.key != key]
            self._orders = [o for o in self._orders if o not in stale]
        self._dispose(stale, None)  # first: the new ones would queue behind them on one engine
        with self._lock:
            mine = [o for o in self._orders if o.taker is None]
            if all(o.key == key for o in mine):  # (else another key's top-up came meanwhile: it wins)
                for _ in range(depth - len(mine)):
                    self._start(key, make, None, None)

    def take(self, key: Hashable, taker: Hashable | None = None) -> Order[T] | None:
        """``taker``'s order, or (no taker) the oldest order for the next taker of ``key``: out
        of the store, the caller's to wait for (:meth:`Order.outcome`). None where there is none;
        an order that does not fit (``taker``'s made for another key; without a taker, those
        made for another key) is cancelled."""
        with self._lock:
            if taker is None:
                stale = [o for o in self._orders if o.taker is None and o.key != key]
                mine = next((o for o in self._orders if o.taker is None and o.key == key), None)
            else:
                mine = next((o for o in self._orders if o.taker == taker), None)
                stale = [mine] if mine is not None and mine.key != key else []
                mine = None if stale else mine
            self._orders = [o for o in self._orders if o is not mine and o not in stale]
        # A named taker's (on the concurrent runner's one loop thread) is not waited for: it is
        # discarded once made. The next guests of another key are, as top_up's are.
        self._dispose(stale, None if taker is None else 0.0)
        return mine

    def cancel(self, taker: Hashable) -> None:
        """``taker`` will not take its order (if it has one left): it is discarded."""
        with self._lock:
            orders = [o for o in self._orders if o.taker == taker]
            self._orders = [o for o in self._orders if o.taker != taker]
        self._dispose(orders, 0.0)

    def cancel_all(self, timeout: float | None = None) -> None:
        """Cancel every order, waiting for them up to ``timeout`` seconds in all; past it an
        item still in the making is discarded by its thread once made."""
        with self._lock:
            orders, self._orders = self._orders, []
        self._dispose(orders, timeout)

    def pending(self) -> int:
        with self._lock:
            return len(self._orders)

    @staticmethod
    def _dispose(orders: list[Order[T]], timeout: float | None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        for order in orders:
            order.cancel(None if deadline is None else max(0.0, deadline - time.monotonic()))
