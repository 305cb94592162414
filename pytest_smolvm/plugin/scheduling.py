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
anyway, and slots free all the time), and so does a run whose user chose ``--dist``. xdist's
scheduler is imported (internals.py) only once xdist asks for one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from pytest_smolvm.plugin import internals


def make_scheduler(config: pytest.Config, log: Any, slots: int, all_concurrent: Callable[[], set[str]]) -> Any:
    """A scheduler for a run with ``slots`` tests in flight per worker; None: xdist's own.
    ``all_concurrent()``: the workers that said every test they collected runs concurrently."""
    if slots <= 1 or config.getvalue("dist") != "load" or internals.dist_chosen(config):
        return None

    def fits(nodes: list[Any], collections: list[list[str]]) -> bool:
        first = collections[0] if collections else []
        # a larger run, a synchronous test to balance as it finishes, or collections that
        # differ (xdist reports it) keep xdist's load scheduling
        return (2 * len(nodes) <= len(first) <= slots * len(nodes)
                and {node.gateway.id for node in nodes} <= all_concurrent()
                and all(c == first for c in collections))

    return internals.even_split_scheduler(config, log, fits)
