"""session/ahead.py: the one made-ahead mechanism (issue 43). Its store (orders for the next taker
of a key, or for a named taker), its one cancellation path, and its policy (Pace).

The runs that use it as users do are in test_background.py (the pool's next guests) and
test_concurrency.py (a queued test's own guest); here the store alone, and the pool's use of it.
"""

from __future__ import annotations

import _thread
import threading
import time
from pathlib import Path

import pytest

from pytest_smolvm.session.ahead import Ahead, Pace
from tests.waits import until


class Maker:
    """Makes numbered items, each held back until released: what an order's thread waits on."""

    def __init__(self) -> None:
        self.numbers = iter(range(1, 100))
        self.gate = threading.Event()
        self.discarded: list[int] = []

    def make(self) -> int:
        self.gate.wait(10)
        return next(self.numbers)


def took(ahead: Ahead[int], key: str, taker: object = None) -> int | None:
    order = ahead.take(key, taker)
    return order.made() if order is not None else None


def test_top_up_keeps_depth_items_in_the_making_and_hands_them_out_oldest_first() -> None:
    maker = Maker()
    ahead: Ahead[int] = Ahead(maker.discarded.append)
    ahead.top_up("k", maker.make, 2)
    maker.gate.set()
    first, second = took(ahead, "k"), took(ahead, "k")
    assert {first, second} == {1, 2} and ahead.take("k") is None  # two ordered, no more
    ahead.top_up("k", maker.make, 2)
    ahead.top_up("k", maker.make, 2)  # topping up: still two, not four
    ahead.cancel_all()
    assert sorted(maker.discarded) == [3, 4]


def test_what_was_made_for_another_key_is_discarded() -> None:
    maker = Maker()
    maker.gate.set()
    ahead: Ahead[int] = Ahead(maker.discarded.append)
    ahead.top_up("old", maker.make, 2)
    assert ahead.take("new") is None
    assert sorted(maker.discarded) == [1, 2]
    ahead.top_up("old", maker.make, 2)
    ahead.top_up("new", maker.make, 2)  # a new key cancels the old key's orders first
    assert sorted(maker.discarded) == [1, 2, 3, 4]
    assert {took(ahead, "new"), took(ahead, "new")} == {5, 6}


def test_a_failed_order_for_the_next_taker_is_left_to_the_caller_and_a_named_takers_is_raised() -> None:
    def broken() -> int:
        raise RuntimeError("engine down")

    ahead: Ahead[int] = Ahead(lambda item: None)
    ahead.top_up("k", broken, 1)
    assert took(ahead, "k") is None  # the caller makes its own guest and meets the error then
    ahead.order("k", broken, taker="test_a")
    order = ahead.take("k", "test_a")
    assert order is not None
    with pytest.raises(RuntimeError, match="engine down"):  # the test's setup reports it as its own
        order.outcome()


def test_orders_for_named_takers_and_for_the_next_taker_share_one_store() -> None:
    maker = Maker()
    maker.gate.set()
    ahead: Ahead[int] = Ahead(maker.discarded.append)
    ahead.order("k", maker.make, taker="test_a")
    assert until(lambda: ahead.pending() == 1)
    ahead.top_up("k", maker.make, 1)
    assert took(ahead, "k") == 2  # the next taker's, never test_a's
    assert ahead.take("k", "test_b") is None  # test_b ordered nothing
    assert took(ahead, "k", "test_a") == 1
    ahead.order("k", maker.make, taker="test_c")
    assert ahead.take("other setup", "test_c") is None  # made for another key: discarded,
    assert until(lambda: maker.discarded == [3])  # once made (the taker does not wait for it)


def test_a_guest_ordered_for_a_taker_that_never_takes_it_is_discarded() -> None:
    """Its test ended without using smol_vm (a failed fixture before it): discarded then, not
    kept (alive, holding memory and its admission slot) until the session ends."""
    maker = Maker()
    ahead: Ahead[int] = Ahead(maker.discarded.append)
    ahead.order("k", maker.make, taker="test_a")
    ahead.cancel("test_a")  # still in the making: discarded by its thread the moment it exists
    assert maker.discarded == []
    maker.gate.set()
    assert until(lambda: maker.discarded == [1])
    order = ahead.order("k", maker.make, taker="test_b")
    assert until(lambda: order.job.done)
    ahead.cancel("test_b")  # made already: discarded at once
    ahead.cancel("test_b")  # and once only
    assert maker.discarded == [1, 2] and ahead.pending() == 0


def test_a_taker_interrupted_while_its_guest_is_made_discards_it_the_moment_it_exists() -> None:
    """Ctrl-C or pytest-timeout's alarm during the wait in the test's setup: the guest being made
    for it is nobody's; it was left alive until the session's end (plugin/premade.py's take)."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("an interrupt reaches the main thread only")
    maker = Maker()
    ahead: Ahead[int] = Ahead(maker.discarded.append)
    ahead.order("k", maker.make, taker="test_a")
    order = ahead.take("k", "test_a")
    assert order is not None
    timer = threading.Timer(0.2, _thread.interrupt_main)
    timer.start()
    with pytest.raises(KeyboardInterrupt):
        order.outcome()
    timer.join()
    maker.gate.set()
    assert until(lambda: maker.discarded == [1]), "the guest made for an interrupted taker was kept"


def test_cancel_all_is_bounded_and_what_is_made_after_it_is_discarded() -> None:
    maker = Maker()
    ahead: Ahead[int] = Ahead(maker.discarded.append)
    ahead.order("k", maker.make, taker="test_a")
    ahead.top_up("k", maker.make, 1)
    began = time.monotonic()
    ahead.cancel_all(0.2)
    assert time.monotonic() - began < 5 and maker.discarded == [] and ahead.pending() == 0
    maker.gate.set()
    assert until(lambda: sorted(maker.discarded) == [1, 2])


def test_pace_makes_the_next_guests_only_where_free_and_queues_tests_by_littles_law() -> None:
    class Free:
        idle_guests_are_free = True

    pace = Pace()
    assert pace.next_guests() == 0 and pace.beyond(4) == 0  # nothing decided, nothing measured
    pace.decide(Free, capped=True, workers=1)
    assert pace.next_guests() == 0  # --smol-max-vms counts them
    pace.decide(object, capped=False, workers=1)
    assert pace.next_guests() == 0  # a billed guest (smol cloud)
    pace.made(0.5)
    assert pace.beyond(4) == 0  # no test's hold measured yet
    pace.held(2.0)
    assert pace.beyond(4) == 1  # 4 slots x 0.5 s to make / 2 s held
    pace.made(10.0)
    assert pace.beyond(4) == 4  # never more than the slots


def test_close_during_a_guests_create_for_a_queued_test_leaves_nothing(smol_state: Path) -> None:
    """The pool's close cancels every order, a queued test's too, within its one close_wait:
    the guest still being made is destroyed once it exists, its record removed."""
    from pytest_smolvm.host import registry
    from pytest_smolvm.session.plan import Planner
    from pytest_smolvm.session.pool import GuestPool
    from pytest_smolvm.session.settings import MarkerSpec, Settings

    settings = Settings(backend="namespace")
    planner = Planner(settings, "c" * 32, "main")
    pool = GuestPool(settings, planner, run_id="c" * 32, worker="main")
    pool.plan  # noqa: B018 -- the run's decision first: the order below is only the create
    backend = pool.backend
    release, creating = threading.Event(), threading.Event()
    real_create = backend.create

    def held_create(spec):  # type: ignore[no-untyped-def]
        creating.set()
        release.wait(30)
        return real_create(spec)

    backend.create = held_create  # type: ignore[method-assign]
    taker, made = object(), threading.Event()
    pool.order(taker, "test_queued", MarkerSpec(), None, ready=made.set)
    assert creating.wait(20)
    closer = threading.Thread(target=pool.close)
    closer.start()
    time.sleep(0.2)  # close waits for the create in flight
    release.set()
    closer.join(60)
    assert made.wait(30) and not closer.is_alive()
    assert pool.live == {} and pool.ahead.pending() == 0 and pool.take_ordered(taker, None) is None
    assert list(registry.records()) == []  # (smol_state checks processes, mounts and scratch dirs)
    assert planner.close() == []


def test_a_queued_tests_guest_it_never_takes_is_destroyed_when_it_ends(pytester: pytest.Pytester,
                                                                      smol_state: Path) -> None:
    """Under --smol-concurrency a test's guest is ordered before its setup; a setup that fails
    before smol_vm leaves it untaken: destroyed as that test ends, not kept until the session's."""
    pytester.makepyfile(f"""
        import json, time
        from pathlib import Path
        import pytest

        @pytest.fixture
        def broken(i):
            if i == 2:
                raise RuntimeError("a fixture before smol_vm fails")

        @pytest.mark.parametrize("i", range(4))
        async def test_x(broken, smol_vm, i):
            await smol_vm.aio.exec("true")

        def test_z_untaken_guest_is_gone(smol_vm):  # synchronous: every test_x has ended
            def left():
                found = []
                for path in Path({str(smol_state)!r}, "registry").glob("*.json"):
                    try:
                        found.append(json.loads(path.read_text())["test_id"])
                    except (OSError, ValueError):
                        pass  # being replaced right now
                return [t for t in found if t.endswith("test_x[2]")]
            deadline = time.monotonic() + 10
            while left() and time.monotonic() < deadline:
                time.sleep(0.05)
            assert left() == []
    """)
    result = pytester.runpytest_subprocess("--smol-concurrency=2", "-p", "no:anyio", "-p", "no:randomly")
    result.assert_outcomes(passed=4, errors=1)
