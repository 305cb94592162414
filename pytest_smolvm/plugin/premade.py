"""A test's guest made before its setup phase, so that concurrent tests' creates overlap.

Under ``--smol-concurrency`` every test's setup runs on the worker's one event-loop thread,
one setup at a time (pytest's fixture machinery holds one item's state at a time). Making the
guest is the slow part of a guest test's setup, so the concurrent runner (concurrency.py)
starts it earlier, on a thread of its own, while other tests run: :func:`start` computes the
spec exactly as ``smol_vm_factory`` does (the ``smol`` marker, then the
``pytest_smolvm_configure_vm`` hook, called once), and the factory's first plain call takes
the guest with :func:`take` instead of making one. A guest nobody took is released when its
test ends; one still being made when its test is cancelled is released the moment it exists.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import pytest

from pytest_smolvm.session.settings import MarkerSpec, marker_spec

if TYPE_CHECKING:
    from pytest_smolvm.host.threads import KeptThreads
    from pytest_smolvm.session.pool import GuestPool, LiveGuest
    from pytest_smolvm.session.run import SmolRun
    from pytest_smolvm.session.warm import BaselineSetup


def waiting_note(item: pytest.Item) -> Callable[[str], None]:
    """What a test held back by admission control says: a line in ``-v`` output (serial runs;
    an xdist worker has no terminal of its own) and a section of its report."""
    def note(why: str) -> None:
        item.add_report_section("setup", "smolvm admission", f"waited for admission: {why}")
        config = item.config
        terminal = config.pluginmanager.get_plugin("terminalreporter")
        if terminal is not None and config.get_verbosity() > 0 and not hasattr(config, "workerinput"):
            terminal.write_line(f"{item.nodeid}: waiting for admission ({why})")
    return note


def guest_spec(item: pytest.Item, base: MarkerSpec, keywords: Mapping[str, Any]) -> MarkerSpec:
    """The spec of a guest ``item`` asks for: ``base`` with ``keywords``, then the hook's say."""
    spec = base.merged(dict(keywords), "smol_vm_factory")
    proposed = {k: getattr(spec, k) for k in MarkerSpec.__dataclass_fields__}
    item.config.hook.pytest_smolvm_configure_vm(item=item, spec=proposed)
    return MarkerSpec().merged(proposed, "pytest_smolvm_configure_vm")


def _identity(setup: BaselineSetup | None) -> str | None:
    return setup.identity if setup is not None else None


class Premade:
    """One guest being made (or made) for one test, on a thread of its own."""

    def __init__(self, pool: GuestPool, setup: BaselineSetup | None) -> None:
        self.pool = pool
        self.setup_identity = _identity(setup)
        self.done = threading.Event()
        self._lock = threading.Lock()
        self._live: LiveGuest | None = None
        self._error: BaseException | None = None
        self._abandoned = False

    def finish(self, live: LiveGuest | None, error: BaseException | None) -> None:
        with self._lock:
            orphan = live if self._abandoned else None
            if orphan is None:
                self._live, self._error = live, error
        if orphan is not None:
            self.pool.release(orphan)  # its test was cancelled while it was being made
        self.done.set()

    def take(self) -> LiveGuest:
        """The guest, or the exception its creation raised (the test's setup reports it)."""
        self.done.wait()
        with self._lock:
            live, error, self._live, self._error = self._live, self._error, None, None
        if error is not None:
            raise error
        assert live is not None
        return live

    def abandon(self) -> None:
        """Nobody will take the guest: release it now, or the moment it exists."""
        with self._lock:
            self._abandoned = True
            live, self._live = self._live, None
        if live is not None:
            self.pool.release(live)


PREMADE_KEY = pytest.StashKey[Premade]()
_threads: list[KeptThreads] = []  # made with the first premade guest: nothing at plugin load
SETUP_KEY = pytest.StashKey["BaselineSetup | None"]()  # the warm setup the test's factory used


def start(item: pytest.Item, run: SmolRun, setup: BaselineSetup | None,
          on_done: Callable[[], None]) -> Premade | None:
    """Start making ``item``'s ``smol_vm`` guest; None where the fixture should do it itself."""
    try:
        spec = guest_spec(item, marker_spec(item), {})
    except Exception:
        return None  # a bad marker or hook: the fixture meets it again and reports it in setup
    pool = run.pool
    premade = Premade(pool, setup)

    def make() -> None:
        try:
            live = pool.create(item.nodeid, spec, setup, ahead=False, waiting=waiting_note(item))
        except BaseException as exc:  # handed to the test's setup, which reports it as its own
            premade.finish(None, exc)
        else:
            premade.finish(live, None)
        on_done()

    item.stash[PREMADE_KEY] = premade
    if not _threads:
        from pytest_smolvm.host.threads import KeptThreads

        _threads.append(KeptThreads("smolvm-premade"))  # a guest's create: a kept thread when one is idle
    _threads[0].submit(make)
    return premade


def take(item: pytest.Item, keywords: Mapping[str, Any], setup: BaselineSetup | None) -> LiveGuest | None:
    """The guest made ahead for this plain ``smol_vm_factory()`` call, if one was."""
    premade = item.stash.get(PREMADE_KEY, None)
    if premade is None:
        return None
    del item.stash[PREMADE_KEY]
    if keywords or premade.setup_identity != _identity(setup):
        premade.abandon()  # made for another spec: not what this call asked for
        return None
    return premade.take()
