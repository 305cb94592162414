"""The smol backend: every guest is a copy-on-write branch of a warm smolmachines microVM.

A *source* is a running, branchable machine booted once from the baseline (one per distinct
image + resources + network + env); each test's guest is ``source.branch(name)``. A source
cannot be deleted while it has children, so children always go first.

The guest (``smol_guest.py``) and reaping by label (``smol_reap.py``) live beside this module;
it imports ``smol`` only inside functions, so importing it is cheap and changes nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import threading
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from pytest_smolvm import limits
from pytest_smolvm.backends.base import BackendOptions, Guest, ProbeResult, VMSpec
from pytest_smolvm.backends.smol import branch as _smolbranch
from pytest_smolvm.backends.smol import proxy_lookup
from pytest_smolvm.backends.smol.batching import BranchBatcher
from pytest_smolvm.backends.smol.common import (
    DEFAULT_TTL_SECONDS,
    DERIVED,
    IMAGE_ARCHIVE_SUFFIXES,
    LABEL,
    SOURCE_LABEL,
    SOURCE_PREFIX,
    TARGETS,
    OwnedMachine,
    _connect,
    _describe,
    _smol_version,
    cloud_token_source,
    is_retryable,
    provision_error,
)
from pytest_smolvm.backends.smol.guest import SmolGuest, delete_machine, delete_named, read_local_logs
from pytest_smolvm.backends.smol.reap import destroy_recorded, kept_machines, list_owned, owner_alive, reap_unrecorded
from pytest_smolvm.backends.smol.sdk import StartFailed, engine_bounded, remove_fork_lock
from pytest_smolvm.errors import GuestError, ProvisionError, UsageError
from pytest_smolvm.host.paths import state_dir
from pytest_smolvm.host.procs import host_identity, process_start_time

if TYPE_CHECKING:
    from smol import Machine, MachineConfig

    from pytest_smolvm.baselines.baseline import Baseline


@dataclass
class _Source:
    key: str
    name: str  # local: the machine name; cloud: the machine id (what connect and delete take)
    machine: Machine | None
    owned: bool  # False: adopted from the process that outlives us; it deletes it


class SmolBackend:
    """Branches per-test guests from warm sources; deletes children before sources."""

    name: ClassVar[str] = "smol"
    isolation: ClassVar[str] = "microvm"
    branch = _smolbranch.branch  # vm.branch of a guest started branchable=True (smol/branch.py)
    idle_guests_are_free: ClassVar[bool] = False  # a cloud machine is billed; a local one holds its memory

    def __init__(self, options: BackendOptions | None = None, *,
                 ttl_seconds: int | None = DEFAULT_TTL_SECONDS, cpus: int | None = None,
                 memory_mb: int | None = None, ready_timeout: float | None = None) -> None:
        options = options or BackendOptions()
        target, labels = options.target, options.labels
        self._batcher = BranchBatcher()  # concurrent branches of one source: one branch_batch call
        if target not in TARGETS:
            raise UsageError(f"--smol-target={target}: choose local or cloud")
        if target == "cloud" and cloud_token_source() is None:
            raise UsageError("--smol-target=cloud needs a smol cloud API key: set SMOL_CLOUD_TOKEN "
                             "or log in with the smol CLI (smol auth login)")
        self.target = target
        if target == "cloud":
            proxy_lookup.install()  # the SDK's every request reads the environment pytest changes
        # (pid, start time) identifies the owner even after its pid is reused: the reaper's test.
        self.labels = {LABEL: "1", "owner_pid": str(os.getpid()),
                       "owner_start": str(process_start_time(os.getpid())), "owner_host": host_identity(),
                       **dict(labels or {})}
        # derived baseline digest -> the setup that makes it, run in its source before any branch
        self._populate: dict[str, Callable[[SmolGuest], None]] = {}
        self.ttl_seconds = ttl_seconds if target == "cloud" else None  # the local engine ignores TTLs
        # Read now, not bound at import as default arguments: a conftest may replace limits.LIMITS.
        self.default_cpus = cpus if cpus is not None else limits.LIMITS.cpus
        self.default_memory_mb = memory_mb if memory_mb is not None else limits.LIMITS.memory_mb
        self.ready_timeout = ready_timeout if ready_timeout is not None else limits.LIMITS.smol_ready
        self._sources: dict[str, _Source] = {}
        self._children: dict[str, SmolGuest] = {}
        self._kept_sources: set[str] = set()
        self._lock = threading.Lock()
        # Re-entrant: making a source runs the warm-baseline setup in it, which attaches to it.
        self._key_locks: dict[str, threading.RLock] = {}
        self._closed = False
        self._asked = False  # a create or branch was sent: close() looks for ones whose answer was lost
        self._share_source = options.share_source  # set in xdist workers: the controller owns sources
        for key, name in options.shared.items():
            self._sources[key] = _Source(key, name, None, owned=False)

    # ---------------------------------------------------------------- protocol

    @classmethod
    def probe(cls) -> ProbeResult:
        from pytest_smolvm.backends.smol.probe import probe

        return probe()

    @classmethod
    def check_baseline(cls, baseline: Baseline, *, option: str = "--smol-baseline") -> None:
        """What the local engine cannot boot; cloud-only limits are checked when a source is made."""
        if baseline.kind == "image-archive" and baseline.path is not None \
                and not baseline.path.name.endswith(IMAGE_ARCHIVE_SUFFIXES):
            raise UsageError(f"{option}={baseline.reference}: smolmachines reads image archives "
                             f"as {', '.join(IMAGE_ARCHIVE_SUFFIXES)} only (not zstd)")

    @classmethod
    def describe_host(cls) -> list[str]:
        """Header lines: what a smol guest is."""
        return [f"guests are copy-on-write branches of a warm microVM (own kernel; smolmachines {_smol_version()})"]

    def prepare_run(self, baseline: Baseline) -> dict[str, str]:
        """Nothing to boot yet: each source is made on the first request for its spec (here, or
        on a worker's behalf through share_source), so a run that only uses a warm baseline does
        not keep an idle, billed cold source for its whole session."""
        self.check_baseline(baseline)
        return {}

    def share_source(self, spec: VMSpec) -> str:
        """A source a worker asked for: made and owned here, deleted at close after its children."""
        return self._source_for(spec, populate=False).name

    def create(self, spec: VMSpec) -> SmolGuest:
        from smol import SmolError

        if not spec.name:
            raise ProvisionError("smol: a guest needs a unique name (VMSpec.name is empty)")
        source = self._source_for(spec)
        machine = self._source_machine(source)
        self._asked = True
        try:
            with engine_bounded(self.target, ready=self.ready_timeout):
                child = (machine.branch(spec.name, branchable=True) if spec.branchable  # alone (smol/branch.py)
                         else self._batcher.branch(source.name, machine, spec.name,
                                                   lambda extra: delete_machine(extra, extra.name, self.target),
                                                   lambda names: delete_named(names, self.target)))
        except SmolError as exc:
            delete_named([spec.name], self.target)  # answered but never ready: it exists
            raise provision_error(f"smol: could not branch {spec.name} from {source.name}", exc) from exc
        guest = SmolGuest(child, name=spec.name, target=self.target, source=source.name, env=spec.env,
                          on_release=self._release, branchable=spec.branchable)
        with self._lock:
            self._children[spec.name] = guest
        return guest

    def _release(self, guest: SmolGuest, kept: bool) -> None:
        with self._lock:
            self._children.pop(guest.name, None)
            if kept and guest.registry_data()["source"]:
                self._kept_sources.add(str(guest.registry_data()["source"]))

    def destroy_recorded(self, data: Mapping[str, Any]) -> None:
        destroy_recorded(data)

    def close(self) -> None:
        """Delete this process's children, then the sources it owns (never adopted ones)."""
        errors: list[str] = []
        kept = kept_machines()  # kept by any process of this host (an xdist worker, say)
        with self._lock:
            children = list(self._children.values())
            self._children.clear()
            sources = [s for s in self._sources.values() if s.owned and s.name not in self._kept_sources | kept]
            self._sources.clear()
            self._closed = True
        for guest in children:
            try:
                guest.destroy()
            except GuestError as exc:
                errors.append(str(exc))
        self._sweep(kept, errors, sources=False)  # first: a stray child blocks its source's delete
        for source in sources:
            try:
                self._delete_source(source)
            except GuestError as exc:
                errors.append(str(exc))
        self._sweep(kept, errors, sources=True)
        if errors:
            raise GuestError("smol: teardown left machines behind: " + "; ".join(errors))

    def _sweep(self, kept: set[str], errors: list[str], *, sources: bool) -> None:
        """Delete machines labelled as this process's that it never heard of: a create or branch
        whose answer was lost (the cloud made it, then the connection closed) stayed until a
        later run's reaper or its TTL."""
        from smol import SmolError

        if not self._asked:
            return
        try:
            strays = [m for m in list_owned(self.labels, target=self.target)
                      if m.name not in kept and (sources or not m.is_source)]
        except SmolError as exc:
            errors.append(f"listing this process's machines: {_describe(exc)}")
            return
        for machine in strays:
            try:
                destroy_recorded({"name": machine.name, "id": machine.name, "target": self.target})
            except GuestError as exc:
                errors.append(str(exc))

    # ---------------------------------------------------------------- sources

    def source_key(self, spec: VMSpec) -> str:
        """What makes two guests branchable from the same source; stable across processes."""
        identity = {"baseline": spec.baseline.digest, "kind": spec.baseline.kind, "cpus": self._cpus(spec),
                    "memory_mb": spec.memory_mb or self.default_memory_mb, "network": spec.network,
                    "allow_hosts": sorted(spec.allow_hosts), "env": sorted(spec.env.items()),
                    "target": self.target}
        return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]

    def _cpus(self, spec: VMSpec) -> int:
        return max(1, math.ceil(spec.cpus or self.default_cpus))  # the engine takes whole vCPUs

    @classmethod
    def reap_unrecorded(cls) -> list[str]:
        """Machines labelled by us whose owner is gone (see ``smol_reap.reap_unrecorded``)."""
        return reap_unrecorded()

    def derive_baseline(self, baseline: Baseline, key: str, populate: Callable[[Guest], None],
                        scratch_guest: Callable[[Baseline], contextlib.AbstractContextManager[Guest]]) -> Baseline:
        """The warm baseline of a microVM is its source machine: setup runs there, branches inherit it."""
        derived = dataclasses.replace(baseline, reference=f"{baseline.reference}{DERIVED}",
                                      digest=f"sha256:{key}")
        self._populate[derived.digest] = populate
        return derived

    def source_names(self) -> dict[str, str]:
        """key -> machine name (cloud: id) of every source this process owns, for xdist workers."""
        with self._lock:
            return {key: s.name for key, s in self._sources.items() if s.owned}

    def _key_lock(self, key: str) -> threading.RLock:
        with self._lock:
            return self._key_locks.setdefault(key, threading.RLock())

    def _source_for(self, spec: VMSpec, *, populate: bool = True) -> _Source:
        key = self.source_key(spec)
        with self._key_lock(key):
            with self._lock:
                if self._closed:
                    raise ProvisionError("smol: the backend is closed")
                existing = self._sources.get(key)
            if existing is not None:
                return existing
            setup = self._populate.get(spec.baseline.digest) if populate else None
            if self._share_source is not None:
                # An xdist worker: the controller makes and owns the source, so it outlives us;
                # the first worker to need it warm runs the setup in it, once per host.
                source = _Source(key, self._share_source(spec), None, owned=False)
                if setup is not None:
                    self._warm_once(source, spec, setup)
            else:
                source = self._create_source(key, spec)
                if setup is not None:
                    try:
                        setup(self._source_guest_of(source, spec))
                    except BaseException:
                        with contextlib.suppress(GuestError):
                            self._delete_source(source)
                        raise
            with self._lock:
                self._sources[key] = source
            return source

    def _source_guest_of(self, source: _Source, spec: VMSpec) -> SmolGuest:
        return SmolGuest(self._source_machine(source), name=source.name, target=self.target,
                         source=None, env=spec.env, owned=False)

    def _warm_once(self, source: _Source, spec: VMSpec, setup: Callable[[SmolGuest], None]) -> None:
        """Run ``setup`` in a shared source unless another process already did (or failed to)."""
        from filelock import FileLock

        marks = state_dir() / "warm"
        marks.mkdir(parents=True, exist_ok=True)
        done, failed = marks / f"{source.name}.done", marks / f"{source.name}.failed"
        with FileLock(str(marks / f"{source.name}.lock")):
            if failed.exists():
                raise ProvisionError("smol: the baseline setup already failed in another worker: "
                                     + failed.read_text(errors="replace")[:2000])
            if done.exists():
                return
            try:
                setup(self._source_guest_of(source, spec))
            except BaseException as exc:
                failed.write_text(f"{type(exc).__name__}: {exc}")
                raise
            done.write_text("ok")

    def _source_machine(self, source: _Source) -> Machine:
        if source.machine is not None:
            return source.machine
        from smol import Machine, SmolError

        with self._key_lock(source.key):
            if source.machine is None:
                try:
                    source.machine = Machine.connect(source.name, _connect(self.target))
                except SmolError as exc:
                    raise provision_error(f"smol: could not attach to source {source.name} "
                                          "made by another process", exc) from exc
            return source.machine

    def _image(self, baseline: Baseline) -> str | None:
        if baseline.kind == "bundled":
            if self.target == "cloud":
                raise UsageError("--smol-target=cloud needs --smol-baseline=<registry image>: "
                                 "the bundled Alpine rootfs exists only on this host")
            return None
        if baseline.kind == "registry":
            # A warm baseline is the same image plus setup run in its source; the name it is shown
            # by is not an image (and reaches another process only as the Baseline's fields).
            return baseline.reference.removesuffix(DERIVED)
        if self.target == "cloud":
            raise UsageError(f"--smol-baseline={baseline.reference}: smol cloud boots registry images only, "
                             f"not a local {baseline.kind}")
        assert baseline.path is not None
        if baseline.kind == "image-archive":
            self.check_baseline(baseline)
            return str(baseline.path)
        if baseline.kind == "rootfs-tar":
            from pytest_smolvm.baselines.cache import unpack

            # smolmachines boots a rootfs directory but not a plain rootfs tarball.
            return str(unpack(baseline).path)
        return str(baseline.path)  # rootfs-dir or .smolmachine

    def machine_config(self, name: str, key: str, spec: VMSpec) -> MachineConfig:
        """The SDK config of the source for ``spec``: what ``Machine.create`` is given."""
        from smol import MachineConfig, ResourceSpec

        # allow_hosts turns networking on, scoped to the list (types.py:36-49): sending
        # network=False with it would ask for "off" and "these hosts" at once.
        resources = ResourceSpec(cpus=self._cpus(spec), memory_mb=spec.memory_mb or self.default_memory_mb,
                                 network=None if spec.allow_hosts else bool(spec.network),
                                 allow_hosts=list(spec.allow_hosts) or None)
        return MachineConfig(
            name=name, image=self._image(spec.baseline),
            labels={**spec.labels, **self.labels, SOURCE_LABEL: name, "key": key},
            resources=resources, env=dict(spec.env) or None, branchable=True,
            # persistent: another process (an xdist worker) can Machine.connect to it by name.
            persistent=True, ttl_seconds=self.ttl_seconds, ready_timeout_seconds=self.ready_timeout)

    def _create_source(self, key: str, spec: VMSpec) -> _Source:
        from smol import Machine, SmolError

        name = f"{SOURCE_PREFIX}{key[:10]}-{uuid.uuid4().hex[:8]}"
        self._asked = True
        try:
            with engine_bounded(self.target):
                machine = Machine.create(self.machine_config(name, key, spec), _connect(self.target))
        except (SmolError, StartFailed) as exc:
            # The SDK deletes a half-made machine itself; the name is unique so its lock file is ours.
            if self.target == "local":
                remove_fork_lock(name)
            failed = exc.error if isinstance(exc, StartFailed) else exc
            raise provision_error(f"smol: could not {'start' if failed is not exc else 'boot'} source {name} from "
                                  f"{spec.baseline.reference}", failed) from exc
        return _Source(key, machine.id if self.target == "cloud" else name, machine, owned=True)

    def _delete_source(self, source: _Source) -> None:
        """Delete a source, first deleting any children left (by a crashed worker, say)."""
        from smol import SmolError

        try:
            # Children carry their source's labels (the engine copies them on branch).
            for child in list_owned({SOURCE_LABEL: source.name}, target=self.target):
                if child.name != source.name and not child.is_source:
                    destroy_recorded({"name": child.name, "target": self.target})
        except (SmolError, GuestError):
            pass  # the delete below reports what matters
        if source.machine is not None:
            delete_machine(source.machine, source.name, self.target)
        else:
            destroy_recorded({"name": source.name, "target": self.target})
        for mark in (state_dir() / "warm").glob(f"{source.name}.*"):
            mark.unlink(missing_ok=True)


__all__ = ["OwnedMachine", "SmolBackend", "SmolGuest", "cloud_token_source", "destroy_recorded",
           "is_retryable", "kept_machines", "list_owned", "owner_alive", "read_local_logs"]
