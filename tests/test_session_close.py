"""A Session's end, raced by a training loop: cancelled creates, creates after close, a close
from another thread, and guests whose destroy hangs (issue 43). Nothing may stay recorded live."""

from __future__ import annotations

import asyncio
import dataclasses
import signal
import threading
import time
from pathlib import Path

import pytest

from pytest_smolvm import Session, limits
from pytest_smolvm.backends import backend_class
from pytest_smolvm.errors import ClosedError, UsageError
from pytest_smolvm.host.registry import records
from tests.leaks import assert_host_clean


def _settled(state: Path, timeout: float = 30.0) -> None:
    """Wait for background destroys to end, then check nothing is left."""
    deadline = time.monotonic() + timeout
    while list(records()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert list(records()) == []
    assert_host_clean(state)


def _slow_creates(monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    """Each namespace guest takes ``seconds`` more to make (a busy host, a slow control plane)."""
    cls = backend_class("namespace")
    real = cls.create

    def slow(self: object, spec: object) -> object:
        time.sleep(seconds)
        return real(self, spec)  # type: ignore[arg-type]

    monkeypatch.setattr(cls, "create", slow)


def test_cancelled_acreates_then_the_block_s_end_leave_no_guest_recorded(smol_state: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    async def main() -> None:
        async with Session(backend="namespace") as session:
            await session.acreate("first")  # the plan is made: the next creates are in the backend
            _slow_creates(monkeypatch, 0.5)
            tasks = [asyncio.ensure_future(session.acreate(f"cancelled-{i}")) for i in range(6)]
            await asyncio.sleep(0.2)  # the creates are under way in their threads
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(main())
    assert [r.name for r in records()] == []  # close() waited for the creates in flight...
    time.sleep(1.5)  # ...and none ends later, leaving a guest nobody owns (the slow creates' time, twice)
    assert [r.name for r in records()] == []
    assert_host_clean(smol_state)


def test_a_create_after_close_is_refused_in_one_line(smol_state: Path) -> None:
    session = Session(backend="namespace")
    session.create()
    assert session.close() == []
    with pytest.raises(ClosedError, match=r"^Session.create: the session is closed$") as caught:
        session.create()
    assert isinstance(caught.value, UsageError)  # what it raised before: callers that catch that still do
    with pytest.raises(ClosedError, match="closed"):
        session._run.pool  # noqa: B018  (no new pool behind a closed run's back)
    assert list(records()) == []


def test_creates_racing_close_from_other_threads_leave_nothing(smol_state: Path) -> None:
    session = Session(backend="namespace")
    session.create()  # the plan and baseline are ready: the racing creates are quick
    errors: list[BaseException] = []

    def create() -> None:
        try:
            session.create()
        except ClosedError:
            pass
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=create) for _ in range(8)]
    for t in threads:
        t.start()
    time.sleep(0.02)
    assert session.close() == []
    for t in threads:
        t.join(30)
    assert errors == []
    assert list(records()) == []  # close waited for the creates it raced
    assert_host_clean(smol_state)


def test_branches_racing_close_leave_nothing_and_after_it_are_refused(smol_state: Path) -> None:
    """A guest's children are creates like any other: close() waits for those in flight, and
    what a branch made after close() took the pool's guests is destroyed by the branch itself."""
    session = Session(backend="namespace")
    vm = session.create()
    vm.exec("echo state > /root/f")
    errors: list[BaseException] = []

    def branch() -> None:
        try:
            vm.branch()
        except ClosedError:
            pass
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=branch) for _ in range(6)]
    for t in threads:
        t.start()
    time.sleep(0.05)
    assert session.close() == []
    for t in threads:
        t.join(30)
    assert errors == []
    with pytest.raises(ClosedError, match=rf"^vm.branch: guest {vm.name} is destroyed .*takes no more calls$"):
        vm.branch()
    assert list(records()) == []
    assert_host_clean(smol_state)


def test_close_from_another_thread_never_raises_and_still_reaps(smol_state: Path) -> None:
    before = signal.getsignal(signal.SIGTERM)
    session = Session(backend="namespace")
    session.create()  # on the main thread: the run takes SIGTERM/SIGHUP here
    assert signal.getsignal(signal.SIGTERM) is not before
    outcome: list[object] = []

    async def close_in_a_thread() -> None:
        outcome.append(await session.aclose())  # aclose runs close() on a worker thread

    thread = threading.Thread(target=lambda: asyncio.run(close_in_a_thread()))
    thread.start()
    thread.join(60)
    assert outcome == [[]]
    assert list(records()) == []
    # The handlers could not be put back from that thread: they are, on the main thread's next close.
    session.close()
    assert signal.getsignal(signal.SIGTERM) is before
    assert_host_clean(smol_state)


def test_close_is_bounded_as_a_whole_when_every_destroy_hangs(smol_state: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(limits, "LIMITS", dataclasses.replace(limits.LIMITS, close_wait=1.5))
    session = Session(backend="namespace")
    vms = [session.create() for _ in range(4)]
    release = threading.Event()
    for live in list(session._live.values()):
        real = live.guest.destroy

        def hung(real: object = real) -> None:
            release.wait(30)
            real()  # type: ignore[operator]

        monkeypatch.setattr(live.guest, "destroy", hung)
    started = time.monotonic()
    problems = session.close()
    took = time.monotonic() - started
    release.set()
    # close_wait, then the namespace helper's own 5 s wait to exit (its guests still alive):
    # one destroy after another, it was 4 x the hang (30 s each) before anything gave up.
    assert took < 1.5 + 5 + 2.5, f"close took {took:.1f}s for {len(vms)} hung destroys (close_wait=1.5)"
    assert any("did not end within" in p for p in problems), problems
    _settled(smol_state)
