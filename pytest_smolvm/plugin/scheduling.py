"""Handing tests to xdist workers that each keep N in flight (``--smol-concurrency=N -n W``).

xdist's load scheduling hands each worker a small chunk of tests, then more whenever the worker
reports one done. A worker of this plugin reports a test done as soon as it is in flight, and
xdist's worker wants its next test in hand before it starts the current one; neither side knows a
worker holds N slots. So when a run's tests all fit the workers' slots at once, the worker that
put its first tests in flight soonest was handed more than its N (107 and 93 of 200 episodes at
``-n 2 --smol-concurrency=100``), and its extra tests waited for one of its own slots, a whole
test's length, while the other worker had slots to spare.

Such a run is split evenly up front instead: each worker gets its share in collection order (as
xdist's chunks keep it, for fixtures' sake) and is told at once that no more will come, so every
test starts in the first wave. Only a run whose every test runs concurrently is split so: the
controller sees test ids alone, so each worker says so from its collection (over the plan
service, before xdist hands the controller the ids); a synchronous test is better rebalanced as
it finishes. A run larger than the slots keeps xdist's load scheduling (its tests wait for slots
anyway, and slots free all the time), and so does a run whose user chose ``--dist``. Only this
module imports xdist's scheduler, and only once xdist asks for one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from xdist.scheduler import LoadScheduling


def make_scheduler(config: pytest.Config, log: Any, slots: int,
                   all_concurrent: Callable[[], set[str]]) -> LoadScheduling | None:
    """A scheduler for a run with ``slots`` tests in flight per worker; None: xdist's own.
    ``all_concurrent()``: the workers that said every test they collected runs concurrently."""
    if slots <= 1 or config.getvalue("dist") != "load" or _dist_chosen(config):
        return None
    return SlotAwareLoadScheduling(config, log, slots, all_concurrent)


def _dist_chosen(config: pytest.Config) -> bool:
    """Whether the user asked for load scheduling (``--dist load``, ``-d``) rather than ``-n``
    choosing it: xdist sets the same value either way, but not in the early-parsed arguments."""
    early = config.known_args_namespace
    return getattr(early, "dist", "no") != "no" or bool(getattr(early, "distload", False))


class SlotAwareLoadScheduling(LoadScheduling):  # type: ignore[misc]  # xdist's classes are untyped
    collection: list[str] | None  # LoadScheduling's, as it sets them
    maxschedchunk: int | None

    def __init__(self, config: pytest.Config, log: Any, slots: int, all_concurrent: Callable[[], set[str]]) -> None:
        super().__init__(config, log)
        self.slots = slots
        self.all_concurrent = all_concurrent

    def schedule(self) -> None:
        collections = list(self.node2collection.values())
        first = collections[0] if collections else []
        fits = 2 * len(self.nodes) <= len(first) <= self.slots * len(self.nodes)
        concurrent = {node.gateway.id for node in self.nodes} <= self.all_concurrent()
        if self.collection is not None or not fits or not concurrent or any(c != first for c in collections):
            # a later call, a larger run, a synchronous test to balance as it finishes, or
            # collections that differ (xdist reports it)
            super().schedule()
            return
        self.collection = first
        self.pending[:] = range(len(first))
        self.maxschedchunk = self.maxschedchunk or len(first)  # read again if a crashed worker's tests come back
        share, extra = divmod(len(first), len(self.nodes))
        for index, node in enumerate(self.nodes):
            self._send_tests(node, share + (index < extra))
        for node in self.nodes:
            node.shutdown()
