"""Making and destroying guests, once for every backend: record, create, keep or destroy, forget.

One :class:`SmolSession` per pytest process. It owns the backend instance and every guest
this process made, and guarantees that each one is either destroyed, kept on purpose, or left
with a registry record that a reaper can act on.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import os
import signal
import threading
import time
import uuid
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from pytest_smolvm import baseline as baselines
from pytest_smolvm import capacity, registry
from pytest_smolvm.backends import (
    Backend,
    BackendOptions,
    Guest,
    Selection,
    VMSpec,
    backend_class,
    select_backend,
)
from pytest_smolvm.baseline import Baseline
from pytest_smolvm.errors import ProvisionError, UsageError
from pytest_smolvm.oci import resolve_image
from pytest_smolvm.settings import MarkerSpec, Settings
from pytest_smolvm.vm import VM
from pytest_smolvm.warm import BaselineSetup, BaselineSetupError

DESTROY_ATTEMPTS = 2
PROVISION_ATTEMPTS = 3
PROVISION_BACKOFF = 0.2  # seconds, doubled after each retryable failure
DEFERRED_SIGNALS = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Let a destroy finish before a Ctrl-C (or SIGTERM/SIGHUP) lands; it is delivered right after.

    A second Ctrl-C during teardown must not cut a destroy in half. Destroys take milliseconds,
    so the interrupt is late by that much only.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, DEFERRED_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


class SmolVMWarning(UserWarning):
    """A guest could not be destroyed; its registry record stays for the reaper."""


@dataclass
class LiveGuest:
    vm: VM
    record: registry.Record
    guest: Any  # the backend's Guest; kept out of the VM's public surface
    provision_seconds: float
    kept: bool = False
    destroy_seconds: float = 0.0
    slot: capacity.Slot | None = None
    attempts: int = 1


@dataclass
class SmolSession:
    settings: Settings
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    worker: str = field(default_factory=lambda: os.environ.get("PYTEST_XDIST_WORKER", "main"))

    def __post_init__(self) -> None:
        self.selection: Selection = select_backend(self.settings.backend, self.settings.target)
        self.backend_cls = backend_class(self.selection.name)
        try:
            self.default_baseline: Baseline = self._resolve(self.settings.baseline)
        except UsageError as exc:
            raise UsageError(str(exc).replace("--smol-baseline", self.settings.baseline_option)) from None
        self._baselines: dict[str | None, Baseline] = {None: self.default_baseline}
        self._warm: dict[str, Baseline | BaselineSetupError] = {}
        self._backend: Backend | None = None
        self._lock = threading.Lock()
        self._counter = itertools.count(1)
        self.live: dict[str, LiveGuest] = {}

    # ------------------------------------------------------------------ backend and baselines

    @property
    def backend(self) -> Backend:
        with self._lock:
            if self._backend is None:
                self._backend = self.backend_cls(BackendOptions(
                    target=self.settings.target, labels={"run": self.run_id, "worker": self.worker}))
            return self._backend

    def _resolve(self, reference: str | None) -> Baseline:
        found = baselines.resolve(reference, self.settings.rootdir)
        if found.kind == "registry" and self.selection.name != "smol":  # smol pulls images itself
            found = resolve_image(found.reference, self.settings, run_id=self.run_id)
        self.backend_cls.check_baseline(found)
        return found

    def baseline_for(self, image: str | None) -> Baseline:
        if image not in self._baselines:
            try:
                self._baselines[image] = self._resolve(image)
            except UsageError as exc:
                raise UsageError(str(exc).replace("--smol-baseline", "@pytest.mark.smol(image)")) from None
        return self._baselines[image]

    # ------------------------------------------------------------------ guests

    def new_name(self) -> str:
        return f"smol-{self.run_id[:8]}-{self.worker}-{next(self._counter)}"

    def warm_baseline(self, base: Baseline, setup: BaselineSetup) -> Baseline:
        """``base`` after ``setup``, prepared once per host (a failure is remembered, not retried)."""
        key = hashlib.sha256(f"{base.digest}\0{setup.identity}".encode()).hexdigest()
        known = self._warm.get(key)
        if isinstance(known, BaselineSetupError):
            raise BaselineSetupError(f"the baseline setup already failed in this run: {known}")
        if known is not None:
            return known

        def populate(guest: Guest) -> None:
            vm = VM(guest, backend=self.selection.name, isolation=self.backend_cls.isolation,
                    baseline=base.reference, digest=base.digest)
            try:
                if setup.run_hook is not None:
                    setup.run_hook(vm)
                for command in setup.commands:
                    vm.exec(command, check=True)
            except Exception as exc:
                raise BaselineSetupError(f"{type(exc).__name__}: {exc}\n--- setup transcript\n"
                                         f"{vm.transcript_text()}") from exc

        @contextlib.contextmanager
        def scratch_guest(baseline: Baseline) -> Iterator[Guest]:
            live = self._create_once("<baseline setup>", MarkerSpec(), baseline)
            try:
                yield live.guest
            finally:
                self.destroy(live)

        try:
            warm = self.backend.derive_baseline(base, key, populate, scratch_guest)
        except BaselineSetupError as exc:
            self._warm[key] = exc
            raise
        self._warm[key] = warm
        return warm

    def create(self, test_id: str, spec: MarkerSpec, setup: BaselineSetup | None = None) -> LiveGuest:
        """Record, then create; retry what the backend calls retryable, with backoff.

        Raises ProvisionError (infrastructure) or UsageError (bad spec). Only provisioning is
        retried: the test body has not started yet.
        """
        base = self.baseline_for(spec.image)
        if setup:
            base = self.warm_baseline(base, setup)
        started = time.monotonic()
        slot = capacity.acquire(self.settings.max_vms) if self.settings.max_vms else None
        try:
            for attempt in range(1, PROVISION_ATTEMPTS + 1):
                try:
                    live = self._create_once(test_id, spec, base)
                except ProvisionError as exc:
                    if not exc.retryable or attempt == PROVISION_ATTEMPTS:
                        raise ProvisionError(f"{exc} (attempt {attempt} of {PROVISION_ATTEMPTS})"
                                             if attempt > 1 else str(exc)) from exc
                    time.sleep(PROVISION_BACKOFF * 2 ** (attempt - 1))
                    continue
                live.provision_seconds = time.monotonic() - started
                live.slot, live.attempts = slot, attempt
                return live
        except BaseException:
            if slot is not None:
                slot.release()
            raise
        raise AssertionError("unreachable")  # pragma: no cover

    def _create_once(self, test_id: str, spec: MarkerSpec, base: Baseline) -> LiveGuest:
        name = self.new_name()
        record = registry.Record.for_this_process(name, self.selection.name, self.run_id, self.worker, test_id)
        record.save()
        try:
            backend = self.backend
            guest = backend.create(VMSpec(
                name=name, baseline=base, cpus=spec.cpus, memory_mb=spec.memory_mb,
                network=spec.network, allow_hosts=spec.allow_hosts, env=dict(spec.env),
                labels={"pytest-smolvm": "1", "run": self.run_id, "worker": self.worker,
                        "owner_pid": str(os.getpid())}))
        except UsageError:
            record.remove()
            raise
        except BaseException as exc:
            record.remove()
            if isinstance(exc, Exception) and not isinstance(exc, ProvisionError):
                raise ProvisionError(f"{type(exc).__name__}: {exc}") from exc
            raise
        record.data = guest.registry_data()
        record.save()
        vm = VM(guest, default_timeout=spec.timeout, backend=self.selection.name,
                isolation=backend.isolation, baseline=base.reference, digest=base.digest)
        live = LiveGuest(vm, record, guest, 0.0)
        self.live[name] = live
        return live

    def keep(self, live: LiveGuest) -> None:
        if live.slot is not None:
            live.slot.release()  # a kept guest no longer counts against this run's cap
        live.guest.keep()
        live.kept = True
        live.record.kept = True
        live.record.save()
        self.live.pop(live.vm.name, None)

    def destroy(self, live: LiveGuest) -> bool:
        """Destroy and forget; on failure warn and leave the record. Never raises."""
        self.live.pop(live.vm.name, None)
        started = time.monotonic()
        error: BaseException | None = None
        with signals_deferred():
            for _attempt in range(DESTROY_ATTEMPTS):
                try:
                    live.guest.destroy()
                    error = None
                    break
                except Exception as exc:  # a failed destroy must never replace the test's outcome
                    error = exc
            if live.slot is not None:
                live.slot.release()
        live.destroy_seconds = time.monotonic() - started
        if error is not None:
            warnings.warn(SmolVMWarning(
                f"guest {live.vm.name} could not be destroyed ({type(error).__name__}: {error}); "
                "its registry record stays: run 'pytest-smolvm reap' to remove it"), stacklevel=2)
            return False
        live.record.remove()
        return True

    def close(self) -> None:
        """Destroy whatever this process still has alive, then release the backend."""
        for live in list(self.live.values()):
            self.destroy(live)
        if self._backend is not None:
            self._backend.close()
            self._backend = None

    # ------------------------------------------------------------------ xdist handoff and reaping

    def shared_state(self) -> dict[str, str]:
        return self.backend.shared_state(self.default_baseline)

    def adopt_shared_state(self, state: Mapping[str, str]) -> None:
        if state:
            self.backend.adopt_shared_state(state)

    def reap(self) -> registry.ReapReport:
        """What dead owners left: registry records first, then the backend's own leftovers."""
        report = reap_orphans()
        try:
            report.removed += self.backend_cls.reap_unrecorded()
        except Exception as exc:  # the engine may be unusable here; the registry part still counts
            report.failed.append((self.selection.name, f"{type(exc).__name__}: {exc}"))
        return report


def destroy_record(record: registry.Record) -> None:
    backend_class(record.backend)().destroy_recorded(record.data)


def reap_orphans(*, include_kept: bool = False, names: Mapping[str, object] | None = None) -> registry.ReapReport:
    """Remove guests whose owner process is gone (``names`` narrows it to those names)."""
    def select(record: registry.Record) -> bool:
        if names is not None and record.name not in names:
            return False
        return registry.orphaned(record, include_kept=include_kept)

    return registry.reap(select, destroy_record)
