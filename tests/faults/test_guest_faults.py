"""Guests under faults from outside: the namespace helper (the zygote) or a guest's init killed
mid-test, the kernel OOM-killing a guest over its memory limit, a full host disk under
``copy_out``.

The test that meets the fault fails or errors with a clear message (no hang, no traceback from
the plugin), the next test gets a working guest, and ``smol_state`` finds nothing left behind.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pytest_smolvm.backends.base import VMSpec
from pytest_smolvm.backends.namespace import cgroups
from pytest_smolvm.backends.namespace.backend import NamespaceBackend
from pytest_smolvm.backends.namespace.cgroups import state_tag
from pytest_smolvm.baselines.baseline import resolve
from pytest_smolvm.errors import ProvisionError
from pytest_smolvm.handle.vm import VM

NS = ["-p", "no:cacheprovider", "--smol-backend=namespace"]

# The inner tests find the helper and guest inits of their own run by the state tag in argv.
FIND = """
import os, signal
from pathlib import Path

def helper_processes(tag, inits):
    found = []
    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\\0")
            nspid = [l for l in (entry / "status").read_text().splitlines() if l.startswith("NSpid:")]
        except OSError:
            continue
        if tag.encode() in argv and nspid and (len(nspid[0].split()) > 2) == inits:
            found.append(int(entry.name))
    return found
"""


def test_the_zygote_killed_mid_test(pytester: pytest.Pytester, smol_state: Path) -> None:
    pytester.makepyfile(FIND + f"""
import pytest
from pytest_smolvm.errors import GuestError

def test_meets_it(smol_vm):
    smol_vm.exec("echo before", check=True)
    zygotes = helper_processes({state_tag(smol_state)!r}, inits=False)
    assert zygotes
    for pid in zygotes:
        os.kill(pid, signal.SIGKILL)
    try:  # its guests outlive it (each has its own channel): this one works on, or says it is gone
        assert smol_vm.exec("echo after", timeout=20).stdout == "after\\n"
    except GuestError as exc:
        assert "gone" in str(exc)

def test_next(smol_vm):
    assert smol_vm.exec("echo fine").stdout == "fine\\n"
""")
    result = pytester.runpytest_subprocess(*NS, "-p", "no:randomly")
    result.assert_outcomes(passed=2)


def test_a_guest_init_killed_mid_test(pytester: pytest.Pytester, smol_state: Path) -> None:
    pytester.makepyfile(FIND + f"""
import pytest
from pytest_smolvm.errors import GuestError

def test_meets_it(smol_vm):
    smol_vm.write_file("/workspace/x", "1")
    for pid in helper_processes({state_tag(smol_state)!r}, inits=True):
        os.kill(pid, signal.SIGKILL)  # every guest of this run: this one and any made ahead
    with pytest.raises(GuestError):
        smol_vm.exec("echo after", timeout=20)

def test_next(smol_vm):
    assert smol_vm.exec("echo fine").stdout == "fine\\n"
""")
    result = pytester.runpytest_subprocess(*NS, "-p", "no:randomly")
    result.assert_outcomes(passed=2)

# The init's own OOM score, once it is its own again: the init holds the commands' score while it
# spawns one, so a command started at that moment may read it before the init puts its own back.
INIT_SCORE = "for i in $(seq 100); do s=$(cat /proc/1/oom_score_adj); [ $s = 0 ] && break; sleep 0.05; done; echo $s"


def test_the_kernel_oom_kills_a_guest_over_its_memory(smol_state: Path) -> None:
    # Backend-level: a pytest run's guest has a 2 GiB disk counted in its memory limit, and
    # neither the marker nor the hook can shrink it; OOM there would cost CI 2 GiB of RAM.
    backend = NamespaceBackend()
    baseline = resolve(None, Path.cwd())
    guests = []
    try:
        guest = backend.create(VMSpec(name="oom-1", baseline=baseline, memory_mb=32, disk_mb=16))
        guests.append(guest)
        vm = VM(guest, backend="namespace", isolation="namespace")
        r = vm.exec("x=$(head -c 200000000 /dev/zero | tr '\\0' a); echo survived", timeout=120)
        assert r.exit_code != 0 and "survived" not in r.stdout, r
        assert "the guest ran out of memory" in r.stderr
        assert vm.exec("echo alive", timeout=30).stdout == "alive\n"  # the hog died, not the guest
        guests.append(backend.create(VMSpec(name="oom-2", baseline=baseline)))
        assert VM(guests[-1], backend="namespace", isolation="namespace").exec("echo fine").stdout == "fine\n"
    finally:
        for made in guests:
            made.destroy()
        backend.close()


def test_an_oom_kills_a_command_not_the_guest_init_that_is_bigger(smol_state: Path) -> None:
    # 24 shells of ~3-6 MB, past the limit whichever disk the guest has (32 MiB on ext4, 32 + 16
    # on a tmpfs): each is smaller than the Python init (~11 MB), which the OOM killer chose
    # before the init ranked its commands first (seen as a CI flake of the test above, whose
    # single hog is sometimes smaller than the init when the limit is hit).
    backend = NamespaceBackend()
    if "memory" not in backend.limits.parents:
        pytest.skip(f"no memory cgroup here: {backend.limits.summary}")
    guest = backend.create(VMSpec(name="oom-many", baseline=resolve(None, Path.cwd()), memory_mb=32, disk_mb=16))
    try:
        vm = VM(guest, backend="namespace", isolation="namespace")
        r = vm.exec("for i in $(seq 24); do (x=$(head -c 3000000 /dev/zero | tr '\\0' a); sleep 2) & done; "
                    "wait; echo done", timeout=120)
        assert r.stdout == "done\n" and "the guest ran out of memory" in r.stderr, r
        assert vm.exec("echo alive", timeout=30).stdout == "alive\n"
        assert vm.exec("cat /proc/self/oom_score_adj", user="nobody").stdout == "1000\n"  # the forked path too
        assert vm.exec(INIT_SCORE).stdout == "0\n"
    finally:
        guest.destroy()
        backend.close()


def test_a_command_is_ranked_first_for_the_oom_killer_from_its_first_instruction(smol_state: Path) -> None:
    # The init wrote the score after the spawn: in ~4% of commands (11 of 300 here) the command
    # ran, and could fork, at the init's own score first, and what it forked then kept that
    # score for good: with the init, bigger, killed before it (a CI flake of the OOM test above).
    backend = NamespaceBackend()
    guest = backend.create(VMSpec(name="oom-rank", baseline=resolve(None, Path.cwd())))
    try:
        vm = VM(guest, backend="namespace", isolation="namespace")
        seen = [vm.exec(["cat", "/proc/self/oom_score_adj"]).stdout for _ in range(200)]
        assert seen == ["1000\n"] * 200, sorted(set(seen))
        assert vm.exec(INIT_SCORE).stdout == "0\n"  # the init put its own back
    finally:
        guest.destroy()
        backend.close()


def test_a_guest_killed_for_memory_while_it_is_set_up_says_so(smol_state: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    # Backend-level, under the marker's floor (MIN_MEMORY_MB): its setup runs in the guest's
    # cgroup and is OOM-killed there, which was reported as "guest setup died without a word".
    # A setup on an ext4 disk now charges under 1 MiB (the helper makes its layers' dirs), so
    # the smallest memory_mb, 1, gets a cgroup limit of 64 KiB here.
    backend = NamespaceBackend()
    if "memory" not in backend.limits.parents:
        pytest.skip(f"no memory cgroup here: {backend.limits.summary}")
    write = cgroups._write
    monkeypatch.setattr(cgroups, "_write", lambda path, value: write(path, str(64 << 10) if value == str(1 << 20) and (
        path.endswith(("memory.max", "memory.limit_in_bytes"))) else value))
    try:
        with pytest.raises(ProvisionError, match=r"killed for memory while it was set up: memory_mb=1 is too small"):
            backend.create(VMSpec(name="oom-setup", baseline=resolve(None, Path.cwd()), memory_mb=1))
    finally:
        backend.close()


def test_copy_out_onto_a_full_disk(pytester: pytest.Pytester, smol_state: Path, small_fs: object) -> None:
    small = small_fs("2m")  # type: ignore[operator]
    pytester.makepyfile(f"""
import os
import pytest
from pytest_smolvm.errors import GuestError

def test_fills_it(smol_vm):
    smol_vm.exec("mkdir -p /workspace/out && head -c 5000000 /dev/urandom > /workspace/out/big", check=True)
    with pytest.raises(GuestError, match="No space left on device"):
        smol_vm.copy_out("/workspace/out", {str(small)!r} + "/out")
    assert os.listdir({str(small)!r}) == []  # the staging dir went with the failure
    smol_vm.exec("rm /workspace/out/big && echo small > /workspace/out/f", check=True)
    assert (smol_vm.copy_out("/workspace/out", {str(small)!r} + "/out") / "f").read_text() == "small\\n"
""")
    pytester.runpytest_subprocess(*NS).assert_outcomes(passed=1)


def test_copy_out_of_a_tree_deeper_than_the_recursion_limit(pytester: pytest.Pytester, smol_state: Path) -> None:
    # Found by the fuzzer (tests/security/test_fuzz_extract.py): removing a 1,050-deep tree went
    # one Python frame per level and raised RecursionError, which is no OSError.
    pytester.makepyfile("""
        import subprocess

        def test_deep(smol_vm, tmp_path):
            smol_vm.exec("mkdir -p /workspace/deep/$(printf 'a/%.0s' $(seq 1050)) && echo x > /workspace/deep/top",
                         check=True)
            try:
                assert (smol_vm.copy_out("/workspace/deep", tmp_path) / "top").read_text() == "x\\n"
                smol_vm.exec("echo y > /workspace/deep/top", check=True)
                again = smol_vm.copy_out("/workspace/deep", tmp_path)  # replaces the deep copy
                assert (again / "top").read_text() == "y\\n"
                assert [p.name for p in tmp_path.iterdir()] == ["deep"]  # no staging dir left
            finally:
                subprocess.run(["rm", "-rf", str(tmp_path)], check=True)  # pytest's own cleanup recurses
    """)
    pytester.runpytest_subprocess(*NS).assert_outcomes(passed=1)
