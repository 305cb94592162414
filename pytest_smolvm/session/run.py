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
from types import FrameType
from typing import TYPE_CHECKING, Any

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
            if self._pool is None:
                from pytest_smolvm.session.pool import GuestPool

                self._signals = _signals_to_keyboard_interrupt()
                self._pool = GuestPool(self.settings, planner, run_id=self.run_id, worker=self.worker,
                                       workers=self.workers)
            return self._pool

    @property
    def used(self) -> bool:
        return self._pool is not None

    def install_signals(self) -> None:
        """In the controller: take SIGTERM/SIGHUP once guests exist (from the main thread only)."""
        if not self._signals:
            self._signals = _signals_to_keyboard_interrupt()

    def close_pool(self) -> list[str]:
        pool, self._pool = self._pool, None
        return pool.close() if pool is not None else []

    def close(self) -> list[str]:
        """End of this process's part: its guests, then (in the owner) the run's backend."""
        problems = self.close_pool()
        if self._service is not None:
            self._service.close()
            self._service = None
        if self._planner is not None:
            problems += self._planner.close()
        for sig, handler in self._signals.items():
            signal.signal(sig, handler)
        self._signals = {}
        confined = sys.modules.get("pytest_smolvm.untrusted.confined")  # loaded by a copy or an unpack, if at all
        if confined is not None:
            confined.stop_unpacker()  # a process and a socket: a library session leaves neither behind
        return problems

    def finish(self) -> list[str]:
        """:meth:`close`; then, in the owner, reap what this run's crashed workers or failed destroys left."""
        decided = self.plan is not None
        problems = self.close()
        if decided and not self.is_worker:
            from pytest_smolvm.session.reaper import reap_orphans

            report = reap_orphans()
            problems += [f"{name}: {why}" for name, why in report.failed]
            left = report.left_line()
            if left is not None:
                problems.append(left)
        return problems


def _signals_to_keyboard_interrupt() -> dict[int, Any]:
    """SIGTERM and SIGHUP take the Ctrl-C path, so every finalizer runs."""
    def interrupt(signum: int, _frame: FrameType | None) -> None:
        raise KeyboardInterrupt(f"received {signal.Signals(signum).name}")

    previous: dict[int, Any] = {}
    if threading.current_thread() is not threading.main_thread():
        return previous  # only the main thread may set handlers; whoever owns it decides
    for sig in (signal.SIGTERM, signal.SIGHUP):
        previous[sig] = signal.signal(sig, interrupt)
    return previous
