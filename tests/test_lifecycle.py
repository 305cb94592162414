"""Every terminal path destroys the guest; failures to destroy are reported, never hidden.

Each test runs a real pytest in a subprocess; ``smol_state`` then checks that no registry
record, scratch dir, guest process, cgroup or mount is left on the host.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests import tools


def test_each_test_gets_a_fresh_guest(pytester: pytest.Pytester, smol_state: Path) -> None:
    pytester.makepyfile("""
        import pytest

        @pytest.mark.parametrize("episode", range(5))
        def test_episode(smol_vm, episode):
            assert smol_vm.exec("ls /workspace/leftover").exit_code != 0, "state leaked in"
            assert "sleep" not in smol_vm.exec("ps -o comm").stdout, "a process leaked in"
            smol_vm.write_file("/workspace/leftover", str(episode))
            smol_vm.exec("sleep 300 >/dev/null 2>&1 &", check=True)
    """)
    pytester.runpytest_subprocess("-p", "no:randomly").assert_outcomes(passed=5)


def test_a_handle_kept_past_its_test_takes_no_more_calls(pytester: pytest.Pytester, smol_state: Path) -> None:
    """A guest handed to its teardown (in the background, off the test's path) is not reachable
    through a handle a test kept: the call is refused, never sent to a guest being destroyed."""
    pytester.makepyfile("""
        import pytest
        from pytest_smolvm.errors import ClosedError

        kept = []

        def test_keeps_it(smol_vm):
            kept.append(smol_vm)

        def test_uses_it_later():
            with pytest.raises(ClosedError, match="is destroyed .*this handle takes no more calls"):
                kept[0].exec("true")
            with pytest.raises(ClosedError, match="^copy_in: guest"):
                kept[0].copy_in(__file__, "/workspace/x")
    """)
    result = pytester.runpytest_subprocess("-p", "no:randomly")
    result.assert_outcomes(passed=2)


def test_files_and_processes_persist_within_a_guest(pytester: pytest.Pytester, smol_state: Path) -> None:
    pytester.makepyfile("""
        def test_persist(smol_vm):
            smol_vm.exec("echo 1 > /tmp/state; sleep 300 >/dev/null 2>&1 & echo $! > /tmp/pid", check=True)
            assert smol_vm.exec("cat /tmp/state").stdout == "1\\n"
            pid = smol_vm.exec("cat /tmp/pid").stdout.strip()
            assert smol_vm.exec(["kill", "-0", pid]).exit_code == 0
            assert smol_vm.exec("hostname").stdout.strip() == smol_vm.name
    """)
    pytester.runpytest_subprocess().assert_outcomes(passed=1)


def test_every_outcome_destroys(pytester: pytest.Pytester, smol_state: Path) -> None:
    pytester.makepyfile("""
        import pytest

        @pytest.fixture
        def broken(smol_vm):
            raise RuntimeError("fixture setup failed after the guest was made")

        def test_pass(smol_vm):
            smol_vm.exec("true", check=True)

        def test_fail(smol_vm):
            smol_vm.exec("echo about to fail")
            assert False

        def test_setup_error(broken):
            pass

        def test_skip_inside(smol_vm):
            pytest.skip("decided inside the test")

        @pytest.mark.xfail(strict=True)
        def test_xfail(smol_vm):
            raise ValueError

        def test_factory_many(smol_vm_factory):
            vms = [smol_vm_factory() for _ in range(3)]
            vms[0].write_file("/workspace/only-here", "x")
            assert [v.exec("test -e /workspace/only-here").exit_code for v in vms] == [0, 1, 1]
            assert len({v.name for v in vms}) == 3
    """)
    result = pytester.runpytest_subprocess()
    result.assert_outcomes(passed=2, failed=1, errors=1, skipped=1, xfailed=1)


def test_provisioning_failure_is_a_setup_error_with_the_backends_message(
        pytester: pytest.Pytester, smol_state: Path) -> None:
    pytester.makepyfile("""
        import pytest

        @pytest.mark.smol(allow_hosts=["no-such-host.invalid"])
        def test_needs_allowlist(smol_vm):
            pass
    """)
    result = pytester.runpytest_subprocess()
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines([
        "*could not provision a guest (infrastructure, not the test): allow_hosts: 'no-such-host.invalid' "
        "does not resolve on the host*"])


def test_failed_test_reports_the_guest_transcript(pytester: pytest.Pytester, smol_state: Path) -> None:
    pytester.makepyfile("""
        def test_fail(smol_vm):
            smol_vm.exec("echo building; echo oops >&2; exit 3")
            smol_vm.exec(["printf", "\\\\377\\\\376 not utf-8"])
            assert False, "reward was 0"
    """)
    result = pytester.runpytest_subprocess()
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([
        "*- smolvm guest smol-*-main-1 -*",
        "$ echo building; echo oops >&2; exit 3    [[]exit 3, *s[]]",
        "  --- stdout (tail)",
        "  building",
        "  --- stderr (tail)",
        "  oops",
        "$ printf \\377\\376 not utf-8    [[]exit 0, *s[]]",
    ])


def test_destroy_failure_warns_and_keeps_the_record(pytester: pytest.Pytester, smol_state: Path, cli: Any) -> None:
    # A real destroy failure: something the host put into the guest's scratch mount point.
    pytester.makepyfile(f"""
        import os

        def test_passes_anyway(smol_vm):
            with open(os.path.join({str(smol_state)!r}, "scratch", smol_vm.name, "pinned"), "w"):
                pass
    """)
    result = pytester.runpytest_subprocess()
    result.assert_outcomes(passed=1, warnings=1)
    result.stdout.fnmatch_lines(["*SmolVMWarning: guest smol-* could not be destroyed*pytest-smolvm reap*"])
    [record] = (smol_state / "registry").glob("*.json")
    name = json.loads(record.read_text())["name"]
    assert cli("ls").stdout.count(name) == 1
    (smol_state / "scratch" / name / "pinned").unlink()
    reaped = cli("reap")
    assert f"removed {name}" in reaped.stdout, reaped


def test_registry_records_every_live_guest(pytester: pytest.Pytester, smol_state: Path) -> None:
    pytester.makepyfile(f"""
        import json, os
        from pathlib import Path

        def test_recorded(smol_vm, smol_vm_factory):
            other = smol_vm_factory()
            records = {{p.stem: json.loads(p.read_text())
                       for p in Path({str(smol_state)!r}, "registry").glob("*.json")}}
            ahead = {{name for name, r in records.items() if r["test_id"] == "(made ahead for the next test)"}}
            assert set(records) - ahead == {{smol_vm.name, other.name}}
            record = records[smol_vm.name]
            assert record["owner_pid"] == os.getpid()
            assert record["worker"] == "main"
            assert record["backend"] == "namespace"
            assert record["test_id"].endswith("::test_recorded")
            assert record["run_id"] and record["data"]["scratch"].endswith(smol_vm.name)
    """)
    pytester.runpytest_subprocess().assert_outcomes(passed=1)


def test_keyboard_interrupt_destroys(pytester: pytest.Pytester, smol_state: Path) -> None:
    pytester.makepyfile("""
        def test_interrupted(smol_vm, smol_vm_factory):
            smol_vm_factory().exec("sleep 300 >/dev/null 2>&1 &")
            raise KeyboardInterrupt
    """)
    result = pytester.runpytest_subprocess()
    assert result.ret == pytest.ExitCode.INTERRUPTED


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_signal_mid_test_destroys(pytester: pytest.Pytester, smol_state: Path, sig: signal.Signals) -> None:
    started = pytester.path / "started"
    pytester.makepyfile(f"""
        import time
        from pathlib import Path

        def test_long(smol_vm):
            smol_vm.exec("sleep 300 >/dev/null 2>&1 &", check=True)
            Path({str(started)!r}).write_text(smol_vm.name)
            time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-p", "no:cacheprovider"], cwd=pytester.path,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 30
    while not started.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert started.exists(), "the test never started"
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == pytest.ExitCode.INTERRUPTED, out
    assert "Traceback" not in out.split("KeyboardInterrupt")[0]


KILL_HELPER_AND_SELF = """
import os, signal
from pathlib import Path

def kill_helper_and_self():
    # SIGKILL for the test process and its namespace helper at once: nothing left to clean up
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if b"_nsguest.py" in cmdline and int(stat.rsplit(")", 1)[1].split()[1]) == os.getpid():
            os.kill(int(entry.name), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_killed_pytest_is_cleaned_up_after_by_its_helper(pytester: pytest.Pytester, smol_state: Path) -> None:
    pytester.makepyfile("""
        import os, signal

        def test_crash(smol_vm, smol_vm_factory):
            smol_vm_factory().exec("sleep 300 >/dev/null 2>&1 &", check=True)
            os.kill(os.getpid(), signal.SIGKILL)
    """)
    result = pytester.runpytest_subprocess()
    assert result.ret == -signal.SIGKILL
    # smol_state checks: no record, scratch dir, process or cgroup is left, with no reap run


def test_killed_pytest_and_helper_leave_nothing_running_and_reap_clears_the_rest(
        pytester: pytest.Pytester, smol_state: Path, cli: Any) -> None:
    pytester.makeconftest(KILL_HELPER_AND_SELF)
    pytester.makepyfile("""
        from conftest import kill_helper_and_self

        def test_crash(smol_vm):
            smol_vm.exec("sleep 300 >/dev/null 2>&1 &", check=True)
            kill_helper_and_self()
    """)
    result = pytester.runpytest_subprocess()
    assert result.ret == -signal.SIGKILL
    listing = cli("ls")
    assert "orphan" in listing.stdout, listing.stdout
    from tests.leaks import guest_processes

    deadline = time.monotonic() + 5
    while guest_processes(smol_state) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not guest_processes(smol_state), "guest processes outlived the crashed pytest"
    reaped = cli("reap")
    assert reaped.returncode == 0 and "removed smol-" in reaped.stdout, reaped
    assert cli("ls").stdout.strip() == "no guests recorded"


def test_next_session_reaps_what_a_dead_run_left(pytester: pytest.Pytester, smol_state: Path) -> None:
    pytester.makeconftest(KILL_HELPER_AND_SELF)
    pytester.makepyfile(test_crash="""
        from conftest import kill_helper_and_self

        def test_crash(smol_vm):
            kill_helper_and_self()
    """)
    pytester.runpytest_subprocess("test_crash.py")
    assert list((smol_state / "registry").glob("*.json"))
    pytester.makepyfile(test_next="def test_ok(smol_vm):\n    pass\n")
    pytester.runpytest_subprocess("test_next.py").assert_outcomes(passed=1)


CONCURRENT_CREATES = """
import os, signal, sys, threading
from pathlib import Path
from pytest_smolvm.backends.base import VMSpec
from pytest_smolvm.backends.namespace.backend import NamespaceBackend
from pytest_smolvm.baselines.baseline import resolve

backend = NamespaceBackend()
baseline = resolve(None, Path.cwd())
backend.prepare_run(baseline)
made = {}

def make(name):
    made[name] = backend.create(VMSpec(name=name, baseline=baseline))

threads = [threading.Thread(target=make, args=(f"together-{i}",)) for i in range(4)]
for thread in threads:
    thread.start()
if sys.argv[1] == "crash":
    # Once the helper has forked every setup (each joins its guest's cgroups first), and
    # before anyone could destroy them: only the helper knows of them now.
    procs = [os.path.join(d, "cgroup.procs") for i in range(4)
             for d in backend.reserve(f"together-{i}")["cgroups"]]
    while not all(os.path.exists(p) and Path(p).read_text().strip() for p in procs):
        pass
    os.kill(os.getpid(), signal.SIGKILL)
for thread in threads:
    thread.join()
for name, guest in sorted(made.items()):
    result = guest.exec(["hostname"], env={}, workdir=None, stdin=None, timeout=10, output_limit=1 << 16)
    print(name, result.stdout.decode().strip())
    guest.destroy()
backend.close()
"""


def test_guests_asked_for_at_once_each_reach_their_asker(smol_state: Path) -> None:
    """The helper sets guests up concurrently and replies as each is ready: every reply must
    reach the thread that asked for that guest."""
    done = subprocess.run([sys.executable, "-c", CONCURRENT_CREATES, "wait"], capture_output=True, text=True,
                          timeout=120, cwd=Path(__file__).parent.parent)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.split("\n")[:-1]
    assert lines == [f"together-{i} together-{i}" for i in range(4)], done.stdout


def test_a_process_killed_while_its_guests_are_set_up_leaves_nothing(smol_state: Path) -> None:
    from pytest_smolvm.backends.namespace import cgroups

    if not cgroups.detect().parents:
        pytest.skip("needs guest cgroups, to see when the helper has forked every setup")
    # smol_state checks that the helper finished the setups it had started and then removed them.
    killed = subprocess.run([sys.executable, "-c", CONCURRENT_CREATES, "crash"], capture_output=True, text=True,
                            timeout=120, cwd=Path(__file__).parent.parent)
    assert killed.returncode == -signal.SIGKILL, killed.stderr


def test_a_guest_recorded_before_its_pid_is_destroyed_through_its_cgroup(tmp_path: Path) -> None:
    """A run killed mid-create leaves a record with no pid yet (NamespaceBackend.reserve):
    destroying it kills what runs in the guest's own cgroup, and never what runs in a cgroup
    a damaged record names that is not a guest's."""
    from pytest_smolvm.backends.namespace import cgroups
    from pytest_smolvm.backends.namespace.guest import destroy_recorded

    limits = cgroups.detect()
    if not limits.parents:
        pytest.skip(f"no cgroup can be made here ({limits.summary})")
    tag = uuid.uuid4().hex[:8]
    guest_dirs = cgroups.create(limits, f"reaptest-{tag}", cpus=None, memory_mb=None, defaults=False)
    bystander_dir = os.path.join(os.path.dirname(guest_dirs[0]), f"bystander-{tag}")
    os.mkdir(bystander_dir)
    half_made = subprocess.Popen(["sleep", "600"])
    bystander = subprocess.Popen(["sleep", "600"])
    try:
        for path in guest_dirs:
            Path(path, "cgroup.procs").write_text(str(half_made.pid))
        Path(bystander_dir, "cgroup.procs").write_text(str(bystander.pid))
        scratch = tmp_path / "scratch"
        scratch.mkdir()
        destroy_recorded({"scratch": str(scratch), "cgroups": guest_dirs})
        assert half_made.wait(timeout=10) == -signal.SIGKILL
        assert not any(os.path.exists(path) for path in guest_dirs) and not scratch.exists()
        with pytest.raises(OSError):  # still holds the bystander: cannot be removed
            destroy_recorded({"cgroups": [bystander_dir]})
        assert bystander.poll() is None, "a cgroup not named as a guest's had its processes killed"
    finally:
        for proc in (half_made, bystander):
            proc.kill()
            proc.wait()
        for path in [*guest_dirs, bystander_dir]:
            with contextlib.suppress(FileNotFoundError):
                cgroups.remove(path)


def test_reap_leaves_guests_of_live_owners_alone(pytester: pytest.Pytester, smol_state: Path) -> None:
    pytester.makepyfile("""
        import subprocess, sys

        def test_reap_during_run(smol_vm):
            out = subprocess.run([sys.executable, "-m", "pytest_smolvm.cli", "reap"],
                                 capture_output=True, text=True).stdout
            assert "nothing to reap" in out
            assert smol_vm.exec("true").exit_code == 0
    """)
    pytester.runpytest_subprocess().assert_outcomes(passed=1)


def test_keep_failed_keeps_only_failed_guests(pytester: pytest.Pytester, smol_state: Path, cli: Any) -> None:
    pytester.makepyfile("""
        def test_pass(smol_vm):
            pass

        def test_fail(smol_vm):
            smol_vm.write_file("/workspace/evidence", "look here")
            assert False
    """)
    result = pytester.runpytest_subprocess("--smol-keep=failed")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*1 guest(s) kept alive for debugging:*",
                                 "*smol-*test_fail*enter: pytest-smolvm shell smol-*",
                                 "*pytest-smolvm reap --kept*"])
    [record] = [json.loads(p.read_text()) for p in (smol_state / "registry").glob("*.json")]
    assert record["kept"] and record["test_id"].endswith("test_fail")
    shell = cli("shell", record["name"], "cat", "/workspace/evidence")
    assert shell.stdout == "look here", shell
    assert "nothing to reap" in cli("reap").stdout  # kept guests survive a plain reap
    assert f"removed {record['name']}" in cli("reap", "--kept").stdout


def test_a_guest_that_cannot_be_kept_does_not_strand_the_others(pytester: pytest.Pytester, smol_state: Path,
                                                                cli: Any) -> None:
    pytester.makepyfile(f"""
        import json, os, signal
        from pathlib import Path

        def test_two(smol_vm_factory):
            first = smol_vm_factory()
            second = smol_vm_factory()
            record = json.loads(Path({str(smol_state)!r}, "registry", second.name + ".json").read_text())
            os.kill(record["data"]["pid"], signal.SIGKILL)  # our own guest's init: its keep must fail
            Path("names").write_text(first.name + " " + second.name)
    """)
    result = pytester.runpytest_subprocess("--smol-keep=always")
    result.assert_outcomes(passed=1)
    first, second = (pytester.path / "names").read_text().split()
    result.stdout.fnmatch_lines([f"*guest {second} could not be kept*it was destroyed instead*"])
    records = {p.stem: json.loads(p.read_text()) for p in (smol_state / "registry").glob("*.json")}
    assert list(records) == [first] and records[first]["kept"]  # kept, not destroyed with the one that failed
    assert f"removed {first}" in cli("reap", "--kept").stdout


def test_two_workers_never_see_each_other(pytester: pytest.Pytester, smol_state: Path) -> None:
    barrier = pytester.mkdir("barrier")
    pytester.makepyfile(f"""
        import pytest, time
        from pathlib import Path

        BARRIER = Path({str(barrier)!r})

        @pytest.mark.parametrize("me", ["a", "b"])
        def test_side(smol_vm, me, worker_id):
            other = "b" if me == "a" else "a"
            smol_vm.write_file(f"/workspace/{{me}}", me)
            smol_vm.exec(f"sleep 300 >/dev/null 2>&1 & echo $! > /tmp/{{me}}.pid", check=True)
            (BARRIER / me).write_text(worker_id)
            deadline = time.monotonic() + 120
            while not (BARRIER / other).exists():
                assert time.monotonic() < deadline, "the other test never ran alongside"
                time.sleep(0.02)
            assert (BARRIER / other).read_text() != worker_id, "both ran on one worker"
            assert smol_vm.exec(f"test -e /workspace/{{other}}").exit_code == 1
            assert smol_vm.exec(f"test -e /tmp/{{other}}.pid").exit_code == 1
            # Ours shows as sleep first (on a loaded host its fork may not have exec'd yet: ps
            # would call it sh), then it must be the only one.
            smol_vm.exec(f"p=$(cat /tmp/{{me}}.pid); i=0; until grep -qx sleep /proc/$p/comm; do "
                         "i=$((i+1)); [ $i -lt 200 ] || exit 1; usleep 10000; done", check=True)
            assert smol_vm.exec("ps -o comm | grep -c sleep").stdout.strip() == "1"
            (BARRIER / f"{{me}}.done").write_text("")
            while not (BARRIER / f"{{other}}.done").exists():  # keep our guest alive for its checks
                assert time.monotonic() < deadline, "the other test never finished"
                time.sleep(0.02)
    """)
    pytester.runpytest_subprocess("-n", "2").assert_outcomes(passed=2)


def test_fifty_tests_at_n2_leave_the_host_as_found(pytester: pytest.Pytester, smol_state: Path,
                                                   shared_cache: Path) -> None:
    before = sorted(p.name for p in (shared_cache / "baselines").iterdir()) if (
        shared_cache / "baselines").is_dir() else None
    pytester.makepyfile("""
        import pytest

        @pytest.mark.parametrize("i", range(50))
        def test_many(smol_vm, i):
            smol_vm.write_file("/workspace/i", str(i))
            assert smol_vm.exec("cat /workspace/i").stdout == str(i)
    """)
    pytester.runpytest_subprocess("-n", "2").assert_outcomes(passed=50)
    if before is not None:
        assert sorted(p.name for p in (shared_cache / "baselines").iterdir()) == before


def test_guest_environment_is_built_from_scratch(pytester: pytest.Pytester, smol_state: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOST_SECRET_TOKEN", "hunter2")
    pytester.makepyfile("""
        import pytest

        @pytest.mark.smol(env={"FROM_MARKER": "yes"})
        def test_env(smol_vm):
            env = smol_vm.exec("env").stdout
            assert "hunter2" not in env and "HOST_SECRET_TOKEN" not in env
            assert "PYTEST" not in env and "SMOLVM" not in env
            assert "FROM_MARKER=yes" in env
            assert smol_vm.exec("echo $PER_CALL", env={"PER_CALL": "1"}).stdout == "1\\n"
            assert smol_vm.exec("echo $PER_CALL").stdout == "\\n"
    """)
    pytester.runpytest_subprocess().assert_outcomes(passed=1)


def test_guest_sees_no_host_files(pytester: pytest.Pytester, smol_state: Path) -> None:
    secret = pytester.path / "host-secret.txt"
    secret.write_text("only on the host")
    pytester.makepyfile(f"""
        import os

        def test_files(smol_vm):
            for path in [{str(secret)!r}, {str(Path.cwd())!r}, {str(Path(sys.executable).parent)!r}, "/work"]:
                assert smol_vm.exec(["test", "-e", path]).exit_code == 1, path
            # Every directory of the guest's root but /proc and /dev (where pipes and /dev/zero never end).
            dirs = "$(ls -d /* | grep -v -e '^/proc$' -e '^/dev$')"
            found = smol_vm.exec(f"grep -rl 'only on the host' {{dirs}} 2>/dev/null", timeout=60)
            assert not found.timed_out and found.stdout == ""
            assert smol_vm.exec("cat /etc/hostname").stdout != open("/etc/hostname").read()
    """)
    pytester.runpytest_subprocess().assert_outcomes(passed=1)


def test_guest_cannot_write_outside_its_scratch(pytester: pytest.Pytester, smol_state: Path,
                                                 shared_cache: Path) -> None:
    pytester.makepyfile("""
        def test_write_everywhere(smol_vm):
            r = smol_vm.exec("echo x > /bin/planted && echo x > /etc/planted && mkdir -p /usr/planted")
            assert r.exit_code == 0, r.stderr  # the guest may write its own root...
            for probe in ["mknod /tmp/disk b 8 0", "mount -t tmpfs none /mnt",
                          "echo 1 > /proc/sys/kernel/panic_on_oops", "hostname evil"]:
                assert smol_vm.exec(probe).exit_code != 0, probe
            assert smol_vm.exec("hostname").stdout.strip() == smol_vm.name[:64]  # unchanged
    """)
    pytester.runpytest_subprocess().assert_outcomes(passed=1)
    # ...but only its own copy: the shared baseline is untouched.
    assert not list(shared_cache.glob("baselines/*/rootfs/bin/planted"))
    assert not list(shared_cache.glob("baselines/*/rootfs/etc/planted"))


def test_guest_cannot_reach_the_hosts_loopback(pytester: pytest.Pytester, smol_state: Path) -> None:
    tools.require("pasta", "a guest with network=True")  # its NAT; nft and ip for its fence and routes
    tools.require("nft", "a guest with network=True")
    tools.require("ip", "a guest with network=True")
    pytester.makepyfile("""
        import socket, threading
        import pytest

        @pytest.fixture
        def host_server():
            server = socket.socket()
            server.bind(("127.0.0.1", 0))
            server.listen(8)
            threading.Thread(target=lambda: [server.accept()[0].close() for _ in range(8)],
                             daemon=True).start()
            yield server.getsockname()[1]
            server.close()

        def test_isolated(smol_vm, host_server):
            r = smol_vm.exec(f"nc -z -w 2 127.0.0.1 {host_server}")
            assert r.exit_code != 0, "the guest reached the host's loopback"
            assert smol_vm.exec("ip -o link | grep -v ' lo:' | wc -l").stdout.strip() == "0"

        @pytest.mark.smol(network=True)
        def test_network_true_is_nat_not_the_hosts(smol_vm, host_server):
            assert smol_vm.exec(f"nc -z -w 2 127.0.0.1 {host_server}").exit_code != 0
    """)
    pytester.runpytest_subprocess().assert_outcomes(passed=2)


def test_baseline_is_unpacked_once_per_host_whatever_n_is(pytester: pytest.Pytester, smol_state: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    cache = pytester.mkdir("fresh-cache")  # nothing unpacked yet: the first guests race for it
    monkeypatch.setenv("PYTEST_SMOLVM_CACHE_DIR", str(cache))
    pytester.makepyfile("""
        import pytest

        @pytest.mark.parametrize("i", range(100))
        def test_many(smol_vm, i):
            assert smol_vm.exec("cat /etc/alpine-release").exit_code == 0
    """)
    first = pytester.runpytest_subprocess("-n", "2")
    first.assert_outcomes(passed=100)
    first.stdout.fnmatch_lines(["smolvm: baseline unpacked once on this host by controller (pid *) in *s at *"])
    log = (cache / "baselines" / "preparations.jsonl").read_text().splitlines()
    assert len(log) == 1, log
    second = pytester.runpytest_subprocess("-n", "2")
    second.assert_outcomes(passed=100)
    second.stdout.fnmatch_lines(["smolvm: baseline unpacked once on this host by controller (pid *) in *s at *"])
    assert len((cache / "baselines" / "preparations.jsonl").read_text().splitlines()) == 1


WARM_CONFTEST = """
import pytest

PREPARED = []

def pytest_smolvm_prepare_baseline(vm, config):
    vm.write_file("/opt/warm/marker", "prepared once")
    vm.exec("echo '#!/bin/sh' > /usr/local/bin/agent && echo 'echo agent ready' >> /usr/local/bin/agent"
            " && chmod +x /usr/local/bin/agent", check=True)

@pytest.fixture(scope="session")
def smol_baseline_setup():
    return ["mkdir -p /srv/data && echo from-commands > /srv/data/seed"]
"""


def test_warm_baseline_is_prepared_once_and_every_test_starts_from_it(
        pytester: pytest.Pytester, smol_state: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = pytester.mkdir("warm-cache")
    monkeypatch.setenv("PYTEST_SMOLVM_CACHE_DIR", str(cache))
    pytester.makeconftest(WARM_CONFTEST)
    pytester.makepyfile("""
        import pytest

        @pytest.mark.parametrize("i", range(20))
        def test_inherits(smol_vm, i):
            assert smol_vm.read_file("/opt/warm/marker") == b"prepared once"
            assert smol_vm.exec("agent").stdout == "agent ready\\n"
            assert smol_vm.exec("cat /srv/data/seed").stdout == "from-commands\\n"
            smol_vm.write_file("/opt/warm/marker", f"changed by {i}")  # never seen by the next test
    """)
    pytester.runpytest_subprocess("-n", "2", "-p", "no:randomly").assert_outcomes(passed=20)
    log = [json.loads(line) for line in (cache / "baselines" / "preparations.jsonl").read_text().splitlines()]
    assert [entry["reference"] for entry in log] == ["bundled alpine", "bundled alpine + setup"]
    pytester.runpytest_subprocess("-n", "2").assert_outcomes(passed=20)
    assert len((cache / "baselines" / "preparations.jsonl").read_text().splitlines()) == 2  # cached

    pytester.makeconftest(WARM_CONFTEST.replace("prepared once", "prepared twice"))  # new setup, new key
    result = pytester.runpytest_subprocess("-n", "2")
    result.assert_outcomes(failed=20)  # the tests assert the old marker: they really see the new one
    result.stdout.fnmatch_lines(["*b'prepared twice' == b'prepared once'*"])


def test_failing_baseline_setup_stops_the_run_once(pytester: pytest.Pytester, smol_state: Path) -> None:
    pytester.makeconftest("""
        def pytest_smolvm_prepare_baseline(vm, config):
            vm.exec("echo installing; echo 'E: package not found' >&2; exit 100", check=True)
    """)
    pytester.makepyfile("""
        import pytest

        @pytest.mark.parametrize("i", range(30))
        def test_never_runs(smol_vm, i):
            pass
    """)
    result = pytester.runpytest_subprocess()
    result.assert_outcomes(errors=1)
    out = result.stdout.str()
    assert "test_never_runs[1]" not in out, out  # one error with the output, not one per test
    result.stdout.fnmatch_lines(["*E: package not found*", "*Interrupted: pytest-smolvm: the baseline setup failed*"])


COPY_IN_TREE_TEST = """
import os, stat

def test_tree(smol_vm, tmp_path):
    src = tmp_path / "task"
    (src / "private").mkdir(parents=True)
    (src / "empty dir").mkdir()
    (src / "run.sh").write_text("#!/bin/sh\\necho ran\\n")
    (src / "run.sh").chmod(0o755)
    (src / "private").chmod(0o700)
    (src / "ünïcode name.txt").write_bytes(bytes(range(256)))
    (src / "link").symlink_to("run.sh")
    os.link(src / "run.sh", src / "hardlink.sh")
    src.chmod(0o750)
    smol_vm.copy_in(src, "/workspace/task")
    smol_vm.copy_in(src / "run.sh", "/workspace/single.sh")
    r = smol_vm.exec("cd /workspace && stat -c '%a %n' task task/private task/run.sh single.sh && "
                     "readlink task/link && ls task/'empty dir' && ./task/run.sh && ./single.sh")
    assert r.exit_code == 0, r.stderr
    assert r.stdout.splitlines() == ["750 task", "700 task/private", "755 task/run.sh", "755 single.sh",
                                     "run.sh", "ran", "ran"]
    assert smol_vm.read_file("/workspace/task/ünïcode name.txt") == bytes(range(256))
    assert smol_vm.exec("stat -c %U:%G /workspace/task/run.sh").stdout == "root:root\\n"
"""


@pytest.mark.parametrize("host_tar", ["gnu-tar", "tarfile"])
def test_copy_in_keeps_trees_on_every_path(pytester: pytest.Pytester, smol_state: Path,
                                           monkeypatch: pytest.MonkeyPatch, host_tar: str) -> None:
    if host_tar == "tarfile":  # no tar on the host's PATH: the pure-Python archiver
        monkeypatch.setenv("PATH", str(pytester.mkdir("empty-bin")))
    pytester.makepyfile(COPY_IN_TREE_TEST)
    pytester.runpytest_subprocess().assert_outcomes(passed=1)
