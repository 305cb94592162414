"""--smol-concurrency among the plugins users already run, and on the pytest it was not written for.

The plugins (pytest-asyncio, pytest-rerunfailures) are installed in noxfile.py's newest cell; a
test that needs one is skipped where it is absent, and runs there.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.leaks import assert_host_clean

ONE_AT_A_TIME = "smolvm: --smol-concurrency: some guest tests ran one at a time: "


def _run(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    return pytester.runpytest_subprocess("--smol-concurrency=4", "-p", "no:anyio", "-p", "no:randomly", *args)


def test_a_moved_pytest_internal_is_one_line_naming_the_versions(pytester: pytest.Pytester,
                                                                 smol_state: Path) -> None:
    # A pytest release without one of the internals the concurrent runner reads: a usage error
    # before any test runs, naming what moved and the tested versions; never an INTERNALERROR.
    pytester.makeconftest("""
        import _pytest.warnings
        del _pytest.warnings.catch_warnings_for_item
    """)
    pytester.makepyfile(test_x="async def test_x(smol_vm):\n    pass\n")
    result = _run(pytester)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "INTERNALERROR" not in result.stdout.str() + result.stderr.str()
    result.stderr.fnmatch_lines(["ERROR: pytest-smolvm --smol-concurrency: pytest * has no "
                                 "warnings.catch_warnings_for_item; the concurrent runner is tested with "
                                 "pytest 8.0 to 9.0: *"])


def test_without_pytest_timeout_a_tests_own_timeout_is_its_own(pytester: pytest.Pytester, smol_state: Path) -> None:
    pytester.makepyfile(test_x="""
        import asyncio

        async def test_own_wait_for(smol_vm):
            await smol_vm.aio.exec("true")
            await asyncio.wait_for(asyncio.sleep(5), 0.05)

        async def test_passes(smol_vm):
            await smol_vm.aio.exec("true")
    """)
    result = _run(pytester, "-p", "no:timeout", "-rA")
    assert "INTERNALERROR" not in result.stdout.str()
    assert "pytest-timeout" not in result.stdout.str()
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["FAILED test_x.py::test_own_wait_for - TimeoutError*"])
    assert_host_clean(smol_state)


def test_capfd_runs_one_at_a_time_and_the_run_says_why(pytester: pytest.Pytester, smol_state: Path) -> None:
    pytester.makepyfile(test_x="""
        import os

        async def test_fd_output(smol_vm, capfd):
            os.write(1, b"written to fd 1\\n")
            await smol_vm.aio.exec("true")
            assert capfd.readouterr().out == "written to fd 1\\n"

        async def test_sys_output(smol_vm, capsys):
            print("printed")
            await smol_vm.aio.exec("true")
            assert capsys.readouterr().out == "printed\\n"
    """)
    result = _run(pytester)
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines([f"{ONE_AT_A_TIME}capfd and capfdbinary capture the process's file descriptors*"])
    assert result.stdout.str().count(ONE_AT_A_TIME) == 1


def test_pytest_asyncio_in_auto_mode_is_said_once(pytester: pytest.Pytester, smol_state: Path) -> None:
    pytest.importorskip("pytest_asyncio", reason="installed in noxfile.py's newest cell")
    pytester.makepyfile(test_x="""
        import pytest

        async def test_a(smol_vm):
            assert (await smol_vm.aio.exec("echo a")).stdout == "a\\n"

        @pytest.mark.asyncio(loop_scope="module")
        async def test_b(smol_vm):
            assert (await smol_vm.aio.exec("echo b")).stdout == "b\\n"
    """)
    strict = _run(pytester, "-p", "asyncio", "-o", "asyncio_mode=strict", "-o",
                  "asyncio_default_fixture_loop_scope=function")
    strict.assert_outcomes(passed=2)
    strict.stdout.fnmatch_lines([f"{ONE_AT_A_TIME}*pytest-asyncio*"])  # test_b's mark is not ignored
    auto = _run(pytester, "-p", "asyncio", "-o", "asyncio_mode=auto", "-o",
                "asyncio_default_fixture_loop_scope=function")
    auto.assert_outcomes(passed=2)
    auto.stdout.fnmatch_lines([f"{ONE_AT_A_TIME}*asyncio_mode = strict*"])
    assert auto.stdout.str().count(ONE_AT_A_TIME) == 1


def test_rerunfailures_reruns_what_it_is_asked_to(pytester: pytest.Pytester, smol_state: Path,
                                                  tmp_path: Path) -> None:
    pytest.importorskip("pytest_rerunfailures", reason="installed in noxfile.py's newest cell")
    pytester.makepyfile(test_x=f"""
        from pathlib import Path

        async def test_flaky(smol_vm):
            tries = Path({str(tmp_path / "tries")!r})
            tries.write_text(tries.read_text() + "x" if tries.exists() else "x")
            await smol_vm.aio.exec("true")
            assert len(tries.read_text()) == 2  # fails the first time
    """)
    result = _run(pytester, "-p", "rerunfailures", "--reruns", "1")
    outcomes = result.parseoutcomes()  # assert_outcomes has no "rerun" before pytest 8.?
    assert (outcomes.get("passed"), outcomes.get("rerun")) == (1, 1), outcomes
    result.stdout.fnmatch_lines([f"{ONE_AT_A_TIME}pytest-rerunfailures*"])
    assert_host_clean(smol_state)


def test_a_hung_guest_create_is_bounded_by_the_tests_timeout(pytester: pytest.Pytester, smol_state: Path) -> None:
    # The guest of a test in flight is made ahead, on a thread of its own; a create that hangs is
    # the setup's failure once the test's pytest-timeout budget is spent, as serially.
    pytester.makeconftest("""
        import time
        from pytest_smolvm.session import pool

        made = pool.GuestPool.create

        def create(self, test_id, *args, **kwargs):
            if "hangs" in test_id:
                time.sleep(6)  # an engine that does not answer
            return made(self, test_id, *args, **kwargs)

        pool.GuestPool.create = create
    """)
    pytester.makepyfile(test_x="""
        import pytest

        async def test_first(smol_vm):
            await smol_vm.aio.exec("true")

        @pytest.mark.timeout(2)
        async def test_hangs(smol_vm):
            await smol_vm.aio.exec("true")

        async def test_last(smol_vm):
            await smol_vm.aio.exec("true")
    """)
    result = _run(pytester, "-rA", "--durations=0")
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(["ERROR test_x.py::test_hangs - Failed: Timeout *2.0s*"])
    setup = next(line for line in result.stdout.lines if line.endswith("setup    test_x.py::test_hangs"))
    assert float(setup.split("s")[0]) < 4, setup  # the budget, not the create's 6 s
    assert_host_clean(smol_state)
