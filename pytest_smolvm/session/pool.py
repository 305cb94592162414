"""The GuestPool: one per pytest process, it makes, keeps and destroys that process's guests.

Lifecycle rules are written here once, above the backends: a registry record is saved before
a guest starts; provisioning is retried (only provisioning: the test body has not started);
``--smol-max-vms`` slots are held per guest; a destroy is retried, bounded in time, never
interrupted halfway by Ctrl-C and never raises into a test's outcome; whatever is still alive
when the process ends is destroyed by :meth:`GuestPool.close`.

For speed (background.py): a test's guests are destroyed off its path (:meth:`GuestPool.release`),
and where the backend's guests cost nothing idle and every worker has a core, the
next guest is made ahead while the test runs (``ready``). A guest made ahead was never used: it
is what a new one would be, for the same baseline and spec, made a few milliseconds earlier.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from pytest_smolvm import limits
from pytest_smolvm.backends import backend_class
from pytest_smolvm.backends.base import Backend, BackendOptions, EgressAttempt, Guest, VMSpec
from pytest_smolvm.baselines.baseline import Baseline
from pytest_smolvm.errors import GuestError, MarkerError, ProvisionError, SmolVMWarning, UsageError
from pytest_smolvm.handle.vm import VM
from pytest_smolvm.host import procs, registry
from pytest_smolvm.host.signals import signals_deferred
from pytest_smolvm.session import admission, branching, capacity
from pytest_smolvm.session.background import Ahead, Shielded, Teardown, attempts_within
from pytest_smolvm.session.plan import Planner, PlanSource, RunPlan, resolve_baseline
from pytest_smolvm.session.settings import MarkerSpec, Settings
from pytest_smolvm.session.warm import BaselineSetup, WarmBaselines

DESTROY_ATTEMPTS = 2
PROVISION_ATTEMPTS = 3
PROVISION_BACKOFF = 0.2  # seconds, doubled after each retryable failure
READY_TEST_ID = "(made ahead for the next test)"
AHEAD_DEPTH = 2  # guests made ahead at once where there are this many cores per worker


@dataclass
class LiveGuest:
    vm: VM
    record: registry.Record
    guest: Guest  # kept out of the VM's public surface
    provision_seconds: float = 0.0
    destroy_seconds: float = 0.0
    slot: capacity.Slot | None = None
    egress: list[EgressAttempt] = field(default_factory=list)  # read just before it went
    admitted: admission.Slot | None = None  # its place among the guests alive on this host


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
        self._ahead: Ahead[LiveGuest] = Ahead(self.release)
        self._creates = Shielded("smolvm-create")  # the main thread's creates: see _create_once
        self._make_ahead: bool | None = None  # decided on the first guest

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

    def baseline_for(self, image: str | None) -> Baseline:
        """The plan's baseline, or a marker's ``image`` resolved (and checked) once per process."""
        if image is None:
            return self.plan.baseline
        if image not in self._baselines:
            backend = self.plan.backend  # the run's own problems stay UsageErrors: they stop the run
            try:
                self._baselines[image] = resolve_baseline(image, self.settings, backend,
                                                          option="@pytest.mark.smol(image)", run_id=self.run_id)
            except UsageError as exc:  # this test's image: the test errors, the run goes on
                raise MarkerError(str(exc)) from None
        return self._baselines[image]

    def new_name(self) -> str:
        return f"smol-{self.run_id[:8]}-{self.worker}-{next(self._counter)}"

    # ------------------------------------------------------------------ warm baselines

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
        """Record, then create; retry what the backend calls retryable, with backoff.

        ``ahead=False``: make no guest ahead (concurrent tests make theirs at once); ``waiting(why)``
        runs when admission control holds it back. Raises ProvisionError or UsageError (bad spec).
        """
        self.warn_teardown_failures()
        base = self.baseline_for(spec.image)
        if setup:
            base = self.warm_baseline(base, setup)
        started = time.monotonic()
        if not self.makes_ahead:
            return self._create_now(test_id, spec, base, started, waiting)
        key = (base.digest, repr(spec))
        live = self._ahead.take(key)
        if live is not None and not _still_running(live.guest):
            self.release(live)  # it died while it waited (its init killed, OOM): destroyed, not handed out
            live = None
        if live is not None:  # made ahead, idle and free until now: admitted as it starts to count
            alive = self._admission()[0]
            live.admitted = alive.acquire(alive.on_wait(waiting)) if alive is not None else None
            live.record.test_id = test_id
            live.record.save()
            live.provision_seconds = time.monotonic() - started
        else:
            live = self._create_now(test_id, spec, base, started, waiting)
        # After this test's own guest, never before: the two would queue on one engine.
        if ahead:
            self._ahead.start(key, lambda: self._create_once(READY_TEST_ID, spec, base))
        return live

    @property
    def makes_ahead(self) -> bool:
        """Make the next guests during this test? Only where it costs the run nothing (third-party
        backends opt in with ``idle_guests_are_free``).

        The backend's idle guests must be free (a namespace guest is; a smol machine is billed
        or holds memory), no ``--smol-max-vms`` cap may count a guest nobody uses yet, and the
        host must have more than one core and at least one per xdist worker. The guests made
        ahead are work the next tests would do anyway: with a core per worker they fill the
        time the worker waits on its guest (without it the cores sit idle while guests are
        made: docs/performance.md); on one core, or with more workers than cores, they would only
        compete with the tests. With two cores or more per worker, two are made at once: the
        setups overlap on the cores (one at a time left the test waiting: docs/performance.md).
        """
        if self._make_ahead is None:
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
            self._make_ahead = (getattr(backend_class(self.plan.backend), "idle_guests_are_free", False)
                                and not self.settings.max_vms and cores >= max(2, self.workers))
            self._ahead.depth = AHEAD_DEPTH if cores >= AHEAD_DEPTH * self.workers else 1
        return self._make_ahead

    def _admission(self) -> tuple[admission.Gate | None, admission.Gate]:
        """The host-wide gates: guests alive (``--smol-max-vms`` is that bound where given) and
        guests being created at once, sized from what this host can hold."""
        plan = self.plan
        alive, creating = admission.bounds(backend_class(plan.backend), plan.target)
        alive_gate = None if self.settings.max_vms else admission.gate(admission.ALIVE, alive)
        return alive_gate, admission.gate(admission.CREATING, creating)

    def _create_now(self, test_id: str, spec: MarkerSpec, base: Baseline, started: float,
                    waiting: Callable[[str], None] | None = None) -> LiveGuest:
        slot = capacity.acquire(self.settings.max_vms) if self.settings.max_vms else None
        alive, creating = self._admission()
        admitted = alive.acquire(alive.on_wait(waiting)) if alive is not None else None
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
                live.slot, live.admitted = slot, admitted
                return live
        except BaseException:
            if slot is not None:
                slot.release()
            if admitted is not None:
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
        vm_spec = VMSpec(
            name=name, baseline=base, cpus=spec.cpus, memory_mb=spec.memory_mb,
            network=spec.network, allow_hosts=spec.allow_hosts, env=dict(spec.env), relax=spec.relax,
            labels={"pytest-smolvm": "1", "run": self.run_id, "worker": self.worker, "owner_pid": str(os.getpid())},
            branchable=spec.branchable)

        def late(guest: Guest | None, error: BaseException | None) -> None:
            # The caller was interrupted (Ctrl-C, a test timeout) while the backend made the
            # guest: it is still recorded; destroy it as any other, or forget a failed create.
            if guest is None:
                record.remove()
            else:
                self._teardown.submit(self._adopt(record, guest, spec, base))

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
        live = self._adopt(record, guest, spec, base)
        self.live[name] = live
        return live

    def _adopt(self, record: registry.Record, guest: Guest, spec: MarkerSpec, base: Baseline) -> LiveGuest:
        record.data = guest.registry_data()
        record.save()
        plan = self.plan
        vm = VM(guest, default_timeout=spec.timeout, backend=plan.backend, isolation=plan.isolation,
                baseline=base.reference, digest=base.digest,
                user=spec.user if spec.user is not None else self.settings.user,
                output_limit=spec.output_limit or self.settings.output_limit)
        live = LiveGuest(vm, record, guest)
        branching.attach(self, live, spec, base)  # vm.branch(), once an owner takes it
        return live

    def keep(self, live: LiveGuest) -> None:
        """Leave ``live`` running for ``pytest-smolvm shell``; if that fails, destroy it (in the
        background) and raise: a kept guest nobody can enter is a leak."""
        self._note_egress(live)
        try:
            live.guest.keep()
            live.record.data = live.guest.registry_data()  # a kept guest may say more (a shell door)
            live.record.kept = True
            live.record.save()
        except BaseException:
            self.release(live)
            raise
        if live.slot is not None:
            live.slot.release()  # a kept guest no longer counts against this run's cap
            live.slot = None
        if live.admitted is not None:
            live.admitted.release()
            live.admitted = None
        self.live.pop(live.vm.name, None)

    def release(self, live: LiveGuest) -> None:
        """Forget ``live`` now and destroy it in the background (see :meth:`destroy`).

        Its record stays until the destroy is done; a failure is warned about on this
        process's next guest call, or at :meth:`close`.
        """
        started = time.monotonic()
        self._note_egress(live)
        self.live.pop(live.vm.name, None)
        self._teardown.submit(live)
        live.destroy_seconds = time.monotonic() - started  # what the test waited; the rest is off its path

    def destroy(self, live: LiveGuest) -> bool:
        """Destroy and forget; on failure (or past the time bound) warn and leave the record. Never raises."""
        started = time.monotonic()
        self._note_egress(live)
        self.live.pop(live.vm.name, None)
        with signals_deferred():
            error = self._destroy_now(live)
        live.destroy_seconds = time.monotonic() - started
        if error is not None:
            self._warn_not_destroyed(live.vm.name, error)
            return False
        return True

    @staticmethod
    def _note_egress(live: LiveGuest) -> None:
        try:
            live.egress = live.guest.egress()
        except GuestError:
            live.egress = []  # its log says why; a teardown never fails for the ledger

    def _destroy_now(self, live: LiveGuest) -> str | None:
        error = attempts_within(live.guest.destroy, DESTROY_ATTEMPTS, self.destroy_timeout)
        if live.slot is not None:
            live.slot.release()
        if live.admitted is not None:
            live.admitted.release()
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
        """Destroy whatever this process still has alive, then release its own backend.

        Returns the problems met (never raises): the caller turns them into a warning.
        """
        problems: list[str] = []
        wait = limits.LIMITS.close_wait
        deadline = time.monotonic() + wait
        with signals_deferred():  # a second Ctrl-C must not cut the last destroys in half
            # Every wait here is bounded, the signals being held: past close_wait what is still
            # under way is left to the reaper (its records stay).
            self._ahead.cancel(wait)
            if not self._creates.wait(max(0.0, deadline - time.monotonic())):
                problems.append(f"an interrupted create did not end within {wait:g}s: its record stays for the reaper")
            for live in self._teardown.drain(max(0.0, deadline - time.monotonic())):
                problems.append(f"guest {live.vm.name}: its destroy did not end within {wait:g}s: "
                                "its record stays for the reaper")
            for live in list(self.live.values()):
                self.destroy(live)
        self.warn_teardown_failures()
        backend, self._backend = self._backend, None
        if backend is None or (isinstance(self._plans, Planner) and backend is self._plans.backend):
            return problems  # the planner's backend outlives this pool: the planner closes it
        try:
            backend.close()
        except Exception as exc:
            problems.append(f"{type(exc).__name__}: {exc}")
        return problems


def _still_running(guest: Guest) -> bool:
    """Whether a guest made ahead still has its init, and nothing has killed it (one without a
    host pid, a cloud machine, is taken as running: the test's first call would say otherwise).
    An init killed a moment ago can still be there, its SIGKILL pending on a busy host."""
    data = guest.registry_data()
    pid, start = data.get("pid"), data.get("pid_start")
    if not isinstance(pid, int):
        return True
    return procs.is_alive(pid, start if isinstance(start, int) else None) and not procs.is_dying(pid)
