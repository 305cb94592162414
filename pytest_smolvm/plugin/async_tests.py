"""``async def`` tests that use a guest run without another async plugin.

pytest itself refuses a coroutine test unless a plugin runs it. A guest test's async code is
``smol_vm.aio`` calls, which need nothing but a running asyncio loop, so such a test gets one
here: :func:`run` is called from the plugin's ``pytest_pyfunc_call`` after the async plugins'
own (anyio's and pytest-asyncio's claim their tests first: anyio's hook is ``tryfirst``, and
pytest-asyncio turns its tests into plain functions at collection), and before pytest's
default, which would fail the test.

Under ``--smol-concurrency`` the body has already run as a task (concurrency.py) when the call
phase comes: :data:`REPLAY_KEY` holds what it printed, warned and logged, and its outcome, which
the call phase replays so that pytest reports them as its own (body_context.py).
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from pytest_smolvm.plugin.body_context import BodyContext  # noqa: F401  # named in REPLAY_KEY's type

GUEST_FIXTURES = frozenset({"smol_vm", "smol_vm_factory", "smol_episode"})
REPLAY_KEY = pytest.StashKey["BodyContext"]()  # a concurrent body, run to its end


def run(item: pytest.Function) -> bool | None:
    """Run ``item`` on a fresh asyncio loop if it is an async guest test; True when it ran."""
    if REPLAY_KEY in item.stash:
        body = item.stash[REPLAY_KEY]
        body.replay()
        if body.outcome is not None:
            raise body.outcome
        return True
    if not inspect.iscoroutinefunction(item.obj) or not GUEST_FIXTURES & set(item.fixturenames):
        return None
    from pytest_smolvm.plugin import internals

    arguments: dict[str, Any] = internals.test_arguments(item)
    import asyncio  # here: a concurrent replay, above, never needs a loop of its own

    asyncio.run(item.obj(**arguments))
    return True
