"""Work off the test's path: destroys handed to a background thread, and the next guest made ahead.

Run as users run: pytester subprocesses on the namespace backend, with the smol_state fixture
checking that nothing (guest, mount, scratch dir, cgroup, record) is left after each run.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pytest_smolvm.session.ahead import Ahead
from pytest_smolvm.session.background import Bounded, Teardown
from pytest_smolvm.session.pool import READY_TEST_ID
from tests.waits import until

CORES = len(os.sched_getaffinity(0))

RECORDS = """
import json, time
from pathlib import Path

STATE = {state!r}
READY = {ready!r}


def records():
    found = {{}}
    for path in Path(STATE, "registry").glob("*.json"):
        try:
            found[path.stem] = json.loads(path.read_text())
        except (OSError, ValueError):
            pass  # being replaced right now
    return found


def made_ahead(wait):
    deadline = time.monotonic() + wait
    while True:
        ready = sorted(name for name, r in records().items() if r["test_id"] == READY)
        if ready or time.monotonic() > deadline:
            return ready
        time.sleep(0.02)
"""


@pytest.fixture
def cores(request: pytest.FixtureRequest) -> Iterator[int]:
    """This process (and so the pytest it starts) on ``request.param`` CPUs."""
    before = os.sched_getaffinity(0)
    if len(before) < request.param:
        pytest.skip(f"needs {request.param} CPUs")
    os.sched_setaffinity(0, sorted(before)[:request.param])
    try:
        yield request.param
    finally:
        os.sched_setaffinity(0, before)


@pytest.mark.skipif(CORES < 2, reason="a guest is made ahead only where the host has more than one core")
def test_the_next_guests_are_made_ahead_fresh_and_taken_by_the_next_test(pytester: pytest.Pytester,
                                                                       smol_state: Path) -> None:
    pytester.makepyfile(RECORDS.format(state=str(smol_state), ready=READY_TEST_ID) + """
import pytest

seen = {}


def test_a(smol_vm):
    smol_vm.exec("echo dirty > /root/mark; sleep 1000 >/dev/null 2>&1 &")
    deadline = time.monotonic() + 10
    while len(made_ahead(wait=0)) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    seen["ahead"] = made_ahead(wait=0)
    assert len(seen["ahead"]) == 2, seen  # two cores or more per worker: two made at once
    assert smol_vm.name not in seen["ahead"]


def test_b(smol_vm):
    assert smol_vm.name in seen["ahead"]
    assert records()[smol_vm.name]["test_id"].endswith("::test_b")  # taken: no longer "made ahead"
    assert smol_vm.exec("test -e /root/mark").exit_code == 1
    assert "sleep 1000" not in smol_vm.exec("ps -o args").stdout
    assert smol_vm.exec("hostname").stdout.strip() == smol_vm.name
    seen["b"] = smol_vm.name


@pytest.mark.smol(env={"OTHER": "spec"})
def test_c_another_spec_does_not_get_a_guest_made_for_the_default(smol_vm):
    assert smol_vm.name not in made_ahead(wait=0) and smol_vm.exec("echo $OTHER").stdout == "spec\\n"
    """)
    result = pytester.runpytest_subprocess("-p", "no:randomly")
    result.assert_outcomes(passed=3)


@pytest.mark.parametrize(("cores", "args"), [(1, []), (2, ["-n", "3"])], indirect=["cores"],
                         ids=["serial-on-one-core", "three-workers-on-two-cores"])
def test_nothing_is_made_ahead_without_a_core_per_worker(pytester: pytest.Pytester, smol_state: Path, cores: int,
                                                         args: list[str]) -> None:
    pytester.makepyfile(RECORDS.format(state=str(smol_state), ready=READY_TEST_ID) + """
import pytest


@pytest.mark.parametrize("i", range(2))
def test_a(smol_vm, i):
    assert made_ahead(wait=1) == []
    """)
    pytester.runpytest_subprocess(*args).assert_outcomes(passed=2)


@pytest.mark.parametrize("cores", [2], indirect=True)
def test_each_worker_makes_its_next_guest_ahead_with_a_core_each(pytester: pytest.Pytester, smol_state: Path,
                                                                 cores: int) -> None:
    pytester.makepyfile(RECORDS.format(state=str(smol_state), ready=READY_TEST_ID) + """
import os
import pytest


@pytest.mark.parametrize("i", range(2))
def test_a(smol_vm, i):
    worker = os.environ["PYTEST_XDIST_WORKER"]  # in every guest name the worker makes
    deadline = time.monotonic() + 10
    while not any(worker in name for name in made_ahead(wait=0)) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert any(worker in name for name in made_ahead(wait=0)), made_ahead(wait=0)
    """)
    pytester.runpytest_subprocess("-n", "2", "--dist", "each").assert_outcomes(passed=4)


def test_nothing_is_made_ahead_under_a_vm_cap(pytester: pytest.Pytester, smol_state: Path) -> None:
    pytester.makepyfile(RECORDS.format(state=str(smol_state), ready=READY_TEST_ID) + """
def test_a(smol_vm):
    assert made_ahead(wait=1) == []
    """)
    pytester.runpytest_subprocess("--smol-max-vms=4").assert_outcomes(passed=1)


def test_a_failing_run_leaves_nothing_made_ahead_or_handed_off(pytester: pytest.Pytester, smol_state: Path) -> None:
    # smol_state checks after the run: no record, scratch dir, mount or guest process is left.
    pytester.makepyfile(RECORDS.format(state=str(smol_state), ready=READY_TEST_ID) + """
import pytest


@pytest.mark.parametrize("i", range(6))
def test_fails(smol_vm, i):
    smol_vm.exec("sleep 1000 >/dev/null 2>&1 &")
    assert i % 2
    """)
    pytester.runpytest_subprocess().assert_outcomes(passed=3, failed=3)


def test_bounded_calls_share_one_kept_thread() -> None:
    """A thread start per destroy was ~0.15 ms of CPU a guest: the runner keeps its thread."""
    bounded = Bounded("test-bounded")
    first, second = bounded.run(threading.get_ident, 10), bounded.run(threading.get_ident, 10)
    assert first[0] and second[0] and first[1] == second[1] != threading.get_ident()


def test_bounded_raises_what_the_call_raised_and_keeps_serving() -> None:
    bounded = Bounded("test-bounded")
    before = bounded.run(threading.get_ident, 10)

    def broken() -> None:
        raise RuntimeError("engine down")

    with pytest.raises(RuntimeError, match="engine down"):
        bounded.run(broken, 10)
    assert bounded.run(threading.get_ident, 10) == before


def test_a_bounded_call_past_its_bound_is_left_to_its_thread_and_the_next_gets_a_new_one() -> None:
    bounded = Bounded("test-bounded")
    release = threading.Event()
    stuck_thread: list[threading.Thread] = []

    def hang() -> str:
        stuck_thread.append(threading.current_thread())
        release.wait(30)
        return "late"

    assert bounded.run(hang, 0.2) == (False, None)
    finished, ident = bounded.run(threading.get_ident, 10)
    assert finished and ident != stuck_thread[0].ident  # not queued behind the stuck call
    release.set()
    # Once free, the stuck thread is idle again, kept as any other (host/threads.py's Workers),
    # not ended: a later call may run on it.
    assert bounded.run(threading.get_ident, 10)[0]
    assert stuck_thread[0].is_alive()


def test_close_waits_a_bounded_time_for_a_create_and_a_destroy_that_hang() -> None:
    """close() holds Ctrl-C while it waits, so each wait has a bound; what overruns it is still
    discarded (or destroyed) by its own thread once it ends."""
    release = threading.Event()
    discarded: list[str] = []
    ahead: Ahead[str] = Ahead(discarded.append)
    ahead.top_up("key", lambda: release.wait(30) and "late guest", 1)  # type: ignore[arg-type, return-value]
    teardown: Teardown[str] = Teardown(lambda item: None if release.wait(30) else "hung", str)
    teardown.submit("stuck guest")
    began = time.monotonic()
    ahead.cancel_all(0.3)
    left = teardown.drain(0.3)
    assert time.monotonic() - began < 5
    assert left == ["stuck guest"] and discarded == []
    release.set()
    assert teardown.drain(10) == []
    deadline = time.monotonic() + 10
    while not discarded and time.monotonic() < deadline:
        time.sleep(0.01)
    assert discarded == ["late guest"]  # made after the bound, discarded by the thread that made it


def test_destroys_that_queue_up_run_side_by_side_and_a_serial_run_keeps_one_thread() -> None:
    """Under --smol-concurrency a worker ends many tests at once: one teardown thread destroying
    them one by one fell behind (the guests stayed alive, holding their admission slots)."""
    made: list[str] = []

    def started_threads() -> set[int | None]:
        return {t.ident for t in threading.enumerate() if t.name == "smolvm-teardown"}

    before = started_threads()

    def record(item: str) -> None:
        made.append(item)

    serial: Teardown[str] = Teardown(record, str)
    for i in range(5):  # each destroy is done before the next is handed off: one thread does all
        serial.submit(f"guest {i}")
        assert serial.drain(10) == []
    assert made == [f"guest {i}" for i in range(5)] and len(started_threads() - before) == 1

    together = threading.Barrier(4, timeout=10)
    broken: list[str] = []

    def destroy(item: str) -> str | None:
        try:
            together.wait()  # returns only once four destroys are under way at the same time
        except threading.BrokenBarrierError:
            broken.append(item)
            return "waited alone"
        return None

    concurrent: Teardown[str] = Teardown(destroy, str, threads=4)
    for i in range(8):
        concurrent.submit(f"guest {i}")
    assert concurrent.drain(30) == [] and broken == [] and concurrent.take_failures() == []


def test_aio_calls_reuse_kept_threads_and_grow_only_while_all_are_busy() -> None:
    """A thread started per call made the event loop's thread wait for each new thread to run:
    milliseconds per call under --smol-concurrency, on the thread every test in flight shares."""
    import asyncio

    from pytest_smolvm.handle.aio import in_thread
    from pytest_smolvm.host.threads import Workers

    async def one_after_another() -> list[threading.Thread]:
        return [await in_thread(threading.current_thread) for _ in range(10)]

    ran_on = asyncio.run(one_after_another())  # the Thread objects stay referenced: none is reused
    # A call's result reaches the loop only once its thread counts itself idle again, so the
    # next call always finds that thread idle, however loaded the host.
    assert len({id(thread) for thread in ran_on}) == 1

    kept = Workers("test-kept", idle_seconds=0.2)
    together = threading.Barrier(5, timeout=10)
    passed: list[bool] = []
    for _ in range(5):  # five calls that each wait for the other four: five threads at once
        kept.submit(lambda: passed.append(together.wait() >= 0))
    assert until(lambda: len(passed) == 5)
    assert until(lambda: not [t for t in threading.enumerate() if t.name == "test-kept"])  # idle ones end
    kept.submit(lambda: passed.append(True))  # and a later call starts a thread again
    assert until(lambda: len(passed) == 6)


FREEZER = Path("/sys/fs/cgroup/freezer")


@pytest.mark.skipif(CORES < 2, reason="a guest is made ahead only where the host has more than one core")
def test_a_guest_made_ahead_and_killed_is_not_handed_out_while_it_dies(smol_state: Path) -> None:
    # A killed init can be there for a while, its SIGKILL pending (on a busy CI host, it was:
    # the next test got a guest that was gone by its first call). The cgroup v1 freezer holds
    # a killed process in that state for as long as the test needs: sacrificial, its own cgroup.
    if os.geteuid() != 0 or not (FREEZER / "cgroup.procs").is_file():
        pytest.skip("needs root and the cgroup v1 freezer, to hold a killed init before it dies")
    import signal
    import uuid

    from pytest_smolvm.host import procs, registry
    from pytest_smolvm.session.plan import Planner
    from pytest_smolvm.session.pool import GuestPool
    from pytest_smolvm.session.settings import MarkerSpec, Settings

    planner = Planner(Settings(backend="namespace"), "r" * 32, "main")
    pool = GuestPool(Settings(backend="namespace"), planner, run_id="r" * 32, worker="main")
    held = FREEZER / f"smolvm-test-dying-{uuid.uuid4().hex[:8]}"
    held.mkdir()
    try:
        first = pool.create("test_a", MarkerSpec())
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            ahead: dict[str, Any] = {r.name: r.data.get("pid")
                                     for r in registry.records() if r.test_id == READY_TEST_ID}
            if len(ahead) == pool.ahead.pace.depth and all(isinstance(pid, int) for pid in ahead.values()):
                break  # made, not just planned: a planned guest's record has no pid yet
            time.sleep(0.02)
        assert ahead, "no guest was made ahead"
        for pid in ahead.values():
            (held / "cgroup.procs").write_text(str(pid))
        (held / "freezer.state").write_text("FROZEN")
        while (held / "freezer.state").read_text().strip() != "FROZEN":
            time.sleep(0.01)
        for pid in ahead.values():
            os.kill(pid, signal.SIGKILL)  # pending until thawed
        assert all(procs.process_start_time(pid) is not None for pid in ahead.values())
        second = pool.create("test_b", MarkerSpec())
        (held / "freezer.state").write_text("THAWED")  # the killed ones die now, and are destroyed
        assert second.vm.name not in ahead, "a killed guest was handed to the next test"
        assert second.vm.exec("echo fine").stdout == "fine\n"
        pool.destroy(first)
        pool.destroy(second)
    finally:
        (held / "freezer.state").write_text("THAWED")
        for pid in [int(p) for p in (held / "cgroup.procs").read_text().split()]:
            procs.wait_gone(pid, 10)
        held.rmdir()
        assert pool.close() == [] and planner.close() == []
