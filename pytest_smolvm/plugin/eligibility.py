"""Which tests the concurrent runner takes (concurrency.py), and why the others run one at a time.

A test runs concurrently when it is a plain ``async def`` pytest function that uses a guest and
asks for more than one in flight (``--smol-concurrency``, or ``smol_episodes(concurrency=)``).
The rest keep pytest's own order, and where the user may expect otherwise the run says why once,
in its summary (:func:`limit`'s second answer): a test an async plugin claims (pytest-asyncio's
marked tests, and every one in its auto mode; anyio's), ``capfd`` (file descriptors are the
process's, shared by every test in flight), a test pytest-rerunfailures may re-run (it runs the
whole protocol itself). A debugger or a setup-only run wants pytest's own order, silently.
"""

from __future__ import annotations

import inspect

import pytest

from pytest_smolvm.plugin.async_tests import GUEST_FIXTURES

MARKER_KEYWORD = "concurrency"
_FD_CAPTURE = frozenset({"capfd", "capfdbinary"})


def marker_limit(item: pytest.Item) -> int | None:
    """``smol_episodes(..., concurrency=N)``, checked at collection (evals/episodes.py)."""
    mark = item.get_closest_marker("smol_episodes")
    value = mark.kwargs.get(MARKER_KEYWORD) if mark is not None else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def limit(item: pytest.Item, default: int) -> tuple[int, str | None]:
    """How many of ``item``'s kind may be in flight (0: it runs one at a time), and why not, if
    the user should be told."""
    if not isinstance(item, pytest.Function) or not GUEST_FIXTURES & set(item.fixturenames):
        return 0, None
    marked = marker_limit(item)
    wanted = marked if marked is not None else default
    if wanted <= 1:
        return 0, None
    if type(item) is not pytest.Function or not inspect.iscoroutinefunction(item.obj):
        if inspect.iscoroutinefunction(getattr(item, "function", None)):
            plugin = type(item).__module__.split(".")[0]
            return 0, (f"{plugin} runs the async tests it claims itself (pytest-asyncio claims those marked "
                       "asyncio, and every one in auto mode): use asyncio_mode = strict and leave guest tests "
                       "unmarked")
        return 0, None
    if "anyio_backend" in item.fixturenames or item.get_closest_marker("anyio"):
        return 0, ("anyio's plugin runs the tests marked anyio (or using anyio_backend) itself: "
                   "leave guest tests unmarked")
    if item.get_closest_marker("asyncio"):
        return 0, ("a test marked asyncio (its loop_scope included) is pytest-asyncio's to run, one at a time: "
                   "leave guest tests unmarked")
    if _FD_CAPTURE & set(item.fixturenames):
        return 0, ("capfd and capfdbinary capture the process's file descriptors, which tests in flight "
                   "share: use capsys")
    config = item.config
    if config.pluginmanager.hasplugin("rerunfailures") and (item.get_closest_marker("flaky")
                                                            or config.getoption("reruns", 0)):
        return 0, "pytest-rerunfailures re-runs a test's whole protocol itself"
    option = config.option
    if option.usepdb or getattr(option, "trace", False) or option.setuponly or option.setupplan:
        return 0, None  # a debugger or a setup-only run wants pytest's own order
    return wanted, None
