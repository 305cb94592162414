"""An item's share of pytest's fixture state, put aside while other items run their phases.

pytest's fixture machinery holds one item's function-scoped state at a time: SetupState's
stack ends in the item being run, and each function-scoped FixtureDef caches that item's value
and finalizers. The concurrent runner (concurrency.py) runs many items' phases interleaved, so
right after an item's setup it puts the item's share aside (:func:`detach`: pytest then looks
as if the item had not started) and puts it back right before the item's next phase
(:func:`attach`). Phases never overlap (one thread), so at most one item's share is in place.

pytest's capture manager likewise holds the one ``capsys``-like fixture of the item set up
last; it is put aside and back with the rest. The internals are read through internals.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from pytest_smolvm.plugin import internals


@dataclass
class Detached:
    """An item's function-scoped share of pytest's fixture state, while it is put aside."""

    entry: Any = None  # its SetupState stack entry (finalizers, setup error), if it was pushed
    fixtures: list[tuple[Any, Any, list[Any]]] = field(default_factory=list)
    capture: Any = None  # its capsys/capsysbinary fixture, which the capture manager held


def detach(item: pytest.Item) -> Detached:
    """Put ``item``'s state aside: pytest then looks as if the item had not been set up."""
    stack = internals.setup_stack(item.session)
    detached = Detached()
    if stack and next(reversed(stack)) is item:
        detached.entry = stack.pop(item)
    for fixturedef in internals.function_fixturedefs(item):
        finalizers = internals.fixture_finalizers(fixturedef)
        detached.fixtures.append((fixturedef, fixturedef.cached_result, list(finalizers)))
        fixturedef.cached_result = None
        finalizers.clear()
    detached.capture = own_capture_fixture(item)
    if detached.capture is not None:
        internals.set_capture_fixture(item.config, None)
    return detached


def attach(item: pytest.Item, detached: Detached) -> None:
    """Put back what :func:`detach` put aside (no other item's state is in place then)."""
    if detached.entry is not None:
        internals.setup_stack(item.session)[item] = detached.entry
    for fixturedef, cached, finalizers in detached.fixtures:
        fixturedef.cached_result = cached
        internals.fixture_finalizers(fixturedef)[:] = finalizers
    if detached.capture is not None:
        internals.set_capture_fixture(item.config, detached.capture)


def own_capture_fixture(item: pytest.Item) -> Any:
    """The capture fixture the capture manager holds, if it is ``item``'s (it is set up)."""
    fixture = internals.capture_fixture(item.config)
    funcargs = getattr(item, "funcargs", None) or {}
    return fixture if fixture is not None and any(value is fixture for value in funcargs.values()) else None


def group_key(item: pytest.Item) -> tuple[Any, ...]:
    """Items with equal keys may be in flight together: the same parents (module, class) and
    the same values of every parameter that outlives a test (a module-scoped fixture's param
    changing would tear down its value under the tests still using it)."""
    callspec = getattr(item, "callspec", None)
    shared: list[tuple[str, int]] = []
    if callspec is not None:
        defs = internals.shared_fixturedefs(item)
        for name, index in callspec.indices.items():
            if name in defs and defs[name].scope != "function":
                shared.append((name, index))
    return tuple(item.listchain()[:-1]), tuple(sorted(shared))
