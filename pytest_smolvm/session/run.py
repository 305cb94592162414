"""What one pytest process knows of its run, and nothing more until a guest is asked for.

Made at configure time, it holds only settings and identities (cheap). The planner (in the
process that outlives the others) or its remote stand-in (in an xdist worker) and this
process's :class:`~pytest_smolvm.session.pool.GuestPool` are made on first use: importing the pool
pulls in the backends, baselines and the registry, which a project without guest tests never
needs.
"""

from __future__ import annotations

import signal
import sys
import threading
import uuid
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING, Any

from pytest_smolvm.errors import ClosedError
from pytest_smolvm.session.settings import Settings

if TYPE_CHECKING:
    from pytest_smolvm.session.handover import PlanService
    from pytest_smolvm.session.plan import Planner, RemotePlanner, RunPlan
    from pytest_smolvm.session.pool import GuestPool




class SmolRun:
    def __init__(self, settings: Settings, *, run_id: str | None = None, worker: str = "main",
                 service_address: str | None = None, workers: int = 1) -> None:
        self.settings = settings
        self.run_id = run_id or uuid.uuid4().hex
        self.worker = worker
        self.workers = workers  # xdist workers in this run (1 when serial)
        self._service_address = service_address  # set in xdist workers
        self._planner: Planner | RemotePlanner | None = None
        self._service: PlanService | None = None
        self._pool: GuestPool | None = None
        self._signals: dict[int, Any] = {}
        self._lock = threading.Lock()
        self._closed = False  # set once, under _lock: no pool is made after it
        # xdist's controller: the guests of each test a crashed worker had (test id -> names),
        # for their results lines (plugin/xdist.py ``Controller.lost_guests``).
        self.crashed_guests: dict[str, list[str]] = {}

    @property
    def is_worker(self) -> bool:
        return self._service_address is not None

    @property
    def planner(self) -> Planner | RemotePlanner:
        with self._lock:
            if self._planner is None:
                from pytest_smolvm.session.plan import Planner, RemotePlanner

                self._planner = (RemotePlanner(self._service_address) if self._service_address
                                 else Planner(self.settings, self.run_id, self.worker))
            return self._planner

    def service_address(self) -> str:
        """The controller's plan service, started on the first worker's configuration (cheap:
        a loopback socket and a thread; the planner and the plan are made when a worker asks)."""
        from pytest_smolvm.session.handover import PlanService

        def answer(request: dict[str, Any]) -> dict[str, Any]:
            from pytest_smolvm.session.plan import Planner, answer

            planner = self.planner
            assert isinstance(planner, Planner)
            return answer(planner, request)

        with self._lock:
            if self._service is None:
                self._service = PlanService(answer)
            return self._service.address

    def workers_all_concurrent(self) -> set[str]:
        """In xdist's controller: the workers that said every test they collected runs concurrently."""
        from pytest_smolvm.session.plan import Planner

        planner = self.planner
        return set(planner.all_concurrent) if isinstance(planner, Planner) else set()

    @property
    def plan(self) -> RunPlan | None:
        """The plan if this process has it already (never triggers the decision)."""
        return self._planner.resolved if self._planner is not None else None

    @property
    def pool(self) -> GuestPool:
        """This process's guests; the first call is where the plugin's work starts."""
        planner = self.planner
        with self._lock:
            if self._closed:
                raise ClosedError("the run is closed: it makes no more guests")
            if self._pool is None:
                from pytest_smolvm.session.pool import GuestPool

                self._signals = _signals_to_keyboard_interrupt(self._is_closed)
                self._pool = GuestPool(self.settings, planner, run_id=self.run_id, worker=self.worker,
                                       workers=self.workers)
            return self._pool

    @property
    def used(self) -> bool:
        return self._pool is not None

    def install_signals(self) -> None:
        """In the controller: take SIGTERM/SIGHUP once guests exist (from the main thread only)."""
        if not self._signals and not self._closed:
            self._signals = _signals_to_keyboard_interrupt(self._is_closed)

    def _is_closed(self) -> bool:
        return self._closed

    def close(self) -> list[str]:
        """End of this process's part: its guests, then (in the owner) the run's backend.

        Callable from any thread, more than once, and never raises: each step runs whatever
        the one before it met, and its problem is returned (a Ctrl-C the pool's close held is
        delivered once every step has run: the run's backend, a cloud source, still goes). The
        signal handlers can be put back only from the main thread: from another, they stay,
        passing every signal to the handler they replaced (the run is closed), until a later
        close() on the main thread.
        """
        with self._lock:
            first, self._closed = not self._closed, True
            pool, self._pool = self._pool, None
            service, self._service = self._service, None
        problems: list[str] = []
        steps: list[Callable[[], list[str] | None]] = []
        if first:
            steps += [lambda: pool.close() if pool is not None else None,
                      lambda: service.close() if service is not None else None,
                      lambda: self._planner.close() if self._planner is not None else None]
        steps += [self._restore_signals, _stop_unpacker]
        interrupted: BaseException | None = None
        for step in steps:
            try:
                problems += step() or []
            except Exception as exc:  # never raises: the next steps still run
                problems.append(f"{type(exc).__name__}: {exc}")
            except BaseException as exc:  # a Ctrl-C held by the pool's close: delivered once all ran
                interrupted = interrupted or exc
        if interrupted is not None:
            raise interrupted
        return problems

    def _restore_signals(self) -> None:
        if self._signals and threading.current_thread() is threading.main_thread():
            signals, self._signals = self._signals, {}
            for sig, handler in signals.items():
                signal.signal(sig, handler)

    def finish(self) -> list[str]:
        """:meth:`close`; then, in the owner, reap what this run's crashed workers or failed destroys left."""
        decided = self.plan is not None
        problems = self.close()
        if decided and not self.is_worker:
            try:
                problems += _reap()
            except Exception as exc:  # never raises, as close()
                problems.append(f"reap: {type(exc).__name__}: {exc}")
        return problems


def _reap() -> list[str]:
    from pytest_smolvm.session.reaper import reap_orphans

    report = reap_orphans()
    problems = [f"{name}: {why}" for name, why in report.failed]
    left = report.left_line()
    return [*problems, left] if left is not None else problems


def _stop_unpacker() -> None:
    confined = sys.modules.get("pytest_smolvm.untrusted.confined")  # loaded by a copy or an unpack, if at all
    if confined is not None:
        confined.stop_unpacker()  # a process and a socket: a library session leaves neither behind


def _signals_to_keyboard_interrupt(closed: Callable[[], bool]) -> dict[int, Any]:
    """SIGTERM and SIGHUP take the Ctrl-C path, so every finalizer runs; once the run is
    ``closed()`` (its handlers not yet put back: closed from another thread) each signal goes
    to the handler it replaced, as if ours were gone."""
    def interrupt(signum: int, frame: FrameType | None) -> None:
        if not closed():
            raise KeyboardInterrupt(f"received {signal.Signals(signum).name}")
        before = previous.get(signum, signal.SIG_DFL)
        if callable(before):
            before(signum, frame)
        elif before == signal.SIG_DFL:  # the default action (SIGTERM's: the process ends)
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)

    previous: dict[int, Any] = {}
    if threading.current_thread() is not threading.main_thread():
        return previous  # only the main thread may set handlers; whoever owns it decides
    for sig in (signal.SIGTERM, signal.SIGHUP):
        previous[sig] = signal.signal(sig, interrupt)
    return previous
