"""The one small protocol every backend implements: what a guest is and what a backend does.

Fixtures, the VM handle and the session talk to a :class:`Guest` and a :class:`Backend`; nothing
outside ``backends/`` knows how a guest is made. This module knows nothing of pytest or of any one
backend: it may import only ``errors`` and ``limits`` (and ``baselines`` for types).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, ClassVar, Protocol

from pytest_smolvm import limits
from pytest_smolvm.errors import UsageError

if TYPE_CHECKING:
    from pytest_smolvm.baselines.baseline import Baseline


@dataclass(frozen=True)
class ProbeResult:
    """Whether a backend can make guests on this host, and if not, why (one line)."""

    available: bool
    reason: str




@dataclass(frozen=True)
class VMSpec:
    """One guest, resolved: what its backend makes and what its handle applies to every call.

    The pool resolves it once per guest from the run's settings and the test's keywords
    (``session/spec.py``, the one place a fallback is applied); a branch's children are copies
    of their parent's with their own name. Limits are values here, read from ``limits.LIMITS``
    when a spec is made, never bound at import: a conftest that replaces ``LIMITS`` applies.
    ``cpus``/``memory_mb`` left None (a spec made by hand, or ``relax=["limits"]``) mean the
    backend's own default, or none where relaxed.
    """

    name: str
    baseline: Baseline
    cpus: float | None = None
    memory_mb: int | None = None
    # The limits ("cpus", "memory_mb") that are the run's defaults, not the test's: a backend that
    # cannot enforce a limit refuses a guest whose test named it (namespace: its disk follows memory_mb).
    defaulted: tuple[str, ...] = ()
    disk_mb: int = field(default_factory=lambda: limits.LIMITS.disk_mb)
    network: bool = False
    allow_hosts: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    labels: Mapping[str, str] = field(default_factory=dict)
    relax: tuple[str, ...] = ()  # confinement parts turned off for this guest (settings.RELAX_CHOICES)
    branchable: bool = False  # smol: start it so that it can be branched (vm.branch); namespace: always can
    # What the handle applies (backends may ignore them): every call's guest user (None: the
    # image's), the bytes kept per exec stream, and an exec's timeout when the call names none
    # (None: no limit).
    user: str | int | None = None
    output_limit: int = field(default_factory=lambda: limits.LIMITS.output_bytes)
    timeout: float | None = None


def spec_to_json(spec: VMSpec) -> dict[str, Any]:
    """``spec`` as plain JSON (an xdist worker hands it to the controller)."""
    raw = dataclasses.asdict(spec)
    raw["baseline"]["path"] = str(spec.baseline.path) if spec.baseline.path else None
    return raw


def spec_from_json(raw: Mapping[str, Any]) -> VMSpec:
    from pytest_smolvm.baselines.baseline import Baseline

    base = dict(raw["baseline"])
    base["path"] = Path(base["path"]) if base.get("path") else None
    return VMSpec(**{**raw, "baseline": Baseline(**base), "allow_hosts": tuple(raw.get("allow_hosts") or ()),
                     "defaulted": tuple(raw.get("defaulted") or ())})


@dataclass(frozen=True)
class BackendOptions:
    """What the pool tells a backend when it makes one (every backend takes the same).

    ``shared`` is what :meth:`Backend.prepare_run` returned in the process that outlives the
    others (the RunPlan carries it to xdist workers); ``share_source`` asks that process for a
    machine it makes and owns on the worker's behalf (``None`` in that process itself).
    """

    target: str = "local"
    labels: Mapping[str, str] = field(default_factory=dict)
    shared: Mapping[str, str] = field(default_factory=dict)
    share_source: Callable[[VMSpec], str] | None = None


@dataclass(frozen=True)
class EgressAttempt:
    """One destination a guest tried to reach, and whether its allowlist let it; or (protocol
    ``dns``) one name it asked its DNS proxy for, and whether the proxy answered it."""

    address: str  # dns: the name, escaped by the proxy's parser (guest bytes, made inert)
    protocol: str  # "tcp", "udp" or "dns"
    port: int  # dns: 0
    allowed: bool
    connections: int  # new flows (a TCP SYN or a UDP flow's first datagram) to it; dns: queries
    types: str = ""  # dns: the record types asked ("A,AAAA")

    def render(self) -> str:
        verdict = "allowed" if self.allowed else "refused"
        if self.protocol == "dns":
            return f"{verdict} dns {self.address}{' ' + self.types if self.types else ''} ({self.connections}x)"
        if self.address.startswith("("):  # a count of flows past the ledger's bound: no one address
            return f"{verdict} {self.protocol} {self.address} ({self.connections}x)"
        return f"{verdict} {self.protocol} {self.address}:{self.port} ({self.connections}x)"


def egress_counts(rows: Sequence[EgressAttempt]) -> dict[str, int]:
    """A results line's ``egress``: connections allowed and refused, names asked and refused."""
    flows = [a for a in rows if a.protocol != "dns"]
    names = [a for a in rows if a.protocol == "dns"]
    return {"allowed": sum(a.connections for a in flows if a.allowed),
            "refused": sum(a.connections for a in flows if not a.allowed),
            "dns_names": len(names), "dns_refused": sum(1 for a in names if not a.allowed)}


@dataclass(frozen=True)
class GuestExecResult:
    exit_code: int
    stdout: bytes
    stderr: bytes
    timed_out: bool = False
    truncated: tuple[str, ...] = ()  # "stdout"/"stderr": cut at the output limit
    cancelled: bool = False


OutputCallback = Callable[[str, bytes], None]  # ("stdout" | "stderr", chunk), as it arrives


class Cancel:
    """Asks a running guest call to stop; the backend then kills the guest command.

    Thread-safe: ``cancel()`` comes from another thread (an event loop whose task was
    cancelled) while the call runs in its own. Callbacks run once, in the cancelling thread.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cancelled = False
        self._callbacks: list[Callable[[], None]] = []

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    def cancel(self) -> None:
        with self._lock:
            if self._cancelled:
                return
            self._cancelled = True
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback()

    def add(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` on cancel (at once if cancelled already)."""
        with self._lock:
            if not self._cancelled:
                self._callbacks.append(callback)
                return
        callback()

    def remove(self, callback: Callable[[], None]) -> None:
        with self._lock:
            if callback in self._callbacks:
                self._callbacks.remove(callback)


class Guest(Protocol):
    """One live guest, safe to call from several threads at once.

    Methods raise :class:`pytest_smolvm.errors.GuestError` when the guest is gone or broken;
    file operations raise ``OSError`` subclasses (errno, guest path) for the guest's own
    refusals; ``user`` (a name or uid in the guest's /etc/passwd, None for the guest's
    default) raises :class:`pytest_smolvm.errors.GuestUserError` when unknown. A guest may
    have a ``workdir`` attribute (the image's working directory); ``/`` otherwise.
    """

    name: str

    def exec(self, argv: Sequence[str], *, env: Mapping[str, str], workdir: str | None,
             stdin: bytes | None, timeout: float | None, output_limit: int, user: str | None = None,
             on_output: OutputCallback | None = None, cancel: Cancel | None = None) -> GuestExecResult:
        """Run ``argv``; a program that cannot start raises ``OSError`` as ``subprocess`` does."""

    def write_file(self, path: str, data: bytes, mode: int | None, *, user: str | None = None) -> None: ...

    def read_file(self, path: str, *, max_bytes: int | None = None, user: str | None = None) -> bytes:
        """The file's bytes; past ``max_bytes``, ``OSError(EFBIG)``."""

    def put_archive(self, guest_dir: str, produce: Callable[[IO[bytes]], None], *,
                    user: str | None = None) -> None:
        """Extract into ``guest_dir`` the uncompressed tar stream that ``produce`` writes."""

    def get_archive(self, guest_path: str, arcname: str, consume: Callable[[IO[bytes]], None], *,
                    user: str | None = None) -> None:
        """Stream ``guest_path`` (file or tree, as ``arcname``) as a tar to ``consume``.

        A tree's members may instead be named relative to it (``.``, ``./sub``), as a tar
        that cannot rename members writes them. The stream is guest-controlled: ``consume``
        must treat it as hostile.
        """

    def logs(self) -> str: ...

    def egress(self) -> list[EgressAttempt]:
        """Every destination the guest tried to reach so far, allowed or refused; [] where the
        backend keeps no ledger (the smol SDK reports none)."""
        ...

    def keep(self) -> None:
        """Let the guest outlive the process that made it (``--smol-keep``)."""

    def registry_data(self) -> dict[str, Any]:
        """What :meth:`Backend.destroy_recorded` needs to find this guest from another process."""

    def destroy(self) -> None: ...


class Backend(Protocol):
    name: ClassVar[str]
    isolation: ClassVar[str]  # "microvm" or "namespace": shown to users wherever it is used
    # An idle guest costs nothing (no bill, no reserved memory): the pool may make one ahead.
    idle_guests_are_free: ClassVar[bool]

    def __init__(self, options: BackendOptions | None = None) -> None: ...

    @classmethod
    def probe(cls) -> ProbeResult: ...

    @classmethod
    def check_baseline(cls, baseline: Baseline, *, option: str = "--smol-baseline") -> None:
        """Raise UsageError (naming ``option``, as the user wrote it) if this backend cannot use ``baseline``."""

    def prepare_run(self, baseline: Baseline) -> dict[str, str]:
        """Once per run, in the process that outlives the others: make ``baseline`` ready to fork
        from (once per host) and return what every worker's backend gets as ``options.shared``."""

    def share_source(self, spec: VMSpec) -> str:
        """In the process that outlives the others: a machine for ``spec`` that it owns and
        deletes at :meth:`close`; workers branch from it by the name returned."""

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

    def close(self) -> None: ...


class Branching(Protocol):
    """The optional capability to branch a running guest (``vm.branch``; issue 45).

    ``branch(parent, specs)`` makes one child per spec (its name, labels and limits), each
    starting from ``parent``'s state now; afterwards each goes its own way. All or none: on
    an error the backend has destroyed whatever children it made, and raises.
    """

    def branch(self, parent: Guest, specs: Sequence[VMSpec]) -> list[Guest]: ...


def branching(backend: object) -> Branching:
    """``backend`` as a :class:`Branching` backend, or a one-line UsageError saying it is not one."""
    if not callable(getattr(backend, "branch", None)):
        raise UsageError(f"vm.branch: the {getattr(backend, 'name', type(backend).__name__)} backend cannot "
                         "branch a running guest (it has no branch capability)")
    return backend  # type: ignore[return-value]  # checked above: it has the one method
