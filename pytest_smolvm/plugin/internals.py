"""Every private part of pytest, pytest-xdist, pytest-timeout and Python's warnings module the
plugin touches: here, and only here.

The concurrent runner (concurrency.py) keeps many items between their phases at once, which no
public pytest API offers: it puts an item's fixture state aside and back (item_state.py), runs
each of its phases in that item's own warnings context, hands its body a fresh ``caplog``
handler and its ``capsys`` capture, bounds it as pytest-timeout would, labels its reports for
xdist's worker, and, in the controller, schedules and accounts for workers that keep several
tests in flight. Each of those needs an attribute that is not public; each is read through a
function of this module, and :func:`verify` checks them all, up front, against the versions the
plugin is tested with (:data:`TESTED`, the same as pyproject's lower bounds and the nox matrix's
cells). A release that moves one fails the run with one line naming it and the versions, not an
INTERNALERROR in the middle of a test.
"""

from __future__ import annotations

import importlib.metadata
import logging
import signal
import threading
import warnings
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import pytest

# (lowest, highest) major.minor each is tested with; pyproject's lower bounds and noxfile.py's cells
TESTED: dict[str, tuple[tuple[int, int], tuple[int, int]]] = {
    "pytest": ((8, 0), (9, 0)),
    "pytest-xdist": ((3, 5), (3, 8)),
    "pytest-timeout": ((2, 3), (2, 4)),
}


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "?"


def _changed(dist: str, what: str) -> pytest.UsageError:
    low, high = TESTED[dist]
    return pytest.UsageError(
        f"pytest-smolvm --smol-concurrency: {dist} {_version(dist)} has no {what}; the concurrent runner is "
        f"tested with {dist} {low[0]}.{low[1]} to {high[0]}.{high[1]}: install one of those, or run without "
        "--smol-concurrency")


def _sets(cls: type, attribute: str) -> bool:
    """Whether ``cls.__init__`` assigns ``self.<attribute>`` (instance attributes have no class trace)."""
    init = getattr(cls, "__init__", None)
    return attribute in getattr(getattr(init, "__code__", None), "co_names", ())


def verify(config: pytest.Config) -> None:
    """Raise a one-line UsageError if any internal below is missing (cheap: no test runs)."""
    from _pytest import capture, fixtures, python, runner
    from _pytest import logging as pytest_logging
    from _pytest import warnings as pytest_warnings

    checks: list[tuple[str, bool]] = [
        ("SetupState.stack", _sets(runner.SetupState, "stack")),
        ("SetupState.teardown_exact", hasattr(runner.SetupState, "teardown_exact")),
        ("FixtureDef._finalizers", _sets(fixtures.FixtureDef, "_finalizers")),
        ("Function._fixtureinfo", _sets(python.Function, "_fixtureinfo")),
        ("Function._initrequest", hasattr(python.Function, "_initrequest")),
        ("warnings.catch_warnings_for_item", hasattr(pytest_warnings, "catch_warnings_for_item")),
        ("logging.caplog_handler_key", hasattr(pytest_logging, "caplog_handler_key")),
        ("logging.caplog_records_key", hasattr(pytest_logging, "caplog_records_key")),
        ("logging.LogCaptureHandler", hasattr(pytest_logging, "LogCaptureHandler")),
        ("LogCaptureFixture._initial_logger_levels", _sets(pytest_logging.LogCaptureFixture, "_initial_logger_levels")),
        ("CaptureManager._capture_fixture", _sets(capture.CaptureManager, "_capture_fixture")),
        ("CaptureFixture._start/_suspend/_resume/_is_started",
         all(hasattr(capture.CaptureFixture, name) for name in ("_start", "_suspend", "_resume", "_is_started"))),
    ]
    for what, present in checks:
        if not present:
            raise _changed("pytest", what)
    missing = [name for name in _PYTHON_WARNINGS if not hasattr(warnings, name)]
    if missing:
        raise pytest.UsageError(f"pytest-smolvm --smol-concurrency: this Python's warnings module has no "
                                f"{', '.join(missing)}; run without --smol-concurrency")
    if config.pluginmanager.hasplugin("timeout"):
        import pytest_timeout

        for name in ("_get_item_settings", "timeout_sigalrm", "timeout_timer", "dump_stacks"):
            if not hasattr(pytest_timeout, name):
                raise _changed("pytest-timeout", name)
    if config.pluginmanager.hasplugin("xdist"):
        from xdist import scheduler

        if not hasattr(scheduler.LoadScheduling, "_send_tests"):
            raise _changed("pytest-xdist", "LoadScheduling._send_tests")


# ------------------------------------------------------------------ pytest: an item's state


def setup_stack(session: pytest.Session) -> dict[pytest.Item, Any]:
    """SetupState's stack: the nodes set up, innermost last, each with its finalizers."""
    stack: dict[Any, Any] = session._setupstate.stack
    return stack


def teardown_exact(session: pytest.Session, nextitem: pytest.Item | None) -> None:
    session._setupstate.teardown_exact(nextitem)


def function_fixturedefs(item: pytest.Item) -> list[Any]:
    """The function-scoped FixtureDefs ``item`` uses (their cached value is the item's own)."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return []
    return [fd for chain in info.name2fixturedefs.values() for fd in chain if fd.scope == "function"]


def shared_fixturedefs(item: pytest.Item) -> dict[str, Any]:
    """Each fixture name ``item`` uses, with its closest FixtureDef's scope."""
    info = getattr(item, "_fixtureinfo", None)
    return {name: chain[-1] for name, chain in (info.name2fixturedefs.items() if info else ()) if chain}


def fixture_finalizers(fixturedef: Any) -> list[Callable[[], object]]:
    found: list[Callable[[], object]] = fixturedef._finalizers
    return found


def test_arguments(item: pytest.Function) -> dict[str, Any]:
    """The test function's own arguments, from its fixtures, as pytest's pyfunc_call passes them
    (where a pytest keeps no argument names, those of its signature without a default)."""
    info = getattr(item, "_fixtureinfo", None)
    if info is not None:
        return {name: item.funcargs[name] for name in info.argnames}
    import inspect

    parameters = inspect.signature(item.obj).parameters.values()
    return {p.name: item.funcargs[p.name] for p in parameters if p.default is p.empty and p.name in item.funcargs}


def begin_protocol(item: pytest.Item) -> None:
    """What pytest's runtestprotocol does first: a re-run (pytest-rerunfailures) gets a new request."""
    if isinstance(item, pytest.Function) and not item._request:
        item._initrequest()


def end_protocol(item: pytest.Item) -> None:
    """What pytest's runtestprotocol does last: the item's funcargs and request go away."""
    if isinstance(item, pytest.Function):
        item._request = False  # type: ignore[assignment]
        item.funcargs = None  # type: ignore[assignment]


# ------------------------------------------------------------------ pytest: warnings, logs, capture


def item_warnings(item: pytest.Item) -> AbstractContextManager[None]:
    """The warnings context pytest gives ``item``'s protocol: its filters, its warnings recorded
    under its node id. pytest enters it once around the whole protocol; a concurrent item's
    phases run while another item's protocol is in progress, so each phase enters its own."""
    from _pytest.warnings import catch_warnings_for_item

    return catch_warnings_for_item(item.config, ihook=item.ihook, when="runtest", item=item)


# What catch_warnings saves and restores (and record=True replaces): a body's warnings state is
# carried from step to step in these, as the module holds it while a serial call runs.
_PYTHON_WARNINGS = ("_showwarnmsg_impl", "_showwarnmsg", "_showwarning_orig")
WarningsState = tuple[list[Any], Callable[..., object], Callable[[warnings.WarningMessage], object]]


def warnings_state() -> WarningsState:
    """The warnings module's filters, ``showwarning`` and the recorder ``record=True`` installs."""
    return warnings.filters, warnings.showwarning, warnings._showwarnmsg_impl  # type: ignore[attr-defined,return-value]


def set_warnings_state(state: WarningsState) -> None:
    warnings.filters, warnings.showwarning = state[0], state[1]  # type: ignore[assignment]
    warnings._showwarnmsg_impl = state[2]  # type: ignore[attr-defined]


def recording_into(kept: Callable[[warnings.WarningMessage], object], filters: list[Any]) -> WarningsState:
    """The state ``catch_warnings(record=True)`` sets: what passes ``filters`` goes to ``kept`` whole."""
    return filters, warnings._showwarning_orig, kept  # type: ignore[attr-defined]


def show_warning(message: warnings.WarningMessage) -> None:
    """``message`` to whatever shows or records warnings now, whole (its ``source`` too)."""
    warnings._showwarnmsg(message)  # type: ignore[attr-defined]


def fresh_caplog_handler(item: pytest.Item) -> logging.Handler:
    """A new ``caplog`` handler for ``item``'s call, as pytest makes for its call phase: the
    body's records go there, so ``caplog`` in a concurrent body sees its own records."""
    from _pytest.logging import LogCaptureHandler, caplog_handler_key, caplog_records_key

    handler = LogCaptureHandler()
    item.stash[caplog_handler_key] = handler
    records = item.stash.get(caplog_records_key, None)
    if records is not None:
        records["call"] = handler.records
    return handler


def caplog_set_levels(caplog: Any) -> dict[str | None, int]:
    """The loggers ``caplog.set_level`` has changed (None: the root), each with its level before."""
    levels: dict[str | None, int] = caplog._initial_logger_levels
    return levels


def log_level(config: pytest.Config) -> int | None:
    """``--log-level``/``log_level``: the level pytest sets on the root logger for each phase."""
    plugin = config.pluginmanager.get_plugin("logging-plugin")
    level = getattr(plugin, "log_level", None)
    return level if isinstance(level, int) else None


def capture_fixture(config: pytest.Config) -> Any:
    """The ``capsys``-like fixture the capture manager holds for the item set up last, or None."""
    capman = config.pluginmanager.get_plugin("capturemanager")
    return getattr(capman, "_capture_fixture", None)


def set_capture_fixture(config: pytest.Config, fixture: Any) -> None:
    capman = config.pluginmanager.get_plugin("capturemanager")
    if capman is not None:
        capman._capture_fixture = fixture


def capture_on(fixture: Any, *, first: bool) -> None:
    """``fixture`` (capsys, capsysbinary) capturing: started afresh for a call, as pytest's
    capture manager starts it for each phase, or resumed where it was suspended."""
    if first:
        fixture._start()
    else:
        fixture._resume()


def capture_off(fixture: Any) -> None:
    if fixture._is_started():
        fixture._suspend()


def capture_close(fixture: Any) -> None:
    """As pytest closes it after a phase: what the test did not read goes to the streams beneath."""
    fixture._resume()
    fixture.close()


# ------------------------------------------------------------------ pytest-timeout


def timeout_settings(item: pytest.Item) -> Any:
    """pytest-timeout's settings for ``item`` (timeout, method, func_only), or None without a timeout."""
    if not item.config.pluginmanager.hasplugin("timeout"):
        return None
    import pytest_timeout

    settings = pytest_timeout._get_item_settings(item)
    return settings if settings.timeout is not None and settings.timeout > 0 else None


@contextmanager
def timeout_alarm(item: pytest.Item, settings: Any, remaining: float) -> Iterator[None]:
    """pytest-timeout's own expiry for ``item`` (its message, its stack dump; ``thread`` kills the
    process, as it does serially), armed for what is left of the item's budget."""
    import pytest_timeout

    remaining = max(remaining, 0.001)
    if settings.method == "signal" and threading.current_thread() is threading.main_thread():
        def expire(signum: int, frame: Any) -> None:
            __tracebackhide__ = True
            pytest_timeout.timeout_sigalrm(item, settings)

        previous = signal.signal(signal.SIGALRM, expire)
        signal.setitimer(signal.ITIMER_REAL, remaining)
        try:
            yield
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
        return
    timer = threading.Timer(remaining, pytest_timeout.timeout_timer, (item, settings))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def timeout_dump(into: Any) -> None:
    """What pytest-timeout writes at a signal-method expiry (the other threads' stacks), into
    ``into``: a concurrent body's output, so its report's section reads as a serial one's."""
    import pytest_timeout
    from _pytest._io import TerminalWriter

    terminal = TerminalWriter(file=into)
    several = len(threading.enumerate()) > 1
    if several:
        terminal.sep("+", title="Timeout")
    pytest_timeout.dump_stacks(terminal)
    if several:
        terminal.sep("+", title="Timeout")


def timeout_failure(settings: Any) -> BaseException:
    """The exception pytest-timeout's signal method raises at expiry, with its own words."""
    import pytest_timeout

    message = getattr(pytest_timeout, "PYTEST_FAILURE_MESSAGE", "Timeout >%ss")
    return pytest.fail.Exception(message % settings.timeout, pytrace=False)


# ------------------------------------------------------------------ pytest-xdist


def xdist_worker(config: pytest.Config) -> Any:
    """xdist's WorkerInteractor in a worker (registered without a name: found by its class)."""
    if not hasattr(config, "workerinput"):
        return None
    return next((p for p in config.pluginmanager.get_plugins() if type(p).__name__ == "WorkerInteractor"), None)


@contextmanager
def reporting_as(worker: Any, index: int) -> Iterator[None]:
    """xdist's worker labels each report with the index of the test it runs, and checks the
    report is that test's: while a concurrent item's phase runs, it is that item."""
    if worker is None:
        yield
        return
    current, worker.item_index = worker.item_index, index
    try:
        yield
    finally:
        worker.item_index = current


def not_seen_started(config: pytest.Config, node: Any) -> set[str]:
    """The tests xdist's controller handed ``node`` and has not seen start, in the shapes its
    schedulers keep: ``node2pending`` (indices into the collection: load, worksteal, each) or
    ``assigned_work`` (per scope, each test and whether it is done: loadscope, loadfile, loadgroup)."""
    scheduler = getattr(config.pluginmanager.get_plugin("dsession"), "sched", None)
    pending = getattr(scheduler, "node2pending", {}).get(node)
    if pending is not None:
        collection = getattr(scheduler, "node2collection", {}).get(node) or getattr(scheduler, "collection", None) or []
        return {collection[index] for index in pending if index < len(collection)}
    work = getattr(scheduler, "assigned_work", {}).get(node, {})
    return {nodeid for unit in work.values() for nodeid, done in unit.items() if not done}


def even_split_scheduler(config: pytest.Config, log: Any, fits: Callable[[list[Any], list[list[str]]], bool]) -> Any:
    """xdist's load scheduling, except that a first collection ``fits(nodes, collections)``
    approves is split evenly up front and every worker told at once that no more will come."""
    from xdist.scheduler import LoadScheduling

    class SlotAwareLoadScheduling(LoadScheduling):  # type: ignore[misc]  # xdist's classes are untyped
        collection: list[str] | None  # LoadScheduling's, as it sets them
        maxschedchunk: int | None

        def schedule(self) -> None:
            collections = list(self.node2collection.values())
            first = collections[0] if collections else []
            if self.collection is not None or not fits(self.nodes, collections):
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

    return SlotAwareLoadScheduling(config, log)


def dist_chosen(config: pytest.Config) -> bool:
    """Whether the user asked for load scheduling (``--dist load``, ``-d``) rather than ``-n``
    choosing it: xdist sets the same value either way, but not in the early-parsed arguments."""
    early = config.known_args_namespace
    return getattr(early, "dist", "no") != "no" or bool(getattr(early, "distload", False))
