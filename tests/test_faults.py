"""Fault injection: real pytest sessions are killed, interrupted, timed out and abused.

After each one, ``smol_state`` checks that the host is as it was: no registry record, scratch
dir, guest process, cgroup or mount is left.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pytest_smolvm.backends.namespace.cgroups import state_tag


def wait_for(path: Path, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def test_kill_9_of_an_xdist_worker_mid_test(pytester: pytest.Pytester, smol_state: Path) -> None:
    pytester.makepyfile("""
        import os, signal
        import pytest

        def test_crashes_its_worker(smol_vm):
            smol_vm.exec("sleep 300 >/dev/null 2>&1 &", check=True)
            os.kill(os.getpid(), signal.SIGKILL)

        @pytest.mark.parametrize("i", range(6))
        def test_others(smol_vm, i):
            assert smol_vm.exec("true").exit_code == 0
    """)
    result = pytester.runpytest_subprocess("-n", "2")
    result.assert_outcomes(passed=6, failed=1)
    result.stdout.fnmatch_lines(["*worker 'gw*' crashed while running*test_crashes_its_worker*"])


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_signal_to_the_whole_xdist_session(pytester: pytest.Pytester, smol_state: Path,
                                           sig: signal.Signals) -> None:
    started = pytester.mkdir("started")
    pytester.makepyfile(f"""
        import time
        from pathlib import Path
        import pytest

        @pytest.mark.parametrize("i", range(4))
        def test_long(smol_vm, i, worker_id):
            smol_vm.exec("sleep 300 >/dev/null 2>&1 &", check=True)
            Path({str(started)!r}, worker_id).write_text(smol_vm.name)
            time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-n", "2", "-p", "no:cacheprovider"],
                            cwd=pytester.path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    wait_for(started / "gw0")
    wait_for(started / "gw1")
    os.killpg(proc.pid, sig)  # as a terminal's Ctrl-C does: controller and workers at once
    out, _ = proc.communicate(timeout=60)
    # Interrupted, as a Ctrl-C of a serial run is: not an INTERNALERROR (also non-zero), and
    # smol_state checks that nothing was left.
    assert proc.returncode == pytest.ExitCode.INTERRUPTED, out
    assert "INTERNALERROR" not in out, out


def test_second_ctrl_c_still_finishes_destroying(pytester: pytest.Pytester, smol_state: Path) -> None:
    started = pytester.path / "started"
    pytester.makepyfile(f"""
        import time
        from pathlib import Path

        def test_many_guests(smol_vm_factory):
            for _ in range(20):
                smol_vm_factory().exec("sleep 300 >/dev/null 2>&1 &")
            Path({str(started)!r}).write_text("")
            time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-p", "no:cacheprovider"], cwd=pytester.path,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wait_for(started)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    began = time.monotonic()
    proc.communicate(timeout=60)
    assert time.monotonic() - began < 10


def test_pytest_timeout_signal_method(pytester: pytest.Pytester, smol_state: Path) -> None:
    pytester.makepyfile("""
        import time
        import pytest

        @pytest.mark.timeout(2, method="signal")
        def test_hangs(smol_vm):
            smol_vm.exec("sleep 300 >/dev/null 2>&1 &", check=True)
            time.sleep(60)

        def test_next(smol_vm):
            assert smol_vm.exec("true").exit_code == 0
    """)
    result = pytester.runpytest_subprocess()
    result.assert_outcomes(failed=1, passed=1)
    result.stdout.fnmatch_lines(["*Timeout*"])


def test_pytest_timeout_thread_method_kills_the_worker_and_the_reaper_cleans(
        pytester: pytest.Pytester, smol_state: Path) -> None:
    pytester.makepyfile("""
        import time
        import pytest

        @pytest.mark.timeout(2, method="thread")
        def test_hangs(smol_vm):
            smol_vm.exec("sleep 300 >/dev/null 2>&1 &", check=True)
            time.sleep(60)

        @pytest.mark.parametrize("i", range(4))
        def test_others(smol_vm, i):
            assert smol_vm.exec("true").exit_code == 0
    """)
    result = pytester.runpytest_subprocess("-n", "2")
    result.assert_outcomes(failed=1, passed=4)


def test_exec_timeout_kills_guest_work_not_the_test(pytester: pytest.Pytester, smol_state: Path) -> None:
    pytester.makepyfile("""
        import time
        import pytest
        from pytest_smolvm import ExecError

        @pytest.mark.smol(timeout=1)
        def test_deadline(smol_vm):
            began = time.monotonic()
            r = smol_vm.exec("sleep 100; echo never")
            assert r.timed_out and r.exit_code == 124 and "never" not in r.stdout
            assert time.monotonic() - began < 5
            assert "sleep" not in smol_vm.exec("ps -o comm").stdout  # its process group is gone
            with pytest.raises(ExecError, match="timed out"):
                smol_vm.exec(["sleep", "100"], check=True)
            assert smol_vm.exec("echo alive", timeout=10).stdout == "alive\\n"
    """)
    pytester.runpytest_subprocess().assert_outcomes(passed=1)


def test_a_timed_out_commands_group_is_gone_when_exec_returns(pytester: pytest.Pytester, smol_state: Path) -> None:
    # A killed process can take a while to die: one that filled 512 MiB was still running (in
    # its exit) after its shell had been reaped and reported. CI met the same with a sleep.
    pytester.makepyfile("""
        def test_slow_to_die(smol_vm):
            for _ in range(5):
                r = smol_vm.exec("dd if=/dev/zero of=/dev/null bs=512M count=100000; echo never", timeout=0.5)
                assert r.timed_out
                assert "dd" not in smol_vm.exec("ps -o comm").stdout.split()  # the whole group is gone
    """)
    pytester.runpytest_subprocess("--smol-backend=namespace").assert_outcomes(passed=1)


def test_hostile_guests_do_not_take_the_host_down(pytester: pytest.Pytester, smol_state: Path) -> None:
    pytester.makepyfile("""
        import pytest

        def test_fork_bomb(smol_vm, smol_vm_factory):
            r = smol_vm.exec("bomb() { bomb | bomb & }; bomb; sleep 5", timeout=5)
            assert r.timed_out or "can't fork" in r.stderr  # its guest's pids limit stopped it
            assert smol_vm_factory().exec("echo fine").stdout == "fine\\n"  # and nothing else

        def test_fills_its_disk(smol_vm):
            r = smol_vm.exec("dd if=/dev/zero of=/workspace/fill bs=1M 2>&1; df -m /workspace", timeout=120)
            assert "No space left on device" in r.stdout

        def test_prints_a_gigabyte(smol_vm):
            r = smol_vm.exec("head -c 1073741824 /dev/zero | tr '\\\\0' x", timeout=120)
            assert r.exit_code == 0 and r.truncated == ("stdout",)
            assert r.stdout == "x" * (16 << 20)  # the limit, all of it the guest's own bytes

        def test_after_them_all(smol_vm):
            assert smol_vm.exec("echo fine").stdout == "fine\\n"
    """)
    pytester.runpytest_subprocess("-p", "no:randomly").assert_outcomes(passed=4)


def test_two_hundred_tests_at_n2(pytester: pytest.Pytester, smol_state: Path) -> None:
    pytester.makepyfile("""
        import pytest

        @pytest.mark.parametrize("i", range(200))
        def test_many(smol_vm, i):
            smol_vm.write_file("/workspace/i", str(i))
            assert smol_vm.exec("cat /workspace/i").stdout == str(i)
    """)
    pytester.runpytest_subprocess("-n", "2").assert_outcomes(passed=200)


def test_two_runs_at_once_on_one_host(pytester: pytest.Pytester, smol_state: Path) -> None:
    pytester.makepyfile("""
        import pytest

        @pytest.mark.parametrize("i", range(30))
        def test_many(smol_vm, i):
            assert smol_vm.exec("ls /workspace 2>/dev/null | wc -l").stdout.strip() == "0"
            smol_vm.write_file(f"/workspace/{i}", "x")
    """)
    runs = [subprocess.Popen([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", *extra],
                             cwd=pytester.path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for extra in (["-n", "2"], [])]
    for run in runs:
        out, _ = run.communicate(timeout=300)
        assert run.returncode == 0, out
        assert "30 passed" in out


def test_max_vms_caps_live_guests_across_workers(pytester: pytest.Pytester, smol_state: Path) -> None:
    pytester.makepyfile(f"""
        import json, time
        from pathlib import Path
        import pytest

        @pytest.mark.parametrize("i", range(8))
        def test_capped(smol_vm, i):
            live = [p for p in Path({str(smol_state)!r}, "registry").glob("*.json")]
            assert len(live) <= 1, live
            time.sleep(0.05)
    """)
    pytester.runpytest_subprocess("-n", "2", "--smol-max-vms=1").assert_outcomes(passed=8)


def test_a_dead_helper_is_replaced_by_a_retry(pytester: pytest.Pytester, smol_state: Path) -> None:
    pytester.makepyfile(f"""
        import os, signal
        from pathlib import Path

        def helper_pids():
            pids = []
            for entry in Path("/proc").iterdir():
                try:
                    argv = (entry / "cmdline").read_bytes().split(b"\\0")
                except OSError:
                    continue
                if any(a.endswith(b"_nsguest.py") for a in argv) and {state_tag(smol_state)!r}.encode() in argv \\
                        and (entry / "ns/pid").resolve() == Path("/proc/self/ns/pid").resolve():
                    pids.append(int(entry.name))
            return pids

        def test_retry(smol_vm_factory):
            first = smol_vm_factory()
            for pid in helper_pids():
                os.kill(pid, signal.SIGKILL)
            second = smol_vm_factory()  # the first try meets the dead helper; the retry starts a new one
            assert second.exec("echo ok").stdout == "ok\\n"
    """)
    pytester.runpytest_subprocess().assert_outcomes(passed=1)


def test_pytest_timeout_thread_method_without_xdist_leaves_nothing(pytester: pytest.Pytester,
                                                                   smol_state: Path) -> None:
    # The whole pytest process dies (os._exit): its namespace helper outlives it and cleans up.
    pytester.makepyfile("""
        import time
        import pytest

        @pytest.mark.timeout(2, method="thread")
        def test_hangs(smol_vm, smol_vm_factory):
            smol_vm_factory().exec("sleep 300 >/dev/null 2>&1 &", check=True)
            time.sleep(60)
    """)
    result = pytester.runpytest_subprocess()
    assert result.ret != 0
    assert "Timeout" in result.stdout.str() + result.stderr.str()
