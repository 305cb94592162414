"""host/threads.py's Workers, the one worker primitive, and what it guarantees (issue 43)."""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from pytest_smolvm.host.threads import Workers
from pytest_smolvm.session.ahead import Ahead


@pytest.fixture
def switching_often() -> Iterator[None]:
    """Thread switches every microsecond: a check-then-act race shows within a few rounds."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(before)


def test_threads_are_bounded_and_calls_past_the_bound_wait_their_turn() -> None:
    workers = Workers("test-bounded-threads", limit=3, idle_seconds=0.5)
    lock = threading.Lock()
    running, peak, finished = [0], [0], []

    def call(i: int) -> int:
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        time.sleep(0.05)
        with lock:
            running[0] -= 1
        finished.append(i)
        return i

    jobs = [workers.start(lambda i=i: call(i)) for i in range(12)]  # type: ignore[misc]
    assert all(job.wait(10) for job in jobs)
    assert [job.outcome() for job in jobs] == list(range(12)) and sorted(finished) == list(range(12))
    assert peak[0] == 3
    assert len([t for t in threading.enumerate() if t.name == "test-bounded-threads"]) <= 3
    assert workers.drain(5)


def test_no_thread_it_starts_takes_the_process_s_signals() -> None:
    workers = Workers("test-signals")
    finished, blocked = workers.run(lambda: signal.pthread_sigmask(signal.SIG_BLOCK, []), 10)
    assert finished and blocked is not None and {signal.SIGINT, signal.SIGTERM, signal.SIGHUP} <= blocked


def test_a_call_its_caller_gave_up_on_hands_what_it_made_to_late() -> None:
    """The cancellation guarantee: a create past its caller's bound is destroyed, not left running."""
    workers = Workers("test-late")
    release = threading.Event()
    cleaned: list[str] = []
    assert workers.run(lambda: release.wait(30) and "guest", 0.1, late=lambda made, _e: cleaned.append(made)) \
        == (False, None)
    release.set()
    assert workers.drain(10) and cleaned == ["guest"]


def test_calls_one_after_another_share_one_thread() -> None:
    workers = Workers("test-reuse")
    idents = {workers.run(threading.get_ident, 10)[1] for _ in range(20)}
    assert len(idents) == 1


class YieldingKey:
    """A key whose comparison lets another thread run (time.sleep(0) drops the GIL), as any key
    compared in Python may: the window between take's check and its pop, made wide."""

    def __eq__(self, other: object) -> bool:
        time.sleep(0)
        return other is self

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    def __hash__(self) -> int:
        return 1


def test_ahead_take_from_many_threads_at_once_never_fails(switching_often: None) -> None:
    """Issue 43: take checked the orders, then popped, without a lock: two threads taking the
    last order both passed the check, and one popped an empty list (IndexError)."""
    made = iter(range(1_000_000))
    ahead: Ahead[int] = Ahead(lambda item: None)
    errors: list[BaseException] = []
    taken: list[int | None] = []
    key = YieldingKey()
    for _ in range(100):
        ahead.top_up(key, lambda: next(made), 2)
        together = threading.Barrier(6)

        def take(together: threading.Barrier = together) -> None:
            together.wait()
            try:
                order = ahead.take(key)
                taken.append(order.made() if order is not None else None)
            except BaseException as exc:  # reported below
                errors.append(exc)

        threads = [threading.Thread(target=take) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert errors == []
    got = [item for item in taken if item is not None]
    assert len(got) == len(set(got)) == 200  # every item made was handed out once, none twice
    ahead.cancel_all(5)
