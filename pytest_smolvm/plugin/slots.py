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
    """Up to a limit held at once, granted first come first served.

    A freed slot is handed to the first waiter (counted as granted until its task resumes), so
    a test that arrives meanwhile queues behind it instead of taking the slot first: otherwise a
    woken waiter could find its slot gone and wait again at the back, overtaken without end.
    """

    def __init__(self) -> None:
        self.holders: set[object] = set()
        self._granted = 0  # slots handed to woken waiters whose tasks have not resumed yet
        self._waiters: collections.deque[tuple[asyncio.Future[None], int]] = collections.deque()

    async def take(self, loop: asyncio.AbstractEventLoop, limit: int, holder: object) -> None:
        self._prune()
        if self._waiters or len(self.holders) + self._granted >= limit:
            waiter = loop.create_future()
            self._waiters.append((waiter, limit))
            try:
                await waiter
            except BaseException:
                if waiter.done() and not waiter.cancelled():
                    self._granted -= 1  # granted, then cancelled: the slot goes to the next in line
                self._grant()
                raise
            self._granted -= 1
        self.holders.add(holder)

    def free(self, holder: object) -> None:
        """Give back ``holder``'s slot, if it holds one."""
        if holder in self.holders:
            self.holders.discard(holder)
            self._grant()

    def _prune(self) -> None:
        while self._waiters and self._waiters[0][0].done():
            self._waiters.popleft()  # cancelled while waiting

    def _grant(self) -> None:
        self._prune()
        while self._waiters and len(self.holders) + self._granted < self._waiters[0][1]:
            waiter, _ = self._waiters.popleft()
            self._granted += 1
            waiter.set_result(None)
            self._prune()


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
