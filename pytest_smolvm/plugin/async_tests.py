"""``async def`` tests that use a guest run without another async plugin.

pytest itself refuses a coroutine test unless a plugin runs it. A guest test's async code is
``smol_vm.aio`` calls, which need nothing but a running asyncio loop, so such a test gets one
here: :func:`run` is called from the plugin's ``pytest_pyfunc_call`` after the async plugins'
own (anyio's and pytest-asyncio's claim their tests first: anyio's hook is ``tryfirst``, and
pytest-asyncio turns its tests into plain functions at collection), and before pytest's
default, which would fail the test.
"""

from __future__ import annotations

import asyncio
import inspect
from typing import Any

import pytest

GUEST_FIXTURES = frozenset({"smol_vm", "smol_vm_factory", "smol_episode"})


def run(item: pytest.Function) -> bool | None:
    """Run ``item`` on a fresh asyncio loop if it is an async guest test; True when it ran."""
    if not inspect.iscoroutinefunction(item.obj) or not GUEST_FIXTURES & set(item.fixturenames):
        return None
    arguments: dict[str, Any] = {name: item.funcargs[name] for name in item._fixtureinfo.argnames}
    asyncio.run(item.obj(**arguments))
    return True
