"""Admission control: host-wide bounds on guests alive and being created, shared by processes."""

from __future__ import annotations

import errno
import fcntl
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from pytest_smolvm.errors import ProvisionError
from pytest_smolvm.session import admission
from tests.leaks import assert_host_clean

ROOT = Path(__file__).resolve().parents[1]

HOLD_SLOT_0 = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
sys.stdin.read()
"""


def test_a_gate_is_shared_by_processes_and_threads(smol_state: Path) -> None:
    gate = admission.Gate("test", 2)
    (smol_state / "admission").mkdir(parents=True, exist_ok=True)
    other = subprocess.Popen([sys.executable, "-c", HOLD_SLOT_0, str(smol_state / "admission" / "test-0.lock")],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout is not None and other.stdout.readline() == "held\n"
        first = gate.acquire()
        assert first.index == 1  # slot 0 is another process's
        waited = threading.Event()
        got: list[admission.Slot] = []
        third = threading.Thread(target=lambda: got.append(gate.acquire(waited.set)))
        third.start()
        assert waited.wait(10), "a full gate must say that the caller waits"
        assert not got
        first.release()
        third.join(10)
        assert [slot.index for slot in got] == [1]
        assert gate.peak == 2  # slot 1 taken: slot 0 was held at that moment
        got[0].release()
    finally:
        other.kill()
        other.wait()
        gate.close()


WAITING = """
    import pytest
    from pytest_smolvm.backends.namespace.backend import NamespaceBackend

    NamespaceBackend.guest_host_mb = 10**9  # this host "holds" one guest: the others must wait

    @pytest.mark.smol_episodes(3, concurrency=3)
    async def test_held_back(smol_vm):
        assert (await smol_vm.aio.exec("sleep 1; echo in")).stdout == "in\\n"  # holds its guest a while
"""


def test_tests_wait_for_admission_and_say_so(pytester: pytest.Pytester, smol_state: Path) -> None:
    pytester.makepyfile(test_wait=WAITING)
    result = pytester.runpytest_subprocess("-v", "-p", "no:anyio")
    result.assert_outcomes(passed=3)
    result.stdout.fnmatch_lines(["*test_held_back?ep*: waiting for admission (1 guests alive on this host)"])
    result.stdout.fnmatch_lines(["smolvm: admission: peak held on this host: 1 of 1 alive, 1 of * creating*"])


def test_the_summary_reports_the_peak_held(pytester: pytest.Pytester, smol_state: Path) -> None:
    pytester.makepyfile(test_peak="""
        import asyncio
        import pytest

        ARRIVED = set()

        @pytest.mark.smol_episodes(4, concurrency=4)
        async def test_all_alive(smol_vm, smol_episode):
            ARRIVED.add(smol_episode.index)
            while len(ARRIVED) < 4:
                await asyncio.sleep(0.05)
    """)
    result = pytester.runpytest_subprocess("-p", "no:anyio")
    result.assert_outcomes(passed=4)
    result.stdout.fnmatch_lines(["smolvm: admission: peak held on this host: 4 of * alive, * creating*"])


def test_a_test_that_would_hold_more_guests_than_max_vms_fails_at_once(pytester: pytest.Pytester,
                                                                       smol_state: Path) -> None:
    """Its own guests hold every slot --smol-max-vms lets live: one more waited for ever (as
    branch_batch already said in one line)."""
    pytester.makepyfile(test_cap="""
        def test_two(smol_vm_factory):
            first = smol_vm_factory()
            second = smol_vm_factory()
    """)
    result = pytester.runpytest_subprocess("--smol-max-vms=1", "-p", "no:anyio", timeout=60)
    result.assert_outcomes(errors=0, failed=1)
    result.stdout.fnmatch_lines(["*smol_vm_factory: this test already holds 1 guest*--smol-max-vms=1*"])
    assert_host_clean(smol_state)


def count_lock_tries(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A one-item list counting the admission module's flock calls from now on."""
    calls = [0]
    real_flock = fcntl.flock

    def counting(fd: int, operation: int) -> None:
        calls[0] += 1
        real_flock(fd, operation)

    monkeypatch.setattr(fcntl, "flock", counting)
    return calls


def test_waiters_of_one_process_do_not_all_poll(smol_state: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under --smol-concurrency a worker has a hundred threads waiting for admission; each used to
    try every slot's lock file every 20 ms. One polls; the others wait their turn."""
    gate = admission.Gate("test-poll", 4)
    elsewhere = admission.Gate("test-poll", 4)  # its own open files: another process, as flock sees it
    held = [elsewhere.acquire() for _ in range(4)]
    calls = count_lock_tries(monkeypatch)
    got: list[admission.Slot] = []
    waiters = [threading.Thread(target=lambda: got.append(gate.acquire())) for _ in range(20)]
    for waiter in waiters:
        waiter.start()
    threading.Event().wait(1.0)  # 50 polls' worth: 20 pollers x 50 x 4 slots = 4,000 tries before
    assert calls[0] < 1000, calls[0]
    for slot in held:  # four freed elsewhere: four waiters admitted
        slot.release()
    deadline = threading.Event()
    for _ in range(200):
        if len(got) == 4:
            break
        deadline.wait(0.01)
    assert len(got) == 4
    released = 0
    for _ in range(2000):  # each admitted waiter's slot freed in turn, until every waiter had one
        while released < len(got):
            got[released].release()
            released += 1
        if released == 20:
            break
        deadline.wait(0.01)
    for waiter in waiters:
        waiter.join(10)
    assert released == 20 and not any(w.is_alive() for w in waiters)
    elsewhere.close()
    gate.close()


SECOND_PROCESS = """
import os, resource, sys
resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
from pytest_smolvm.session import admission
from tests.leaks import assert_host_clean
gate = admission.Gate("alive", 400)
before = len(os.listdir("/proc/self/fd"))
slot = gate.acquire()
print(slot.index, len(os.listdir("/proc/self/fd")) - before, flush=True)
slot.release()
"""


def test_a_second_process_under_a_256_fd_limit_is_admitted_beside_300_held_slots(smol_state: Path) -> None:
    """Issue 43: a scan kept an fd open for every slot it passed; a process with the common
    small limit failed with EMFILE (a raw OSError) while another held a few hundred guests."""
    holder = admission.Gate("alive", 400)
    held = [holder.acquire() for _ in range(300)]
    try:
        done = subprocess.run([sys.executable, "-c", SECOND_PROCESS], capture_output=True, text=True, timeout=60,
                              env={"PYTEST_SMOLVM_STATE_DIR": str(smol_state), "PYTHONPATH": str(ROOT)})
        assert done.returncode == 0, done.stderr
        index, more_fds = map(int, done.stdout.split())
        assert index == 300
        assert more_fds <= 1, f"{more_fds} fds held for one slot"
    finally:
        for slot in held:
            slot.release()
        holder.close()


def test_a_slot_file_that_cannot_be_opened_is_a_provision_error(smol_state: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    def full(*_args: object) -> int:
        raise OSError(errno.EMFILE, "Too many open files")

    gate = admission.Gate("test-emfile", 2)
    monkeypatch.setattr(os, "open", full)
    with pytest.raises(ProvisionError, match=r"^admission: cannot open \S+test-emfile-0.lock \(Too many open files, "
                                             r"0 test-emfile slots held by this process\): raise the open-file limit"):
        gate.acquire()


def test_a_waiter_sleeps_until_a_slot_is_freed_in_another_process(smol_state: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """No polling while nothing changes (it tried every slot every 20 ms), and a slot freed by
    another process admits the waiter at once."""
    other = subprocess.Popen([sys.executable, "-c", """
import sys
from pytest_smolvm.session import admission
from tests.leaks import assert_host_clean
gate = admission.Gate("test-sleep", 4)
held = [gate.acquire() for _ in range(4)]
print("held", flush=True)
sys.stdin.readline()
held[2].release()
print("freed", flush=True)
sys.stdin.readline()
"""], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        env={"PYTEST_SMOLVM_STATE_DIR": str(smol_state), "PYTHONPATH": str(ROOT)})
    gate = admission.Gate("test-sleep", 4)
    try:
        assert other.stdout is not None and other.stdout.readline() == "held\n"
        calls = count_lock_tries(monkeypatch)
        got: list[admission.Slot] = []
        waiter = threading.Thread(target=lambda: got.append(gate.acquire()))
        waiter.start()
        time.sleep(0.9)
        assert calls[0] <= 8, f"{calls[0]} lock tries in 0.9 s with nothing freed"  # was 4 every 20 ms: ~180
        assert other.stdin is not None
        other.stdin.write("\n")
        other.stdin.flush()
        assert other.stdout.readline() == "freed\n"
        freed = time.monotonic()
        waiter.join(5)
        assert [s.index for s in got] == [2]
        assert time.monotonic() - freed < 0.5, "admitted only by the backstop rescan, not by the release"
        got[0].release()
    finally:
        other.kill()
        other.wait()
        gate.close()
