"""--smol-concurrency: async guest tests in flight together, each its own item; every path destroys.

Concurrency is shown by a barrier, never by timing: the tests of a scenario wait (in their
guest-holding body) until all of them have arrived, which only happens if they are in flight
together; run one at a time, the first would wait alone and fail.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.leaks import assert_host_clean

BARRIER = """
    import asyncio

    ARRIVED = set()

    async def together(name, n):
        # Returns once n tests are in flight at once; run one at a time, the first waits alone.
        ARRIVED.add(name)
        for _ in range(400):
            if len(ARRIVED) >= n:
                return
            await asyncio.sleep(0.05)
        raise AssertionError(f"only {sorted(ARRIVED)} of {n} tests were in flight together")
"""

EPISODES = BARRIER + """
    import pytest

    @pytest.mark.smol_episodes(4, seed=1)
    async def test_episode(smol_vm, smol_episode, tmp_path):
        await smol_vm.aio.write_file("/tmp/me", f"{smol_episode.index}\\n")
        (tmp_path / "mine").write_text(str(smol_episode.index))  # function fixtures are per test
        await together(smol_episode.index, 4)
        r = await smol_vm.aio.exec("cat /tmp/me; hostname")
        assert r.stdout.splitlines()[0] == str(smol_episode.index)  # its own guest, still
        assert (tmp_path / "mine").read_text() == str(smol_episode.index)
        smol_episode.record(smol_episode.index / 10, guest=smol_vm.name)

    def test_sync_is_untouched(smol_vm):
        assert smol_vm.exec("echo sync").stdout == "sync\\n"
"""


def _junit_cases(path: Path) -> dict[str, str]:
    cases = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = child.tag
        cases[case.get("name", "")] = outcome
    return cases


def test_each_test_in_flight_is_its_own_item(pytester: pytest.Pytester, smol_state: Path) -> None:
    pytester.makepyfile(test_eps=EPISODES)
    junit, results = pytester.path / "junit.xml", pytester.path / "results.jsonl"
    result = pytester.runpytest_subprocess("--smol-concurrency=4", "-v", "-p", "no:anyio", "-p", "no:randomly",
                                           f"--junitxml={junit}", f"--smol-results={results}")
    result.assert_outcomes(passed=5)
    for i in range(4):  # each its own verbose line, in whatever order they finish
        result.stdout.fnmatch_lines([f"*test_episode?ep{i}? PASSED*"])
    assert _junit_cases(junit) == {**{f"test_episode[ep{i}]": "passed" for i in range(4)},
                                   "test_sync_is_untouched": "passed"}
    lines = [json.loads(raw) for raw in results.read_text().splitlines()]
    episodes = sorted((line for line in lines if line["episode"] is not None), key=lambda line: line["episode"])
    assert [line["reward"] for line in episodes] == [0.0, 0.1, 0.2, 0.3]
    assert [line["info"]["guest"] for line in episodes] == [line["vms"][0] for line in episodes]
    assert len({line["vms"][0] for line in lines}) == 5  # a guest of its own each
    assert all(line["durations"]["call"] > 0 for line in episodes)


def test_concurrency_multiplies_with_workers(pytester: pytest.Pytester, smol_state: Path) -> None:
    # loadfile: each worker gets one module, whose 4 episodes must all be in flight together
    pytester.makepyfile(test_a=EPISODES, test_b=EPISODES)
    results = pytester.path / "results.jsonl"
    result = pytester.runpytest_subprocess("-n", "2", "--dist", "loadfile", "--smol-concurrency=4",
                                           "-p", "no:anyio", "-p", "no:randomly", f"--smol-results={results}")
    result.assert_outcomes(passed=10)
    lines = [json.loads(raw) for raw in results.read_text().splitlines()]
    assert len(lines) == 10 and len({line["worker"] for line in lines}) == 2


ACROSS_WORKERS = """
    import asyncio, os, time
    import pytest

    ARRIVALS = {arrivals!r}

    @pytest.fixture(autouse=True)
    def second_worker_is_slow(worker_id):
        if worker_id == "gw1":
            time.sleep(1.5)  # so the first worker reports its tests in flight sooner, and asks for more

    @pytest.mark.smol_episodes(8)
    async def test_episode(smol_vm, smol_episode):
        open(os.path.join(ARRIVALS, f"ep{{smol_episode.index}}"), "w").close()
        for _ in range(300):
            if len(os.listdir(ARRIVALS)) >= 8:
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError(f"only {{sorted(os.listdir(ARRIVALS))}} of 8 were in flight at once")
        assert (await smol_vm.aio.exec("echo ok")).stdout == "ok\\n"
"""


def test_a_run_that_fits_every_workers_slots_starts_every_test_at_once(pytester: pytest.Pytester,
                                                                        smol_state: Path) -> None:
    # xdist's load scheduling, unaware of slots, handed the quicker worker more than its 4: its
    # extra tests waited for one of its slots while the other worker had slots to spare.
    arrivals = pytester.mkdir("arrivals")
    pytester.makepyfile(test_eps=ACROSS_WORKERS.format(arrivals=str(arrivals)))
    results = pytester.path / "results.jsonl"
    result = pytester.runpytest_subprocess("-n", "2", "--smol-concurrency=4", "-p", "no:anyio", "-p", "no:randomly",
                                           f"--smol-results={results}")
    result.assert_outcomes(passed=8)
    workers = [json.loads(raw)["worker"] for raw in results.read_text().splitlines()]
    assert sorted(workers) == ["gw0"] * 4 + ["gw1"] * 4


MIXED_LENGTHS = """
    import os, time

    def ran(name, worker_id):
        with open(os.path.join({where!r}, name), "w") as f:
            f.write(worker_id)

    def test_slow_1(worker_id):
        time.sleep(1.5); ran("slow_1", worker_id)

    def test_slow_2(worker_id):
        time.sleep(1.5); ran("slow_2", worker_id)

    def test_slow_3(worker_id):
        time.sleep(1.5); ran("slow_3", worker_id)

    def test_fast_1(worker_id):
        pass

    def test_fast_2(worker_id):
        pass

    async def test_in_a_guest(smol_vm):
        assert (await smol_vm.aio.exec("echo ok")).stdout == "ok\\n"
"""


def test_a_run_with_synchronous_tests_keeps_xdists_balancing(pytester: pytest.Pytester, smol_state: Path) -> None:
    # Split evenly up front, in collection order, the three slow synchronous tests all went to
    # one worker and the run took their sum; xdist's load scheduling gives them to both.
    where = pytester.mkdir("ran")
    pytester.makepyfile(test_mixed=MIXED_LENGTHS.format(where=str(where)))
    result = pytester.runpytest_subprocess("-n", "2", "--smol-concurrency=4", "-p", "no:anyio", "-p", "no:randomly")
    result.assert_outcomes(passed=6)
    workers = {(where / f"slow_{i}").read_text() for i in (1, 2, 3)}
    assert workers == {"gw0", "gw1"}, workers


def test_a_chosen_dist_keeps_xdists_scheduling(pytester: pytest.Pytester, smol_state: Path) -> None:
    pytester.makeconftest("""
        import pytest

        @pytest.hookimpl(wrapper=True)
        def pytest_xdist_make_scheduler(config, log):
            scheduler = yield
            print("SCHEDULER", type(scheduler).__name__)
            return scheduler
    """)
    pytester.makepyfile(test_x="async def test_x(smol_vm):\n    pass\n")
    for args, expected in [(["-n", "2", "--smol-concurrency=4"], "SlotAwareLoadScheduling"),
                           (["-n", "2", "--smol-concurrency=4", "--dist", "load"], "LoadScheduling"),
                           (["-n", "2", "--smol-concurrency=4", "-d"], "LoadScheduling"),
                           (["-n", "2"], "LoadScheduling")]:
        result = pytester.runpytest_subprocess(*args, "-s", "-p", "no:anyio", "-p", "no:randomly")
        result.assert_outcomes(passed=1)
        result.stdout.fnmatch_lines([f"SCHEDULER {expected}"])


CRASHING_WORKER = BARRIER + """
    import os
    import pytest

    @pytest.mark.smol_episodes(EPISODES)
    async def test_episode(smol_vm, smol_episode, worker_id):
        if worker_id not in ("gw0", "gw1"):
            return  # a test xdist runs again on the worker that replaced gw0 (loadfile does)
        await together(smol_episode.index, 3)  # this worker's three, all in flight
        if worker_id == "gw0" and smol_episode.index == min(ARRIVED):
            os._exit(3)  # the worker dies under all three
        await asyncio.sleep(1)
        assert (await smol_vm.aio.exec("echo ok")).stdout == "ok\\n"
"""


@pytest.mark.parametrize("dist", ["load", "loadfile"])
def test_every_test_in_flight_on_a_crashed_worker_is_reported(pytester: pytest.Pytester, smol_state: Path,
                                                              dist: str) -> None:
    # xdist sees a test as done once its worker has started it, so it reported one of the
    # crashed worker's three tests in flight; the other two had no report, line or JUnit entry.
    # Its schedulers keep what a worker has not started in two shapes (load, and loadfile's).
    if dist == "load":  # -n's own choice: one module, split 3/3 up front
        pytester.makepyfile(test_eps=CRASHING_WORKER.replace("EPISODES", "6"))
        args = ["-n", "2"]
    else:  # a module per worker
        suite = CRASHING_WORKER.replace("EPISODES", "3")
        pytester.makepyfile(test_a=suite, test_b=suite)
        args = ["-n", "2", "--dist", "loadfile"]
    junit, results = pytester.path / "junit.xml", pytester.path / "results.jsonl"
    result = pytester.runpytest_subprocess(*args, "--smol-concurrency=3", "-p", "no:anyio", "-p", "no:randomly",
                                           f"--junitxml={junit}", f"--smol-results={results}")
    # each report's text (the summary's line reads alike only from pytest 8.1 on)
    crashed = [line for line in result.stdout.lines if line.startswith("worker 'gw0' crashed while")]
    assert len(crashed) == 3, crashed  # each once: the one xdist names is not named again
    if dist == "loadfile":  # which also runs the test it names again, on gw0's replacement
        result.assert_outcomes(passed=4, failed=3)
        return
    result.assert_outcomes(passed=3, failed=3)
    cases = _junit_cases(junit)
    assert len(cases) == 6 and sorted(cases.values()) == ["error"] * 3 + ["passed"] * 3, cases
    lines = [json.loads(raw) for raw in results.read_text().splitlines()]
    assert len(lines) == 6 and sorted(line["outcome"] for line in lines) == ["error"] * 3 + ["passed"] * 3
    # Each test the plugin reports lost in flight (its setup report came) names the guest it had.
    # The one xdist reports may not: its setup report may not have come, and then only the guest
    # records name its guest, which the dead worker's helper removes meanwhile.
    lost = [line["vms"] for line in lines if line["outcome"] == "error" and "was in flight" in line["message"]]
    assert len(lost) == 2 and all(len(vms) == 1 for vms in lost) and lost[0] != lost[1], lost


MIXED = BARRIER + """
    import pytest

    @pytest.fixture
    def broken():
        raise RuntimeError("this fixture broke")

    async def test_passes(smol_vm):
        await together("passes", 5)
        assert (await smol_vm.aio.exec("echo ok")).stdout == "ok\\n"

    async def test_fails(smol_vm):
        await together("fails", 5)
        assert 1 == 2, "its own failure"

    async def test_errors(smol_vm, broken):
        pass

    @pytest.mark.timeout(3)
    async def test_times_out(smol_vm):
        await together("times_out", 5)
        await smol_vm.aio.exec("sleep 600")

    async def test_cancelled(smol_vm):
        await together("cancelled", 5)
        raise asyncio.CancelledError()

    async def test_outlives_the_others(smol_vm):
        await together("outlives", 5)
        await asyncio.sleep(5)  # past the timeout and every other teardown: its guest is still here
        assert (await smol_vm.aio.exec("echo still")).stdout == "still\\n"
"""


def test_every_outcome_among_many_destroys_its_own_guest(pytester: pytest.Pytester, smol_state: Path) -> None:
    pytester.makepyfile(test_mixed=MIXED)
    result = pytester.runpytest_subprocess("--smol-concurrency=6", "-rA", "-p", "no:anyio", "-p", "no:randomly")
    result.assert_outcomes(passed=2, failed=3, errors=1)
    for line in ("PASSED *test_passes", "PASSED *test_outlives_the_others",
                 "ERROR *test_errors - RuntimeError: this fixture broke",
                 "FAILED *test_fails - AssertionError: its own failure",
                 "FAILED *test_times_out - Failed: Timeout *3.0s*",  # pytest-timeout 2.3 words it without "(" ... ")"
                 "FAILED *test_cancelled - *CancelledError"):
        result.stdout.fnmatch_lines([line])
    assert_host_clean(smol_state)


INTERRUPTED = """
    import os
    from pathlib import Path

    import pytest

    MARKS = Path(os.environ["MARKS"])

    @pytest.fixture
    def own(request):
        yield
        (MARKS / ("torn-down-" + request.node.name)).touch()

    @pytest.mark.smol_episodes(4)
    async def test_long(smol_vm, smol_episode, own):
        (MARKS / f"started-{smol_episode.index}").touch()
        await smol_vm.aio.exec("sleep 600")
"""


def _interrupted_when(pytester: pytest.Pytester, marks: Path, args: list[str], ready: Callable[[], bool],
                      never_ready: str, settle: float = 0.0) -> tuple[int, str]:
    """Run pytest in ``pytester.path`` (``MARKS`` set), SIGINT it once ``ready()``; its exit status and output."""
    marks.mkdir()
    env = {**os.environ, "MARKS": str(marks)}
    proc = subprocess.Popen([sys.executable, "-m", "pytest", *args, "-p", "no:anyio", "-p", "no:randomly",
                             "-p", "no:cacheprovider"],
                            cwd=pytester.path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while not ready() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.1)
        assert ready(), f"{never_ready}: {sorted(m.name for m in marks.iterdir())}"
        time.sleep(settle)
        proc.send_signal(signal.SIGINT)
        output, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, output


def test_ctrl_c_destroys_every_test_in_flight(pytester: pytest.Pytester, smol_state: Path,
                                              tmp_path: Path) -> None:
    pytester.makepyfile(test_long=INTERRUPTED)
    marks = tmp_path / "marks"
    returncode, output = _interrupted_when(
        pytester, marks, ["--smol-concurrency=4"], lambda: len(list(marks.glob("started-*"))) == 4,
        "the four episodes never were in flight together")
    assert returncode == 2, output  # pytest's "interrupted"
    assert "KeyboardInterrupt" in output
    assert sorted(p.name for p in marks.glob("torn-down-*")) == [f"torn-down-test_long[ep{i}]" for i in range(4)]
    assert_host_clean(smol_state)


def test_a_body_that_spends_its_timeout_is_timed_out_once(pytester: pytest.Pytester, smol_state: Path) -> None:
    """The body runs under the item's pytest-timeout budget; its call phase only replays it. That
    replay was timed again with what was left of the budget (nothing, after a timeout), so
    pytest-timeout's own alarm fired a second time mid-replay: its dump went to the terminal and
    the test's captured output was lost (the parity test's flake in nox's oldest cell)."""
    pytester.makepyfile("""
        import pytest

        @pytest.mark.timeout(2)
        async def test_spends_it(smol_vm):
            print("printed before " + "x" * 20_000_000)  # a replay long enough for a second alarm
            await smol_vm.aio.exec("sleep 10")
    """)
    result = pytester.runpytest_subprocess("--smol-concurrency=2", "-p", "no:anyio", "-p", "no:randomly",
                                           "--smol-backend=namespace")
    result.assert_outcomes(failed=1)
    out = result.stdout.str()
    captured = out[out.index("Captured stdout call"):]
    assert "printed before xxx" in captured and "~ Stack of " in captured, out[-3000:]
    assert "~ Stack of " not in out[:out.index("Captured stdout call")], "a second dump, to the terminal"


def test_pytest_exit_in_a_body_ends_the_run_with_its_code_and_nothing_left(pytester: pytest.Pytester,
                                                                           smol_state: Path) -> None:
    pytester.makepyfile("""
        import asyncio
        import pytest

        async def test_in_flight(smol_vm):
            await asyncio.sleep(1)

        async def test_exits(smol_vm):
            await smol_vm.aio.exec("true")
            pytest.exit("bye from the test", returncode=7)
    """)
    result = pytester.runpytest_subprocess("--smol-concurrency=2", "-p", "no:anyio", "-p", "no:randomly",
                                           "--smol-backend=namespace")
    assert result.ret == 7, result.stdout.str()[-2000:]
    result.stdout.fnmatch_lines(["*Exit: bye from the test*"])
    output = result.stdout.str() + result.stderr.str()
    assert "never retrieved" not in output, output[-3000:]  # asyncio's word for a task's lost exception
    assert_host_clean(smol_state)


def test_bad_concurrency_is_one_line(pytester: pytest.Pytester, smol_state: Path) -> None:
    pytester.makepyfile("""
        import pytest

        @pytest.mark.smol_episodes(2, concurrency=0)
        async def test_x(smol_vm):
            pass
    """)
    result = pytester.runpytest_subprocess("--smol-concurrency=many")
    result.stderr.fnmatch_lines(["*--smol-concurrency=many: expected a positive integer*"])
    result = pytester.runpytest_subprocess("-p", "no:anyio", "-p", "no:randomly")
    result.stdout.fnmatch_lines(["*smol_episodes(concurrency=0): expected a positive integer*"])


def test_exitfirst_finishes_what_is_in_flight_and_starts_nothing(pytester: pytest.Pytester,
                                                                   smol_state: Path) -> None:
    pytester.makepyfile(test_x="""
        import asyncio
        import pytest

        @pytest.mark.smol_episodes(6, concurrency=3)
        async def test_x(smol_vm, smol_episode):
            if smol_episode.index == 1:
                raise AssertionError("the first failure")
            await smol_vm.aio.exec("sleep 1")
    """)
    result = pytester.runpytest_subprocess("-x", "-p", "no:anyio", "-p", "no:randomly")
    outcomes = result.parseoutcomes()
    assert outcomes["failed"] == 1 and outcomes.get("passed", 0) < 5, outcomes  # -x stopped the rest
    result.stdout.fnmatch_lines(["*stopping after 1 failures*"])
    assert_host_clean(smol_state)


def test_guests_are_made_ahead_while_every_slot_is_taken(pytester: pytest.Pytester, smol_state: Path) -> None:
    """A freed slot should find its next guest ready: once the runner has measured how long a
    guest takes to make and a test to run, it starts the next guests while all N still run."""
    events = pytester.path / "events.txt"
    pytester.makeconftest(f"""
        import time

        def pytest_smolvm_configure_vm(item, spec):  # called as a test's guest is asked for
            with open({str(events)!r}, "a") as f:
                f.write(f"ask {{item.name}} {{time.monotonic()}}\\n")
    """)
    pytester.makepyfile(test_ahead=f"""
        import time
        import pytest

        @pytest.mark.smol_episodes(8, concurrency=2)
        async def test_x(smol_vm, smol_episode):
            with open({str(events)!r}, "a") as f:
                f.write(f"start {{smol_episode.index}} {{time.monotonic()}}\\n")
            await smol_vm.aio.exec("sleep 1")
            with open({str(events)!r}, "a") as f:
                f.write(f"end {{smol_episode.index}} {{time.monotonic()}}\\n")
    """)
    pytester.runpytest_subprocess("-p", "no:anyio", "-p", "no:randomly").assert_outcomes(passed=8)
    lines = [line.split() for line in events.read_text().splitlines()]
    starts = {name: float(t) for kind, name, t in lines if kind == "start"}
    ends = {name: float(t) for kind, name, t in lines if kind == "end"}
    asks = [float(t) for kind, _, t in lines if kind == "ask"]
    running_at_ask = [sum(starts[n] <= t < ends[n] for n in starts) for t in asks]
    # Made only as slots free, a guest is asked for while at most one other test runs.
    assert max(running_at_ask) == 2, running_at_ask
    assert_host_clean(smol_state)


MADE_AHEAD_INTERRUPTED = """
    import os
    from pathlib import Path

    import pytest

    MARKS = Path(os.environ["MARKS"])

    @pytest.mark.smol_episodes(6, concurrency=2)
    async def test_ep(smol_vm, smol_episode):
        (MARKS / f"started-{smol_episode.index}").touch()
        # the first two measure the pace; the rest hold their slots until interrupted
        await smol_vm.aio.exec("sleep 0.5" if smol_episode.index < 2 else "sleep 600")
"""


def test_ctrl_c_releases_guests_made_ahead_for_tests_that_never_started(pytester: pytest.Pytester,
                                                                        smol_state: Path, tmp_path: Path) -> None:
    pytester.makeconftest("""
        import os
        from pathlib import Path

        def pytest_smolvm_configure_vm(item, spec):  # a test's guest is asked for
            (Path(os.environ["MARKS"]) / f"asked-{item.name}").touch()
    """)
    pytester.makepyfile(test_ahead=MADE_AHEAD_INTERRUPTED)
    marks = tmp_path / "marks"

    def holding() -> set[int]:  # the long episodes that started: a test takes its slot once its
        # guest is ready, so which two of ep2-ep5 hold the slots is whichever guests came first
        return {int(m.name.partition("-")[2]) for m in marks.glob("started-*")} - {0, 1}

    def held_and_one_made_ahead() -> bool:
        asked = {m.name for m in marks.glob("asked-*")}
        waiting = [i for i in range(2, 6) if f"asked-test_ep[ep{i}]" in asked and i not in holding()]
        return len(holding()) == 2 and bool(waiting)

    returncode, output = _interrupted_when(
        pytester, marks, [], held_and_one_made_ahead, "no guest was made ahead while both slots were held",
        settle=2.0)  # the made-ahead guest exists by then (a namespace guest takes a fraction of that)
    assert returncode == 2, output
    assert len(holding()) == 2, output  # the test made ahead never started
    assert_host_clean(smol_state)


def test_a_freed_slot_goes_to_the_first_waiter_not_to_a_newcomer() -> None:
    """Under load a newcomer could take a freed slot before the woken waiter ran; the waiter then
    queued again at the back (seen: a test made ahead ran before the one waiting longer)."""
    import asyncio

    from pytest_smolvm.plugin.slots import Slots

    async def scenario() -> set[object]:
        loop, slots = asyncio.get_running_loop(), Slots()
        await slots.take(loop, 1, "a")
        waiting = asyncio.create_task(slots.take(loop, 1, "b"))
        await asyncio.sleep(0)  # b waits
        slots.free("a")  # b is woken, but has not run yet, when c asks in the same turn of the loop
        newcomer = slots.take(loop, 1, "c")
        with contextlib.suppress(StopIteration):  # StopIteration: c took the slot at once
            newcomer.send(None).cancel()  # c waits (for this future): c gives up
        newcomer.close()
        await asyncio.wait_for(waiting, 5)
        return slots.holders

    assert asyncio.run(scenario()) == {"b"}
