"""Guests outside pytest: the plugin's own lifecycle, for training loops and other harnesses.

A :class:`Session` is the same run a pytest process makes (``run.SmolRun``: the plan, the
pool, the host-wide registry and the reaper), configured from keyword arguments instead of
options. Every guest it makes is recorded before it starts and destroyed on every path: by
:meth:`Session.destroy`, when the ``with`` block ends (an exception included), or, if the
owning process is killed, by the reaper of the next run or session on this host, or
``pytest-smolvm reap``::

    from pytest_smolvm import Session

    with Session(baseline="python:3.12-slim") as session:
        for episode in range(100):
            vm = session.create(memory_mb=1024, env={"SEED": str(episode)})
            reward = float(vm.exec("python3 /task/run.py").stdout)
            session.destroy(vm)  # or leave it to the end of the block

``async with Session(...)`` and :meth:`Session.acreate` / :meth:`Session.adestroy` do the same
from asyncio or trio code; each guest's ``vm.aio`` is its async handle.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from pytest_smolvm.errors import ClosedError, UsageError
from pytest_smolvm.handle.vm import VM
from pytest_smolvm.session import branching
from pytest_smolvm.session.run import SmolRun
from pytest_smolvm.session.settings import MarkerSpec, Settings

if TYPE_CHECKING:
    from pytest_smolvm.session.pool import LiveGuest
    from pytest_smolvm.session.warm import BaselineSetup

WORKER = "library"  # the worker name in guest names and records: smol-<run>-library-<n>


class Session:
    """Create and destroy guests without pytest; see the module docstring.

    Keywords are the plugin's options: ``baseline`` (``--smol-baseline``: a registry image, a
    rootfs directory or tarball, a docker-save/OCI archive; default the bundled Alpine rootfs),
    ``backend`` (``auto``, ``smol``, ``namespace``), ``target`` (``local``, ``cloud``), ``keep``
    (``never``, ``always``: guests survive the session for ``pytest-smolvm shell``), ``max_vms``,
    ``user``, ``output_limit``, ``registry_auth``, ``offline``, ``rootdir`` (what relative
    baseline paths are relative to), and ``setup``: shell commands run once per host in a guest
    whose result becomes the baseline every later guest forks from (a warm baseline).
    """

    def __init__(self, *, baseline: str | None = None, backend: str = "auto", target: str = "local",
                 keep: str = "never", max_vms: int | None = None, user: str | int | None = None,
                 output_limit: int | str | None = None, registry_auth: str | None = None, offline: bool = False,
                 rootdir: str | Path | None = None, setup: Sequence[str] = ()) -> None:
        if keep == "failed":
            raise UsageError("Session(keep='failed'): a session has no test outcome; choose never or always")
        settings = Settings.from_keywords(
            "Session", baseline=baseline, backend=backend, target=target, keep=keep, max_vms=max_vms, user=user,
            output_limit=output_limit, registry_auth=registry_auth, offline=offline, rootdir=rootdir)
        if isinstance(setup, str) or not all(isinstance(c, str) for c in setup):
            raise UsageError(f"Session(setup={setup!r}): expected a list of shell commands")
        self._setup = _setup_of(tuple(setup))
        self._run = SmolRun(settings, worker=WORKER)
        self._live: dict[str, LiveGuest] = {}  # this session's guests, by name
        self._lock = threading.Lock()
        self._closed = False

    @property
    def run_id(self) -> str:
        return self._run.run_id

    @property
    def backend(self) -> str | None:
        """The backend the session's one decision chose (None until the first guest)."""
        plan = self._run.plan
        return plan.backend if plan is not None else None

    def create(self, label: str = "", **keywords: Any) -> VM:
        """A fresh guest; ``keywords`` are the ``smol`` marker's (``image``, ``cpus``, ``memory_mb``,
        ``network``, ``allow_hosts``, ``timeout``, ``env``, ``user``, ``output_limit``, ``relax``).

        ``label`` shows in ``pytest-smolvm ls`` where a test id would. Raises ``UsageError`` for
        a bad keyword and ``ProvisionError`` when the backend could not make the guest.
        """
        closed = ClosedError("Session.create: the session is closed")
        if self._closed:
            raise closed
        if not isinstance(label, str) or "\n" in label:
            raise UsageError(f"Session.create: label must be a one-line string, got {label!r}")
        spec = MarkerSpec().merged(keywords, "Session.create")
        try:  # the pool waits, at close, for the creates in flight, and destroys what they made
            live = self._run.pool.create(f"library:{label}" if label else "library", spec, self._setup)
        except ClosedError:
            raise closed from None
        with self._lock:
            if self._closed:  # closed as it returned: the pool's close() has it
                raise closed
            self._live[live.vm.name] = live
        branching.own(live.vm, self._own_child)
        return live.vm

    def _own_child(self, live: LiveGuest) -> None:
        with self._lock:  # a branch of this session's guest: destroyed by destroy() or close()
            self._live[live.vm.name] = live

    def destroy(self, vm: VM) -> None:
        """Destroy ``vm`` (in the background: this returns at once; :meth:`close` waits for it)."""
        if not isinstance(vm, VM):
            raise UsageError(f"Session.destroy: expected a VM this session made, got {vm!r}")
        with self._lock:
            live = self._live.pop(vm.name, None)
        if live is None:
            raise UsageError(f"Session.destroy: {vm.name} is not a live guest of this session")
        if self._run.settings.keep == "always":
            self._run.pool.keep(live)
        else:
            self._run.pool.release(live)

    def close(self, *, keep: bool = False) -> list[str]:
        """Destroy every guest still alive (or keep them, with ``keep=True`` or ``keep='always'``:
        recorded as kept, for ``pytest-smolvm shell`` and ``pytest-smolvm reap --kept``) and end the run.

        Returns the problems met, which were also left to the reaper; never raises, from any
        thread (a create in flight meanwhile ends in ``ClosedError``, its guest destroyed).
        """
        with self._lock:
            first, self._closed = not self._closed, True
            remaining, self._live = list(self._live.values()), {}
        if not first:
            return self._run.close()  # nothing left to do but, on the main thread, the signals
        if remaining and (keep or self._run.settings.keep == "always"):
            try:
                pool = self._run.pool
                for live in remaining:
                    pool.keep(live)
            except Exception as exc:  # the rest are destroyed by the run's close
                problems = [f"keep: {type(exc).__name__}: {exc}"]
                return problems + self._run.finish()
        return self._run.finish()  # destroys what is still alive, ends the run, reaps its leftovers

    def __enter__(self) -> Session:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    # ------------------------------------------------------------------ async

    async def acreate(self, label: str = "", **keywords: Any) -> VM:
        from pytest_smolvm.handle.aio import in_thread

        return await in_thread(lambda: self.create(label, **keywords))

    async def adestroy(self, vm: VM) -> None:
        from pytest_smolvm.handle.aio import in_thread

        await in_thread(lambda: self.destroy(vm))

    async def aclose(self, *, keep: bool = False) -> list[str]:
        from pytest_smolvm.handle.aio import in_thread

        return await in_thread(lambda: self.close(keep=keep))

    async def __aenter__(self) -> Session:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.aclose()


def _setup_of(commands: tuple[str, ...]) -> BaselineSetup | None:
    if not commands:
        return None
    import hashlib

    from pytest_smolvm.session.warm import BaselineSetup

    identity = hashlib.sha256("\0".join(commands).encode()).hexdigest()
    return BaselineSetup(None, commands, identity)
