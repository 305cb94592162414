"""An item's share of pytest's fixture state, put aside while other items run their phases.

pytest's fixture machinery holds one item's function-scoped state at a time: SetupState's
stack ends in the item being run, and each function-scoped FixtureDef caches that item's value
and finalizers. The concurrent runner (concurrency.py) runs many items' phases interleaved, so
right after an item's setup it puts the item's share aside (:func:`detach`: pytest then looks
as if the item had not started) and puts it back right before the item's next phase
(:func:`attach`). Phases never overlap (one thread), so at most one item's share is in place.

These are pytest internals (``Session._setupstate``, ``FixtureDef._finalizers``,
``Function._fixtureinfo``), stable since pytest 8.0; tests/test_concurrency.py runs them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest


@dataclass
class Detached:
    """An item's function-scoped share of pytest's fixture state, while it is put aside."""

    entry: Any = None  # its SetupState stack entry (finalizers, setup error), if it was pushed
    fixtures: list[tuple[Any, Any, list[Any]]] = field(default_factory=list)


def _function_fixturedefs(item: pytest.Item) -> list[Any]:
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return []
    return [fd for chain in info.name2fixturedefs.values() for fd in chain if fd.scope == "function"]


def detach(item: pytest.Item) -> Detached:
    """Put ``item``'s state aside: pytest then looks as if the item had not been set up."""
    stack = item.session._setupstate.stack
    detached = Detached()
    if stack and next(reversed(stack)) is item:
        detached.entry = stack.pop(item)
    for fixturedef in _function_fixturedefs(item):
        detached.fixtures.append((fixturedef, fixturedef.cached_result, list(fixturedef._finalizers)))
        fixturedef.cached_result = None
        fixturedef._finalizers.clear()
    return detached


def attach(item: pytest.Item, detached: Detached) -> None:
    """Put back what :func:`detach` put aside (no other item's state is in place then)."""
    if detached.entry is not None:
        item.session._setupstate.stack[item] = detached.entry
    for fixturedef, cached, finalizers in detached.fixtures:
        fixturedef.cached_result = cached
        fixturedef._finalizers[:] = finalizers


def group_key(item: pytest.Item) -> tuple[Any, ...]:
    """Items with equal keys may be in flight together: the same parents (module, class) and
    the same values of every parameter that outlives a test (a module-scoped fixture's param
    changing would tear down its value under the tests still using it)."""
    callspec = getattr(item, "callspec", None)
    shared: list[tuple[str, int]] = []
    if callspec is not None:
        defs = item._fixtureinfo.name2fixturedefs  # type: ignore[attr-defined]
        for name, index in callspec.indices.items():
            chain = defs.get(name, ())
            if chain and chain[-1].scope != "function":
                shared.append((name, index))
    return tuple(item.listchain()[:-1]), tuple(sorted(shared))
