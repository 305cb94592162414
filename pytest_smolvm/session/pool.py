"""The GuestPool: one per pytest process, it makes, keeps and destroys that process's guests.

Lifecycle rules are written here once, above the backends: a registry record is saved before
a guest starts; provisioning is retried (only provisioning: the test body has not started);
``--smol-max-vms`` slots are held per guest; a destroy is retried, bounded in time, never
interrupted halfway by Ctrl-C and never raises into a test's outcome; whatever is still alive
when the process ends is destroyed by :meth:`GuestPool.close`.

For speed: a test's guests are destroyed off its path (:meth:`GuestPool.release`, background.py),
and made ahead of the tests that take them (:attr:`GuestPool.ahead`: session/ahead.py, the one
place that lives).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
import time
import warnings
from collections.abc import Callable, Iterator

from pytest_smolvm import limits
from pytest_smolvm.backends import backend_class
from pytest_smolvm.backends.base import Backend, BackendOptions, Guest, VMSpec
from pytest_smolvm.baselines.baseline import Baseline
from pytest_smolvm.errors import ClosedError, MarkerError, ProvisionError, SmolVMWarning, UsageError
from pytest_smolvm.handle.vm import VM
from pytest_smolvm.host import registry
from pytest_smolvm.host.signals import signals_deferred
from pytest_smolvm.session import admission, branching
from pytest_smolvm.session.ahead import Ahead
from pytest_smolvm.session.background import Shielded, Teardown, attempts_within
from pytest_smolvm.session.live import LiveGuest as LiveGuest  # where plugin/ and evals/ import it from
from pytest_smolvm.session.live import note_egress, still_running
from pytest_smolvm.session.plan import Planner, PlanSource, RunPlan, resolve_baseline
from pytest_smolvm.session.settings import MarkerSpec, Settings
from pytest_smolvm.session.spec import resolve
from pytest_smolvm.session.warm import BaselineSetup, WarmBaselines

DESTROY_ATTEMPTS = 2
PROVISION_ATTEMPTS = 3
PROVISION_BACKOFF = 0.2  # seconds, doubled after each retryable failure
READY_TEST_ID = "(made ahead for the next test)"


class GuestPool:
    """This process's guests, made with the run's plan (asked for on the first guest)."""

    def __init__(self, settings: Settings, plans: PlanSource, *, run_id: str, worker: str, workers: int = 1) -> None:
        self.settings = settings
        self.run_id = run_id
        self.worker = worker
        self.workers = workers  # pytest processes making guests on this host in this run
        self._plans = plans
        self._backend: Backend | None = None
        self._baselines: dict[str | None, Baseline] = {}
        self._warm = WarmBaselines()
        self._lock = threading.Lock()
        self._counter = itertools.count(1)
        self.live: dict[str, LiveGuest] = {}
        self.destroy_timeout = limits.LIMITS.destroy_all_attempts
        self._teardown: Teardown[LiveGuest] = Teardown(self._destroy_now, lambda live: live.vm.name)
        self.ahead: Ahead[LiveGuest] = Ahead(self.release)  # its pace: decided on the first guest, then measured
        self._creates = Shielded("smolvm-create")  # the main thread's creates: see _create_once
        self._life = threading.Condition()  # closed and creating: see create() and close()
        self._closed = False
        self._creating = 0  # create() calls in flight

    # ------------------------------------------------------------------ plan and backend

    @property
    def plan(self) -> RunPlan:
        return self._plans.plan()

    @property
    def backend(self) -> Backend:
        """The run's backend: the planner's own instance in its process, else one made from the plan."""
        plan = self.plan
        with self._lock:
            if self._backend is None:
                if isinstance(self._plans, Planner) and self._plans.backend is not None:
                    self._backend = self._plans.backend
                else:
                    self._backend = backend_class(plan.backend)(BackendOptions(
                        target=plan.target, labels={"run": self.run_id, "worker": self.worker},
                        shared=plan.shared, share_source=self._plans.share_source))
            return self._backend

    def baseline_for(self, image: str | None, option: str = "@pytest.mark.smol(image)") -> Baseline:
        """The plan's baseline, or a marker's ``image`` resolved (and checked) once per process;
        ``option`` is where the test gave it, as its error names it."""
        if image is None:
            return self.plan.baseline
        if image not in self._baselines:
            backend = self.plan.backend  # the run's own problems stay UsageErrors: they stop the run
            try:
                self._baselines[image] = resolve_baseline(image, self.settings, backend,
                                                          option=option, run_id=self.run_id)
            except UsageError as exc:  # this test's image: the test errors, the run goes on
                raise MarkerError(str(exc)) from None
        return self._baselines[image]

    def new_name(self) -> str:
        return f"smol-{self.run_id[:8]}-{self.worker}-{next(self._counter)}"

    def warm_baseline(self, base: Baseline, setup: BaselineSetup) -> Baseline:
        """``base`` after ``setup``, prepared once per host (a failure is remembered, not retried)."""

        @contextlib.contextmanager
        def scratch_guest(baseline: Baseline) -> Iterator[Guest]:
            live = self._create_once("<baseline setup>", MarkerSpec(), baseline)
            try:
                yield live.guest
            finally:
                self.destroy(live)

        return self._warm.prepare(base, setup, self.backend, self.plan, scratch_guest)

    # ------------------------------------------------------------------ guests

    def create(self, test_id: str, spec: MarkerSpec, setup: BaselineSetup | None = None, *,
               ahead: bool = True, waiting: Callable[[str], None] | None = None) -> LiveGuest:
        """Record, then create; retry what the backend calls retryable, with backoff. ``ahead=False``:
        make no guest ahead (concurrent tests make theirs at once); ``waiting(why)`` runs when
        admission holds it back. Raises ProvisionError, UsageError (bad spec) or ClosedError."""
        with self.creating("GuestPool.create") as made:
            made.append(self._create(test_id, spec, setup, ahead, waiting))
        return made[0]

    @contextlib.contextmanager
    def creating(self, what: str) -> Iterator[list[LiveGuest]]:
        """One create in flight (a guest, or a guest's children): refused in one line once the
        pool is closed; ``close()`` waits for it within its deadline. What the caller adds to
        the list is destroyed, and ClosedError raised, if ``close()`` began meanwhile (it took
        what it found; what it missed is the creator's)."""
        with self._life:
            if self._closed:
                raise ClosedError(f"{what}: the pool is closed")
            self._creating += 1
        made: list[LiveGuest] = []
        try:
            yield made
            with self._life:
                closed = self._closed
            if closed:
                for live in made:
                    self.destroy(live)  # (a no-op if close() claimed it first: before its slot was set)
                    live.leave_admission()
                raise ClosedError(f"{what}: the pool was closed while the guest was made")
        finally:
            with self._life:
                self._creating -= 1
                self._life.notify_all()

    def _create(self, test_id: str, spec: MarkerSpec, setup: BaselineSetup | None, ahead: bool,
                waiting: Callable[[str], None] | None) -> LiveGuest:
        self.warn_teardown_failures()
        base = self.baseline_for(spec.image)
        if setup:
            base = self.warm_baseline(base, setup)
        started = time.monotonic()
        if not self.makes_ahead:
            return self._create_now(test_id, spec, base, started, waiting)
        key = (base.digest, repr(spec))
        live = order.made() if (order := self.ahead.take(key)) is not None else None
        if live is not None and not still_running(live.guest):
            self.release(live)  # it died while it waited (its init killed, OOM): destroyed, not handed out
            live = None
        if live is not None:  # made ahead, idle and free until now: admitted as it starts to count
            alive = self._admission()[0]
            live.admitted = alive.acquire(alive.on_wait(waiting))
            live.record.test_id = test_id
            live.record.save()
            live.provision_seconds = time.monotonic() - started
        else:
            live = self._create_now(test_id, spec, base, started, waiting)
        # After this test's own guest, never before: the two would queue on one engine.
        if ahead:
            with self._life:  # never after close() cancelled what was made ahead
                if not self._closed:
                    self.ahead.top_up(key, lambda: self._create_once(READY_TEST_ID, spec, base))
        return live

    @property
    def makes_ahead(self) -> bool:
        """Make the next guests during this test? session/ahead.py's :class:`Pace` decides, once."""
        pace = self.ahead.pace
        if pace.free is None:
            pace.decide(backend_class(self.plan.backend), capped=bool(self.settings.max_vms), workers=self.workers)
        return bool(pace.free)

    def order(self, taker: object, test_id: str, spec: MarkerSpec, setup: BaselineSetup | None, *,
              waiting: Callable[[str], None] | None = None, ready: Callable[[], None] | None = None) -> None:
        """Make ``taker``'s guest now: :meth:`take_ordered` hands it over, ``ahead.cancel`` discards it."""
        self.ahead.order(setup.identity if setup else None, lambda: self.create(
            test_id, spec, setup, ahead=False, waiting=waiting), taker, ready)

    def take_ordered(self, taker: object, setup: BaselineSetup | None) -> LiveGuest | None:
        order = self.ahead.take(setup.identity if setup else None, taker)  # another setup's: discarded
        return order.outcome() if order is not None else None

    def _admission(self) -> tuple[admission.Gate, admission.Gate]:
        """The host-wide gates: guests alive (``--smol-max-vms`` is that bound where given) and
        guests being created at once, sized from what this host can hold."""
        plan = self.plan
        alive, creating = admission.bounds(backend_class(plan.backend), plan.target)
        return (admission.gate(admission.ALIVE, self.settings.max_vms or alive, fixed=bool(self.settings.max_vms)),
                admission.gate(admission.CREATING, creating))

    def _create_now(self, test_id: str, spec: MarkerSpec, base: Baseline, started: float,
                    waiting: Callable[[str], None] | None = None) -> LiveGuest:
        alive, creating = self._admission()
        admitted = alive.acquire(alive.on_wait(waiting))
        try:
            for attempt in range(1, PROVISION_ATTEMPTS + 1):
                try:
                    turn = creating.acquire(creating.on_wait(waiting))
                    try:
                        live = self._create_once(test_id, spec, base)
                    finally:
                        turn.release()
                except ProvisionError as exc:
                    if not exc.retryable or attempt == PROVISION_ATTEMPTS:
                        raise ProvisionError(f"{exc} (attempt {attempt} of {PROVISION_ATTEMPTS})"
                                             if attempt > 1 else str(exc)) from exc
                    time.sleep(PROVISION_BACKOFF * 2 ** (attempt - 1))
                    continue
                live.provision_seconds = time.monotonic() - started
                live.admitted = admitted
                return live
        except BaseException:
            admitted.release()
            raise
        raise AssertionError("unreachable")  # pragma: no cover

    def _create_once(self, test_id: str, spec: MarkerSpec, base: Baseline) -> LiveGuest:
        plan = self.plan
        backend = self.backend
        name = self.new_name()
        record = registry.Record.for_this_process(name, plan.backend, self.run_id, self.worker, test_id)
        reserve = getattr(backend, "reserve", None)  # an optional backend method
        if reserve is not None:
            record.data = reserve(name)
        record.save()
        vm_spec = resolve(self.settings, spec, name=name, baseline=base, labels={
            "pytest-smolvm": "1", "run": self.run_id, "worker": self.worker, "owner_pid": str(os.getpid())})

        def late(guest: Guest | None, error: BaseException | None) -> None:
            # The caller was interrupted (Ctrl-C, a test timeout) while the backend made the
            # guest: it is still recorded; destroy it as any other, or forget a failed create.
            if guest is None:
                record.remove()
            else:
                self._teardown.submit(self._adopt(record, guest, vm_spec))

        try:
            if threading.current_thread() is threading.main_thread():
                guest = self._creates.run(lambda: backend.create(vm_spec), late)
            else:
                guest = backend.create(vm_spec)  # no signal handler runs here: nothing interrupts it
        except UsageError:
            record.remove()
            raise
        except Exception as exc:
            record.remove()
            if not isinstance(exc, ProvisionError):
                raise ProvisionError(f"{type(exc).__name__}: {exc}") from exc
            raise
        live = self._adopt(record, guest, vm_spec)
        self.live[name] = live
        return live

    def _adopt(self, record: registry.Record, guest: Guest, spec: VMSpec) -> LiveGuest:
        record.data = guest.registry_data()
        record.save()
        vm = VM.for_spec(guest, spec, backend=self.plan.backend, isolation=self.plan.isolation)
        live = LiveGuest(vm, record, guest)
        branching.attach(self, live, spec)  # vm.branch(), once an owner takes it
        return live

    def _claim(self, live: LiveGuest, *, destroying: bool = True) -> bool:
        """Take ``live`` out of :attr:`live` for its one teardown; False if another path has it.
        A guest to be destroyed takes no more calls through its handle from here on (a kept one does)."""
        with self._life:
            if live.claimed:
                return False
            live.claimed = True
            if destroying:
                live.vm.retire()
            self.live.pop(live.vm.name, None)
            return True

    def keep(self, live: LiveGuest) -> None:
        """Leave ``live`` running for ``pytest-smolvm shell``; if that fails, destroy it (in the
        background) and raise: a kept guest nobody can enter is a leak."""
        if not self._claim(live, destroying=False):
            return
        note_egress(live)
        try:
            live.guest.keep()
            live.record.data = live.guest.registry_data()  # a kept guest may say more (a shell door)
            live.record.kept = True
            live.record.save()
        except BaseException:
            live.vm.retire()
            self._teardown.submit(live)
            raise
        live.leave_admission()  # a kept guest no longer counts against the host's bound

    def release(self, live: LiveGuest) -> None:
        """Forget ``live`` now and destroy it in the background (see :meth:`destroy`).

        Its record stays until the destroy is done; a failure is warned about on this
        process's next guest call, or at :meth:`close`.
        """
        started = time.monotonic()
        if not self._claim(live):
            return  # already on its way (close() raced its owner)
        note_egress(live)
        self._teardown.submit(live)
        live.destroy_seconds = time.monotonic() - started  # what the test waited; the rest is off its path

    def destroy(self, live: LiveGuest) -> bool:
        """Destroy and forget; on failure (or past the time bound) warn and leave the record. Never raises."""
        started = time.monotonic()
        if not self._claim(live):
            return True  # another path destroys it
        note_egress(live)
        with signals_deferred():
            error = self._destroy_now(live)
        live.destroy_seconds = time.monotonic() - started
        if error is not None:
            self._warn_not_destroyed(live.vm.name, error)
            return False
        return True

    def _destroy_now(self, live: LiveGuest) -> str | None:
        error = attempts_within(live.guest.destroy, DESTROY_ATTEMPTS, self.destroy_timeout)
        live.leave_admission()
        if error is None:
            live.record.remove()
        return error

    def warn_teardown_failures(self) -> None:
        """Warn, on the calling (main) thread, about background destroys that failed so far."""
        for name, error in self._teardown.take_failures():
            self._warn_not_destroyed(name, error)

    @staticmethod
    def _warn_not_destroyed(name: str, error: str) -> None:
        warnings.warn(SmolVMWarning(f"guest {name} could not be destroyed ({error}); its registry record stays: "
                                    "run 'pytest-smolvm reap' to remove it"), stacklevel=3)

    def close(self) -> list[str]:
        """Refuse new creates, wait for those in flight, destroy whatever this process still has
        alive (in parallel), then release its own backend: all of it within one ``close_wait``.

        Returns the problems met (never raises): the caller turns them into a warning. Callable
        from any thread, and more than once.
        """
        problems: list[str] = []
        wait = limits.LIMITS.close_wait
        deadline = time.monotonic() + wait

        def left() -> float:
            return max(0.0, deadline - time.monotonic())

        with self._life:
            self._closed = True
        with signals_deferred():  # a second Ctrl-C must not cut the last destroys in half
            # Every wait here is bounded by the one deadline, the signals being held: past
            # close_wait what is still under way is left to the reaper (its records stay).
            with self._life:
                while self._creating and self._life.wait(left()):
                    pass
                if self._creating:
                    problems.append(f"{self._creating} create(s) still under way after {wait:g}s: each destroys "
                                    "its guest when it ends (or its record stays for the reaper)")
            self.ahead.cancel_all(left())  # every guest made ahead, for a test or for the next
            if not self._creates.wait(left()):
                problems.append(f"an interrupted create did not end within {wait:g}s: its record stays for the reaper")
            for live in list(self.live.values()):
                if self._claim(live):
                    note_egress(live)
                    self._teardown.submit(live)  # in parallel: one hung destroy holds no other
            for live in self._teardown.drain(left()):
                problems.append(f"guest {live.vm.name}: its destroy did not end within {wait:g}s: "
                                "its record stays for the reaper")
        self.warn_teardown_failures()
        backend, self._backend = self._backend, None
        if backend is None or (isinstance(self._plans, Planner) and backend is self._plans.backend):
            return problems  # the planner's backend outlives this pool: the planner closes it
        try:
            backend.close()
        except Exception as exc:
            problems.append(f"{type(exc).__name__}: {exc}")
        return problems
