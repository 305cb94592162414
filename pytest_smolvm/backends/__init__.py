"""The one small protocol every backend implements, and the one place that picks a backend.

Fixtures and the VM handle talk to a :class:`Guest`; the session talks to a :class:`Backend`.
Nothing outside ``backends/`` knows how a guest is made.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import IO, TYPE_CHECKING, Any, ClassVar, Protocol

from pytest_smolvm.errors import UsageError

if TYPE_CHECKING:
    from pytest_smolvm.baseline import Baseline

ENTRY_POINT_GROUP = "pytest_smolvm.backends"
BUILTIN_BACKENDS = {
    "namespace": "pytest_smolvm.backends.namespace:NamespaceBackend",
    "smol": "pytest_smolvm.backends.smol:SmolBackend",
}


@dataclass(frozen=True)
class VMSpec:
    """Everything a backend needs to make one guest; resolved from marker, CLI, ini and defaults."""

    name: str
    baseline: Baseline
    cpus: float | None = None
    memory_mb: int | None = None
    disk_mb: int = 2048
    network: bool = False
    allow_hosts: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    labels: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class BackendOptions:
    """What the session tells a backend when it makes one (every backend takes the same)."""

    target: str = "local"
    labels: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class GuestExecResult:
    exit_code: int
    stdout: bytes
    stderr: bytes
    timed_out: bool = False


@dataclass(frozen=True)
class ProbeResult:
    available: bool
    reason: str


class Guest(Protocol):
    """One live guest. Methods raise :class:`pytest_smolvm.errors.GuestError` on failure."""

    name: str

    def exec(self, argv: Sequence[str], *, env: Mapping[str, str], workdir: str | None,
             stdin: bytes | None, timeout: float | None, output_limit: int) -> GuestExecResult: ...

    def write_file(self, path: str, data: bytes, mode: int | None) -> None: ...

    def read_file(self, path: str) -> bytes: ...

    def put_archive(self, guest_dir: str, produce: Callable[[IO[bytes]], None]) -> None:
        """Extract into ``guest_dir`` the uncompressed tar stream that ``produce`` writes."""

    def get_archive(self, guest_path: str, arcname: str, consume: Callable[[IO[bytes]], None]) -> None:
        """Stream ``guest_path`` (file or tree, as ``arcname``) as a tar to ``consume``.

        The stream is guest-controlled: ``consume`` must treat it as hostile.
        """

    def logs(self) -> str: ...

    def keep(self) -> None:
        """Let the guest outlive the process that made it (``--smol-keep``)."""

    def registry_data(self) -> dict[str, Any]:
        """What :meth:`Backend.destroy_recorded` needs to find this guest from another process."""

    def destroy(self) -> None: ...


class Backend(Protocol):
    name: ClassVar[str]
    isolation: ClassVar[str]  # "microvm" or "namespace": shown to users wherever it is used

    def __init__(self, options: BackendOptions | None = None) -> None: ...

    @classmethod
    def probe(cls) -> ProbeResult: ...

    @classmethod
    def check_baseline(cls, baseline: Baseline) -> None:
        """Raise UsageError (naming --smol-baseline) if this backend cannot use ``baseline``."""

    def prepare(self, baseline: Baseline) -> None:
        """Make ``baseline`` ready to fork from, once per host (the caller holds no lock)."""

    def create(self, spec: VMSpec) -> Guest: ...

    def derive_baseline(self, baseline: Baseline, key: str, populate: Callable[[Guest], None],
                        scratch_guest: Callable[[Baseline], AbstractContextManager[Guest]]) -> Baseline:
        """A warm baseline: ``baseline`` after ``populate`` ran in a guest, once per host per ``key``.

        ``scratch_guest`` makes a recorded guest (destroyed on exit) for backends that capture
        a guest's filesystem; backends whose baseline is a live machine run ``populate`` there.
        """

    def destroy_recorded(self, data: Mapping[str, Any]) -> None:
        """Destroy a guest known only by its registry record (reaper, ``pytest-smolvm reap``)."""

    @classmethod
    def reap_unrecorded(cls) -> list[str]:
        """Remove what this backend made outside the registry (e.g. baseline machines) for dead owners."""

    def shared_state(self, baseline: Baseline) -> dict[str, str]:
        """In the process that outlives the others: what xdist workers must adopt (may prepare)."""

    def adopt_shared_state(self, state: Mapping[str, str]) -> None:
        """In a worker: use what :meth:`shared_state` handed over instead of making its own."""

    def close(self) -> None: ...


def backend_class(name: str) -> type[Backend]:
    """The class registered for ``name``: built in, or from the ``pytest_smolvm.backends`` group."""
    target = BUILTIN_BACKENDS.get(name)
    if target is None:
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            if ep.name == name:
                cls: type[Backend] = ep.load()
                return cls
        known = sorted({*BUILTIN_BACKENDS, *(ep.name for ep in entry_points(group=ENTRY_POINT_GROUP))})
        raise UsageError(f"--smol-backend={name}: unknown backend (choose auto, {', '.join(known)})")
    module_name, _, attr = target.partition(":")
    found: type[Backend] = getattr(importlib.import_module(module_name), attr)
    return found


@dataclass(frozen=True)
class Selection:
    name: str
    reason: str


def select_backend(requested: str, target: str = "local",
                   probe: Callable[[], ProbeResult] | None = None) -> Selection:
    """Decide which backend runs, and say why. ``auto`` prefers a real microVM."""
    if requested != "auto":
        if requested == "smol" and target == "local":
            result = (probe or _probe_smol)()
            if not result.available:
                raise UsageError(f"--smol-backend=smol: no microVM boots on this host: {result.reason} "
                                 "(run 'pytest-smolvm doctor' for the fix)")
        return Selection(requested, f"--smol-backend={requested} was asked for")
    if target == "cloud":
        return Selection("smol", "--smol-target=cloud runs microVMs on smol cloud")
    result = (probe or _probe_smol)()
    if result.available:
        return Selection("smol", "a microVM booted on this host")
    return Selection("namespace", f"no microVM boots on this host ({result.reason}); "
                                  "namespace isolation shares the host kernel")


def _probe_smol() -> ProbeResult:
    try:
        smol = backend_class("smol")
    except (ImportError, AttributeError) as exc:
        return ProbeResult(False, f"the smol backend is not available: {exc}")
    return smol.probe()
