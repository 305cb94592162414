"""The N slots of the concurrent runner.

A test holds a slot from its setup to the end of its teardown; its guest may be made before,
while it waits for one (concurrency.py); how many tests wait so is session/ahead.py's Pace.
Slots run on the worker's one event loop.
"""

from __future__ import annotations

import collections
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
