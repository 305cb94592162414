"""``--smol-concurrency=N``: up to N ``async def`` guest tests of one worker in flight at once.

Each test stays its own pytest item: its own setup, call and teardown reports (so its own
terminal line, JUnit entry, results line and guest logs), its own fixtures and its own guest.
The design, and why, is in docs/architecture.md ("Concurrent tests"); in short: the runner
starts an eligible item as a task on the worker's one event loop and returns, so pytest's loop
hands over the next, blocking only while N are in flight and, before the last of a run of items
that may share the loop, until all have ended. Each phase is pytest's own, run whole on the
loop's thread in the item's own contexts, the item's fixture state put aside between its phases
(item_state.py); the body runs as a task with the test's own global state for each of its steps
(body_context.py) and is replayed in its call phase (async_tests.py). Guests are made ahead
(premade.py). pytest-timeout's timer is taken over: the item's own budget is kept here, setup,
body and teardown together (the body alone with ``func_only``). Which tests run concurrently is
eligibility.py's. Ctrl-C cancels every task in flight and tears each item down, unreported.
"""

from __future__ import annotations

import bdb
import functools
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import pytest

from pytest_smolvm.host import progress
from pytest_smolvm.plugin import eligibility, internals, premade
from pytest_smolvm.plugin.async_tests import REPLAY_KEY
from pytest_smolvm.plugin.body_context import run_body
from pytest_smolvm.plugin.item_state import Detached, attach, detach, group_key
from pytest_smolvm.plugin.slots import Slots

if TYPE_CHECKING:
    import asyncio

    from pytest_smolvm.session.run import SmolRun
    from pytest_smolvm.session.warm import BaselineSetup

ABORT_SECONDS = 60.0  # for tasks to unwind after Ctrl-C; guests left then are the pool's to destroy
_TAKES_KEY = pytest.StashKey[int]()  # the item's concurrency limit; 1 = not ours
_TIMES_KEY = pytest.StashKey[tuple[float, float]]()  # the body's start (epoch) and duration


# ---------------------------------------------------------------------- the runner


@dataclass(eq=False)
class _Flight:
    item: pytest.Function
    timeout: Any  # pytest-timeout's settings for the item, or None
    task: asyncio.Task[None] | None = None
    detached: Detached | None = None
    interrupted: bool = False
    ordered: bool = False  # its guest was ordered ahead (premade.py)
    deadline: float | None = None  # monotonic: the end of the item's pytest-timeout budget
    setup_warnings: tuple[internals.WarningsState, internals.WarningsState] | None = None  # at its start, end


class ConcurrentRunner:
    """Registered by the plugin in every pytest process that runs tests; idle unless asked."""

    def __init__(self, config: pytest.Config, run: SmolRun, limit: int) -> None:
        internals.verify(config)  # again: smol_episodes(concurrency=) asks without the option
        self.config = config
        self.run = run
        self.limit = limit
        self.loop: asyncio.AbstractEventLoop | None = None
        self.flights: dict[pytest.Item, _Flight] = {}
        self.key: tuple[Any, ...] | None = None
        self.upcoming: pytest.Item | None = None  # the next item, when it joins those in flight
        self.final: pytest.Item | None = None  # while draining: the item pytest runs next
        self.setups: dict[tuple[Any, ...], BaselineSetup | None] = {}
        self.failure: BaseException | None = None
        self._worker: Any = internals.xdist_worker(config)
        self._reraise = (pytest.exit.Exception, *(() if config.getoption("usepdb") else (KeyboardInterrupt,)))
        self._indices: dict[int, int] = {}
        self.slots = Slots()  # held from a test's setup to the end of its teardown
        self._in_phase: _Flight | None = None  # whose phase runs now, on the loop's thread

    # -------------------------------------------------------------- which items

    def takes(self, item: pytest.Item) -> int:
        """The item's concurrency limit if it runs here, else 0."""
        known = item.stash.get(_TAKES_KEY, None)
        if known is None:
            known = item.stash[_TAKES_KEY] = self._limit(item)
        return known if known > 1 else 0

    def _limit(self, item: pytest.Item) -> int:
        limit, why_not = eligibility.limit(item, self.limit)
        if why_not is not None:
            progress.keep(f"smolvm: --smol-concurrency: some guest tests ran one at a time: {why_not}")
        return limit

    # -------------------------------------------------------------- hooks

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None) -> bool | None:
        if not self.takes(item):
            if self.flights:
                self._guarded(lambda: self._drain(item))
            return None
        assert isinstance(item, pytest.Function)
        self._guarded(lambda: self._submit(item, nextitem))
        return True

    @pytest.hookimpl(wrapper=True)
    def pytest_runtestloop(self, session: pytest.Session) -> Generator[None, object, object]:
        try:
            return (yield)
        finally:
            if self.flights:  # the loop ended under us (an error elsewhere): nothing stays in flight
                self._abort()

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[
            None, pytest.TestReport, pytest.TestReport]:
        report = yield
        times = item.stash.get(_TIMES_KEY, None)
        if times is not None and report.when == "call":
            report.start, report.duration = times  # the body's time, not its replay's
            report.stop = report.start + report.duration
        return report

    @pytest.hookimpl(tryfirst=True, optionalhook=True)
    def pytest_timeout_set_timer(self, item: pytest.Item, settings: Any) -> bool | None:
        return True if self.takes(item) else None  # the item's budget is kept by the runner

    @pytest.hookimpl(tryfirst=True, optionalhook=True)
    def pytest_timeout_cancel_timer(self, item: pytest.Item) -> bool | None:
        if not self.takes(item):
            return None
        phase = self._in_phase
        if phase is not None and phase.item is item:
            # pytest-timeout cancels on a failure (pytest_exception_interact): the budget is spent
            # once, and a teardown after a failed setup or call is not bounded, as serially
            phase.deadline = None
        return True

    def pytest_sessionfinish(self) -> None:
        # A guest still being made for a test is the pool's to discard: its close cancels it.
        if self.loop is not None:
            self.loop.close()
            self.loop = None

    # -------------------------------------------------------------- the loop

    def _loop(self) -> asyncio.AbstractEventLoop:
        if self.loop is None:
            import asyncio

            self.loop = asyncio.new_event_loop()
        return self.loop

    def _guarded(self, step: Callable[[], None]) -> None:
        try:
            step()
        except BaseException:
            self._abort()
            raise

    def _run_until(self, done: Callable[[], bool]) -> None:
        import asyncio

        loop = self._loop()
        while not done():
            tasks = {f.task for f in self.flights.values() if f.task is not None}
            if not tasks:
                break
            loop.run_until_complete(asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED))
            if self.failure is not None:
                failure, self.failure = self.failure, None
                raise failure

    def _submit(self, item: pytest.Function, nextitem: pytest.Item | None) -> None:
        key = group_key(item)
        if self.flights and key != self.key:
            self._drain(item)
        self.key = key
        limit = self.takes(item)
        beyond = self.run.pool.ahead.pace.beyond if self.run.used else lambda _limit: 0
        self._run_until(lambda: len(self.flights) < limit + beyond(limit))
        session = item.session
        if session.shouldfail or session.shouldstop:
            self._drain(nextitem)  # a -x failure met while waiting: this one is not started
            return
        flight = _Flight(item, internals.timeout_settings(item))
        self.flights[item] = flight
        flight.task = self._loop().create_task(self._episode(flight))
        if (nextitem is not None and not (session.shouldfail or session.shouldstop)
                and self.takes(nextitem) and group_key(nextitem) == key):
            self.upcoming = nextitem
            self._step()
        else:
            self._drain(nextitem)

    def _step(self) -> None:
        """One turn of the loop: the new task starts (its guest's create begins)."""
        import asyncio

        self._loop().run_until_complete(asyncio.sleep(0))
        if self.failure is not None:
            failure, self.failure = self.failure, None
            raise failure

    def _drain(self, nextitem: pytest.Item | None) -> None:
        self.upcoming, self.final = None, nextitem
        try:
            self._run_until(lambda: not self.flights)
        finally:
            self.final, self.key = None, None

    def _abort(self) -> None:
        """Cancel everything in flight and let each task tear its item down; bounded."""
        import asyncio

        flights = list(self.flights.values())
        for flight in flights:
            flight.interrupted = True
            if flight.task is not None:
                flight.task.cancel()
        tasks = {f.task for f in flights if f.task is not None and not f.task.done()}
        if tasks and self.loop is not None and not self.loop.is_running():
            self.loop.run_until_complete(asyncio.wait(tasks, timeout=ABORT_SECONDS))
        self.flights.clear()
        self.upcoming = self.final = self.key = None
        self.failure = None
        self.slots = Slots()  # tasks that did not unwind in time hold no slot of a later run

    # -------------------------------------------------------------- one item

    async def _episode(self, flight: _Flight) -> None:
        item = flight.item
        finished = False
        try:
            internals.begin_protocol(item)
            await self._provision(flight)
            await self.slots.take(self._loop(), self.takes(item), flight)
            if item.session.shouldfail or item.session.shouldstop:
                return  # a -x failure met while its guest was made ahead: this one is not started
            item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
            holding = time.monotonic()
            if flight.timeout is not None and not flight.timeout.func_only:
                flight.deadline = holding + flight.timeout.timeout  # setup, body and teardown
            report = self._phase(flight, "setup")
            if report.passed:
                capture = flight.detached.capture if flight.detached else None
                assert flight.setup_warnings is not None
                body, started, took = await run_body(item, capture, flight.setup_warnings, flight.timeout,
                                                     flight.deadline, ABORT_SECONDS)
                item.stash[REPLAY_KEY], item.stash[_TIMES_KEY] = body, (started, took)
                # The body ran under the budget (run_body's own timer); its call phase only replays it,
                # and timed again with what was left (nothing, after a timeout) it timed out twice
                self._phase(flight, "call", timed=False)
            self._phase(flight, "teardown", nextitem=self._next_after(item))
            if self.run.used:
                self.run.pool.ahead.pace.held(time.monotonic() - holding)
            finished = True
        except BaseException as exc:
            if isinstance(exc, (KeyboardInterrupt, SystemExit)) or flight.interrupted:
                raise
            # pytest.exit from a phase, or a failure of the runner itself: raised in the main loop
            # (_run_until), not left on the task, where asyncio would log it as never retrieved
            self.failure = exc
        finally:
            if not finished:
                self._teardown_quietly(flight)
            self.slots.free(flight)
            self.flights.pop(item, None)
            if flight.ordered:
                premade.cancel(item, self.run)  # a guest nobody took (the test did not use smol_vm)
            if REPLAY_KEY in item.stash:
                del item.stash[REPLAY_KEY]
            internals.end_protocol(item)
            if finished:
                item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)

    def _next_after(self, item: pytest.Item) -> pytest.Item | None:
        """What teardown may keep set up: a sibling in flight or next in line, else pytest's next."""
        for other in self.flights:
            if other is not item:
                return other
        if self.upcoming is not None:
            return self.upcoming
        if item.session.shouldfail or item.session.shouldstop:
            return None
        return self.final

    async def _provision(self, flight: _Flight) -> None:
        item = flight.item
        if "smol_vm" not in item.fixturenames or self.run.plan is None or self.key not in self.setups:
            return  # the first guest of the run, or of this group: made in its setup, as usual
        loop = self._loop()
        ready = loop.create_future()

        def wake() -> None:
            def settle() -> None:
                if not ready.done():
                    ready.set_result(None)
            try:
                loop.call_soon_threadsafe(settle)
            except RuntimeError:
                pass  # the loop has closed: nobody waits any more

        assert self.key is not None
        flight.ordered = premade.start(item, self.run, self.setups[self.key], wake)
        if not flight.ordered:
            return
        if flight.timeout is not None and not flight.timeout.func_only:
            import asyncio

            # a create that hangs is the setup's to report: it waits for it under the item's budget
            await asyncio.wait({ready}, timeout=flight.timeout.timeout)
        else:
            await ready

    def _phase(self, flight: _Flight, when: Literal["setup", "call", "teardown"], *, timed: bool = True,
               **kwds: Any) -> pytest.TestReport:
        """One phase of ``flight``'s item, as pytest's runner makes it, in the item's own contexts
        (``timed``: within what is left of the item's pytest-timeout budget)."""
        item = flight.item
        if flight.detached is not None:
            attach(item, flight.detached)
            flight.detached = None
        hook = getattr(item.ihook, f"pytest_runtest_{when}")
        self._in_phase = flight
        try:
            with internals.reporting_as(self._worker, self._index(item)), internals.item_warnings(item):
                started = internals.warnings_state()
                phase = functools.partial(hook, item=item, **kwds)
                call = pytest.CallInfo.from_call(lambda: self._bounded(flight, phase) if timed else phase(),
                                                 when=when, reraise=self._reraise)
                report: pytest.TestReport = item.ihook.pytest_runtest_makereport(item=item, call=call)
                item.ihook.pytest_runtest_logreport(report=report)
                if _interactive(call, report):
                    item.ihook.pytest_exception_interact(node=item, call=call, report=report)
                if when == "setup":  # what the body finds: a recorder a fixture entered (recwarn) stays
                    flight.setup_warnings = started, internals.warnings_state()
            return report
        finally:
            self._in_phase = None
            if when == "setup" and self.key is not None and premade.SETUP_KEY in item.stash:
                self.setups.setdefault(self.key, item.stash[premade.SETUP_KEY])
            if when != "teardown":
                flight.detached = detach(item)

    @staticmethod
    def _bounded(flight: _Flight, phase: Callable[[], object]) -> object:
        """``phase()`` within what is left of the item's pytest-timeout budget, if it has one."""
        if flight.deadline is None:
            return phase()
        with internals.timeout_alarm(flight.item, flight.timeout, flight.deadline - time.monotonic()):
            return phase()

    def _index(self, item: pytest.Item) -> int:
        if not self._indices:
            self._indices = {id(each): i for i, each in enumerate(item.session.items)}
        return self._indices[id(item)]

    def _teardown_quietly(self, flight: _Flight) -> None:
        """After an interrupt: the item's finalizers (its fixtures, its guest), no report."""
        item = flight.item
        if flight.detached is not None:
            attach(item, flight.detached)
            flight.detached = None
        if item not in internals.setup_stack(item.session):
            return
        others = [other for other in self.flights if other is not item]
        try:
            internals.teardown_exact(item.session, others[0] if others else None)
        except BaseException as exc:  # the interrupt goes on; the pool destroys what is left
            import warnings

            warnings.warn(pytest.PytestWarning(f"pytest-smolvm: tearing down {item.nodeid} after an "
                                               f"interrupt: {type(exc).__name__}: {exc}"), stacklevel=1)


def _interactive(call: pytest.CallInfo[object], report: pytest.TestReport) -> bool:
    """Whether pytest would call ``pytest_exception_interact`` (--pdb, pytest-timeout's cancel)."""
    if call.excinfo is None or hasattr(report, "wasxfail"):
        return False
    return not isinstance(call.excinfo.value, (pytest.skip.Exception, bdb.BdbQuit))
