"""Every pytest outcome, in guest tests: run serially, concurrently and under xdist by tests/test_parity.py.

Not collected by the project's own run (its name does not start with ``test_``); the parity
test copies it into a pytester directory as ``test_corpus.py``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from pytest_smolvm import VM

log = logging.getLogger("corpus")

async def test_pass(smol_vm: VM) -> None:
    r = await smol_vm.aio.exec("echo hi")
    print("out of pass")
    assert r.stdout == "hi\n"

async def test_assert_fail(smol_vm: VM) -> None:
    r = await smol_vm.aio.exec("echo hi")
    assert r.stdout == "ho\n"

async def test_skip_inside(smol_vm: VM) -> None:
    await smol_vm.aio.exec("true")
    pytest.skip("skipped from inside")

async def test_fail_inside(smol_vm: VM) -> None:
    await smol_vm.aio.exec("true")
    pytest.fail("failed from inside")

async def test_xfail_inside(smol_vm: VM) -> None:
    await smol_vm.aio.exec("true")
    pytest.xfail("xfailed from inside")

async def test_importorskip(smol_vm: VM) -> None:
    await smol_vm.aio.exec("true")
    pytest.importorskip("no_such_module_anywhere")

@pytest.mark.skipif(True, reason="skipif true")
async def test_skipif(smol_vm: VM) -> None:
    pass

@pytest.mark.xfail(strict=True, reason="strict")
async def test_xpass_strict(smol_vm: VM) -> None:
    await smol_vm.aio.exec("true")

@pytest.mark.xfail(reason="expected")
async def test_xfail_mark(smol_vm: VM) -> None:
    await smol_vm.aio.exec("true")
    raise AssertionError("expected to fail")

@pytest.mark.xfail(reason="non strict")
async def test_xpass(smol_vm: VM) -> None:
    await smol_vm.aio.exec("true")

@pytest.fixture
def broken_setup() -> None:
    raise RuntimeError("setup broke")

@pytest.fixture
def broken_teardown() -> Iterator[None]:
    yield
    raise RuntimeError("teardown broke")

async def test_setup_error(smol_vm: VM, broken_setup: None) -> None:
    pass

async def test_teardown_error(smol_vm: VM, broken_teardown: None) -> None:
    await smol_vm.aio.exec("true")

async def test_warns(smol_vm: VM) -> None:
    await smol_vm.aio.exec("true")
    warnings.warn("corpus warning", UserWarning, stacklevel=1)

async def test_warns_across_an_await(smol_vm: VM) -> None:
    with pytest.warns(UserWarning, match="inside"):
        await smol_vm.aio.exec("true")
        warnings.warn("inside", UserWarning, stacklevel=1)

async def test_recwarn(smol_vm: VM, recwarn: pytest.WarningsRecorder) -> None:
    await smol_vm.aio.exec("true")
    warnings.warn("recorded", UserWarning, stacklevel=1)
    assert [str(w.message) for w in recwarn] == ["recorded"]

async def test_warning_with_its_source(smol_vm: VM) -> None:
    await smol_vm.aio.exec("true")
    warnings.warn("with its source", UserWarning, stacklevel=1, source=smol_vm)

class _RaisesWhenCollected:
    def __del__(self) -> None:
        raise ValueError("raised in __del__")

async def test_unraisable_exception(smol_vm: VM) -> None:
    await smol_vm.aio.exec("true")
    _RaisesWhenCollected()  # collected at once: the exception goes to sys.unraisablehook
    await asyncio.sleep(0.5)  # other tests' phases end meanwhile

async def test_current_test_variable(smol_vm: VM) -> None:
    await smol_vm.aio.exec("true")
    assert os.environ["PYTEST_CURRENT_TEST"] == "test_corpus.py::test_current_test_variable (call)"

async def test_output_and_log(smol_vm: VM, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    print("to stdout")
    print("to stderr", file=sys.stderr)
    await smol_vm.aio.exec("true")
    log.info("an info record")
    log.warning("a warning record")
    assert [r.getMessage() for r in caplog.records] == ["an info record", "a warning record"]

# Two at once: the levels one test's caplog sets are its own while the other's body runs
async def test_caplog_sets_levels(smol_vm: VM, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    caplog.set_level(logging.DEBUG, logger="corpus.levels")
    await asyncio.sleep(0.6)

async def test_caplog_levels_are_the_tests_own(smol_vm: VM, caplog: pytest.LogCaptureFixture) -> None:
    await asyncio.sleep(0.3)
    logging.getLogger("corpus.levels").debug("a debug record")
    log.info("an info record")
    assert caplog.records == []

async def test_capsys(smol_vm: VM, capsys: pytest.CaptureFixture[str]) -> None:
    print("captured by capsys")
    await smol_vm.aio.exec("true")
    print("more")
    out, _ = capsys.readouterr()
    assert out == "captured by capsys\nmore\n"

async def test_capsys_disabled(smol_vm: VM, capsys: pytest.CaptureFixture[str]) -> None:
    print("captured before")
    with capsys.disabled():
        print("PARITY-TERMINAL before an await")
        await smol_vm.aio.exec("true")
        print("PARITY-TERMINAL after an await")
    print("captured after")
    out, _ = capsys.readouterr()
    assert out == "captured before\ncaptured after\n"

@pytest.mark.parametrize("n", [1, 2])
async def test_param(smol_vm: VM, n: int, record_property: Callable[[str, object], None]) -> None:
    record_property("n", n)
    await smol_vm.aio.exec("true")
    assert n == 1

async def test_own_timeout(smol_vm: VM) -> None:
    await asyncio.wait_for(asyncio.sleep(5), 0.05)

@pytest.fixture
def slow_setup() -> None:
    time.sleep(3)

# slow_setup first: the budget runs out in it in every mode, however long a loaded host takes to
# make the guest (made before it, the guest was in the report's user_properties or not by timing)
@pytest.mark.timeout(1)
async def test_timeout_setup(slow_setup: None, smol_vm: VM) -> None:
    pass

# 3 s: the guest is made within the budget even on a loaded host, so it runs out in the body
@pytest.mark.timeout(3)
async def test_timeout_body(smol_vm: VM) -> None:
    await smol_vm.aio.exec("sleep 10")

async def test_system_exit_is_a_failure(smol_vm: VM) -> None:
    raise SystemExit(3)


@pytest.fixture
def slowish_setup() -> None:
    time.sleep(3.5)


# 3 s: the body's own budget also pays for the other tests' synchronous phases that block the
# loop meanwhile (test_timeout_setup's, cut at 1 s), as it would under pytest-asyncio
@pytest.mark.timeout(3, func_only=True)
async def test_func_only_leaves_setup_unbounded(smol_vm: VM, slowish_setup: None) -> None:
    await smol_vm.aio.exec("true")


async def test_duration_is_the_bodys(smol_vm: VM) -> None:
    await asyncio.sleep(0.3)


def test_synchronous_guest_test(smol_vm: VM) -> None:
    assert smol_vm.exec("echo sync").stdout == "sync\n"
