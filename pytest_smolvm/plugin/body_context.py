"""A concurrent test body's own output, warnings and log records, as pytest gives a serial call.

Under ``--smol-concurrency`` many test bodies run as tasks on one event loop, outside any pytest
phase, and each is replayed later in its own call phase (concurrency.py). What a body prints,
warns and logs must be that test's alone, and reach its report as if the call phase had seen
it. So each body runs *stepped*: every time the event loop resumes it, until it yields again,
the process's global state is the test's own, the way pytest sets it for a call phase:

- ``sys.stdout``/``sys.stderr`` write to the test's buffers (or to its ``capsys`` capture, which
  is resumed for the step), unless capture is off (``-s``) or the body is inside
  ``capsys.disabled()`` (then to the terminal, as in a serial call);
- the warnings module's state is the test's, carried from step to step as a serial call holds it:
  its filters (``-W``, ini, its ``filterwarnings`` marks, what its fixtures set) and where what they
  let through goes: a recorder its setup entered (``recwarn``), one its body entered across an
  ``await`` (``pytest.warns``), else kept for the test, whole (its ``source`` too);
- ``sys.unraisablehook`` keeps what the step's objects raise as they are collected, for the test;
- ``PYTEST_CURRENT_TEST`` names the test's call, as pytest sets it for a call phase;
- the root logger has the test's ``caplog`` handler (a fresh one, as a call phase gets) and a
  handler that keeps every record for the report, at the level pytest sets for a phase; the
  loggers its ``caplog.set_level`` changed have the levels it set.

Between steps everything is put back, so another test's step, or pytest itself, sees its own.
:meth:`BodyContext.replay` then hands what was kept to the call phase while pytest's capture,
warnings and logging contexts for that phase are in place: the report's sections, the warnings
summary (unraisable exceptions included) and ``caplog.get_records("call")`` read as for a serial
run. What cannot be told apart inside one process, output written to the file descriptors
themselves (``capfd``, a child process's output), is not attributed: such tests run one at a
time (concurrency.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import os
import sys
import time
import warnings
from collections.abc import Coroutine, Generator, Iterator
from typing import Any, TypeVar

import pytest

from pytest_smolvm.plugin import internals

T = TypeVar("T")
CURRENT_TEST = "PYTEST_CURRENT_TEST"


class _Keep(logging.Handler):
    """Keeps every record that reaches the root logger during the body's steps."""

    def __init__(self) -> None:
        super().__init__(logging.NOTSET)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


class BodyContext:
    """One concurrent test's state, in place while its body runs and replayed in its call phase."""

    def __init__(self, item: pytest.Item, capture_fixture: Any,
                 setup_warnings: tuple[internals.WarningsState, internals.WarningsState]) -> None:
        self.capturing = item.config.getoption("capture", "fd") != "no"
        self.stdout, self.stderr = io.StringIO(), io.StringIO()
        self.capture_fixture = capture_fixture
        self._capture_started = False
        self._outer: tuple[Any, Any] = (sys.stdout, sys.stderr)  # the streams the step found
        self._uncaptured = 0  # capsys.disabled() blocks the body is inside, held across its awaits
        self.warnings: list[warnings.WarningMessage] = []
        before, after = setup_warnings  # the module's state as the item's setup began and ended
        if after[1:] == before[1:]:  # no fixture left a recorder: the call phase replays what is kept
            self._warnings = internals.recording_into(self.warnings.append, list(after[0]))
        else:
            self._warnings = after
        self.unraisables: list[Any] = []
        self._current = f"{item.nodeid} (call)".replace("\x00", "(null)")  # as pytest writes it
        self.level = internals.log_level(item.config)
        self.kept = _Keep()
        self.caplog = internals.fresh_caplog_handler(item)
        if self.level is not None:
            self.caplog.setLevel(self.level)
        self._caplog_fixture = item.funcargs.get("caplog") if isinstance(item, pytest.Function) else None
        self._levels: dict[str | None, int] = {}  # what its caplog.set_level set, while it runs
        self._present = frozenset(logging.getLogger().handlers)  # the run's own: they see records live
        self.outcome: BaseException | None = None  # how the body ended: None = it returned

    def _enter(self) -> tuple[Any, ...]:
        root = logging.getLogger()
        saved = (sys.stdout, sys.stderr, warnings.catch_warnings(), root.level, sys.unraisablehook,
                 os.environ.get(CURRENT_TEST))
        saved[2].__enter__()
        internals.set_warnings_state(self._warnings)
        sys.unraisablehook = self.unraisables.append
        os.environ[CURRENT_TEST] = self._current
        self._outer = saved[0], saved[1]
        if self.capturing and not self._uncaptured:
            sys.stdout, sys.stderr = self.stdout, self.stderr
            if self.capture_fixture is not None:  # started on the first step, as a call phase starts it
                internals.capture_on(self.capture_fixture, first=not self._capture_started)
                self._capture_started = True
        root.addHandler(self.kept)
        root.addHandler(self.caplog)
        if self.level is not None and root.level > self.level:
            root.setLevel(self.level)
        for name, level in self._levels.items():
            logging.getLogger(name).setLevel(level)
        return saved

    def _exit(self, saved: tuple[Any, ...]) -> None:
        root = logging.getLogger()
        if self._caplog_fixture is not None:  # its levels are put back as its finalizer puts them back
            for name, before in internals.caplog_set_levels(self._caplog_fixture).items():
                logger = logging.getLogger(name)
                self._levels[name] = logger.level
                logger.setLevel(before)
        root.removeHandler(self.caplog)
        root.removeHandler(self.kept)
        if self.level is not None and root.level == self.level:
            root.setLevel(saved[3])
        if self.capturing and self.capture_fixture is not None and not self._uncaptured:
            internals.capture_off(self.capture_fixture)
        sys.stdout, sys.stderr = saved[0], saved[1]
        if saved[5] is None:
            os.environ.pop(CURRENT_TEST, None)
        else:
            os.environ[CURRENT_TEST] = saved[5]
        sys.unraisablehook = saved[4]
        self._warnings = internals.warnings_state()  # as the step left it: a recorder it entered stays
        saved[2].__exit__(None, None, None)

    @contextlib.contextmanager
    def _capture_disabled(self) -> Iterator[None]:
        """The body's ``capsys.disabled()``: until the block ends, across awaits, what the body
        writes goes to the streams beneath the test's capture (the terminal), as in a serial call
        phase. pytest's own would suspend the capture manager's, which a body's steps do not use."""
        self._uncaptured += 1
        if self._uncaptured == 1:  # in a step: the state _enter put in place
            internals.capture_off(self.capture_fixture)
            sys.stdout, sys.stderr = self._outer
        try:
            yield
        finally:
            self._uncaptured -= 1
            if self._uncaptured == 0:
                sys.stdout, sys.stderr = self.stdout, self.stderr
                internals.capture_on(self.capture_fixture, first=False)

    async def run(self, body: Coroutine[Any, Any, T]) -> T:
        """Await ``body`` with this test's state in place for each of its steps."""
        routed = self.capturing and self.capture_fixture is not None
        if routed:
            self.capture_fixture.disabled = self._capture_disabled  # this instance's, while the body runs
        try:
            result: T = await _Stepped(body, self)
        finally:
            if routed:
                del self.capture_fixture.disabled
            if self._capture_started:  # closed as a call phase closes it: unread output is the test's
                saved = self._enter()
                try:
                    internals.capture_close(self.capture_fixture)
                finally:
                    self._exit(saved)
        return result

    def replay(self) -> None:
        """In the test's call phase: its output, warnings and log records, as if made there."""
        if self.capturing:
            sys.stdout.write(self.stdout.getvalue())
            sys.stderr.write(self.stderr.getvalue())
        for unraisable in self.unraisables:  # to pytest's hook of this phase: reported as the test's
            sys.unraisablehook(unraisable)
        for message in self.warnings:
            internals.show_warning(message)
        phase_handlers = [h for h in logging.getLogger().handlers if h not in self._present]
        for record in self.kept.records:
            for handler in phase_handlers:
                if record.levelno >= handler.level:
                    handler.handle(record)


class _Stepped:
    """Awaits a coroutine one step at a time, with its test's state in place for each step."""

    def __init__(self, body: Coroutine[Any, Any, Any], context: BodyContext) -> None:
        self.body = body
        self.context = context

    def __await__(self) -> Generator[Any, Any, Any]:
        body, context = self.body, self.context
        value: Any = None
        error: BaseException | None = None
        while True:
            saved = context._enter()
            try:
                yielded = body.send(value) if error is None else body.throw(error)
            except StopIteration as stop:
                return stop.value
            finally:
                context._exit(saved)
            error = None
            try:
                value = yield yielded
            except GeneratorExit:
                body.close()
                raise
            except BaseException as exc:  # thrown in by the task (its cancellation): the body's to handle
                value, error = None, exc


async def run_body(item: pytest.Function, capture_fixture: Any,
                   setup_warnings: tuple[internals.WarningsState, internals.WarningsState], timeout: Any,
                   deadline: float | None, abort_seconds: float) -> tuple[BodyContext, float, float]:
    """``item``'s test function as a task of its own, in its own context, to its end; with its
    start (epoch) and duration. ``setup_warnings``: the warnings module's state as the item's
    setup phase began and ended; ``timeout``: pytest-timeout's settings, or None; ``deadline``
    (monotonic) ends its budget, or, with ``func_only``, the body's alone starts it."""
    context = BodyContext(item, capture_fixture, setup_warnings)
    coroutine = item.obj(**internals.test_arguments(item))
    started, clock = time.time(), time.perf_counter()
    if timeout is not None and timeout.func_only:
        deadline = time.monotonic() + timeout.timeout
    timed_out = False

    async def outcome() -> BaseException | None:
        try:
            await context.run(coroutine)
        except BaseException as exc:  # pytest.skip/fail/xfail/exit, KeyboardInterrupt...: the test's own
            return exc
        return None

    body = asyncio.get_running_loop().create_task(outcome())

    def expire() -> None:
        nonlocal timed_out
        timed_out = True
        if context.capturing:
            internals.timeout_dump(context.stdout)  # as pytest-timeout's signal method writes it
        body.cancel()  # which kills its guest commands (handle/aio.py)

    timer = asyncio.get_running_loop().call_later(deadline - time.monotonic(), expire) if deadline else None
    try:
        try:
            await asyncio.wait({body})
        except asyncio.CancelledError:  # the runner's abort (Ctrl-C): the body unwinds first
            body.cancel()
            await asyncio.wait({body}, timeout=abort_seconds)
            raise
    finally:
        if timer is not None:
            timer.cancel()
    context.outcome = internals.timeout_failure(timeout) if timed_out else body.result()
    return context, started, time.perf_counter() - clock
