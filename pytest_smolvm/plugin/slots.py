"""The N slots of the concurrent runner, and how many guests to make ahead of them.

A test holds a slot from its setup to the end of its teardown; its guest may be made before,
while it waits for one (concurrency.py). Both run on the worker's one event loop.
"""

from __future__ import annotations

import collections
import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import asyncio


class Slots:
    """Up to a limit held at once; waiters are woken one per freed slot, first come first served."""

    def __init__(self) -> None:
        self.holders: set[object] = set()
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    async def take(self, loop: asyncio.AbstractEventLoop, limit: int, holder: object) -> None:
        while len(self.holders) >= limit:
            waiter = loop.create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            except BaseException:
                if waiter.done() and not waiter.cancelled():
                    self._wake_one()  # woken, then cancelled: the wake goes to the next in line
                raise
        self.holders.add(holder)

    def free(self, holder: object) -> None:
        """Give back ``holder``'s slot, if it holds one."""
        if holder in self.holders:
            self.holders.discard(holder)
            self._wake_one()

    def _wake_one(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return


class Pace:
    """How many guests to make ahead of the N slots: as many as free up while one is being made.

    Little's law: slots free at N / (time a test holds one), and a guest takes its make time to
    be ready, so that many made ahead keep every freed slot busy at once, and no more wait idle
    (a made-ahead guest is billed on smol cloud, and holds memory everywhere). Both times are
    averages that follow the run (an exponential moving average); nothing is made ahead until
    one of each has been measured.
    """

    WEIGHT = 0.2  # of the newest measurement

    def __init__(self) -> None:
        self.making: float | None = None  # seconds from asking for a test's guest to having it
        self.holding: float | None = None  # seconds a test holds its slot (setup to teardown)

    @classmethod
    def _average(cls, old: float | None, new: float) -> float:
        return new if old is None else old + cls.WEIGHT * (new - old)

    def made(self, seconds: float) -> None:
        self.making = self._average(self.making, seconds)

    def held(self, seconds: float) -> None:
        self.holding = self._average(self.holding, seconds)

    def ahead(self, limit: int) -> int:
        if self.making is None or not self.holding:
            return 0
        return min(limit, math.ceil(limit * self.making / self.holding))
