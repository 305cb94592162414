"""Issue 42: ``memory_mb`` bounds a guest's processes, ``disk_mb`` its files, neither takes from the other.

A namespace guest's files used to live in a tmpfs charged to its memory cgroup, whose limit was
therefore ``memory_mb`` + ``disk_mb``: a guest asking for 64 MiB ran a 200 MiB process to
completion while its disk was empty. Every guest now gets an ext4 disk (backends/namespace/disk.py),
lent from its helper's pool (test_disk_pool.py): its page cache is reclaimable, so files past
``memory_mb`` are written back while a process past it is OOM-killed, and the disk's size is its bound.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from pytest_smolvm.backends.namespace import disk
from pytest_smolvm.backends.namespace.backend import NamespaceBackend
from pytest_smolvm.backends.namespace.guest import NamespaceGuest
from pytest_smolvm.errors import ProvisionError
from pytest_smolvm.handle.vm import VM
from tests import tools
from tests.leaks import loop_device_bytes, loop_devices

MIB = 1 << 20


def _disk_guest(make_vm: Callable[..., VM], ns_backend: NamespaceBackend, **spec: object) -> tuple[VM, NamespaceGuest]:
    """A guest of ``spec`` (which asks for its memory): it must have an ext4 disk where this host can give one."""
    _require_ext4_disks(ns_backend)
    vm = make_vm(**spec)
    guest = vm._guest
    assert isinstance(guest, NamespaceGuest)
    assert guest.disk == "ext4", "a guest that asked for its memory got a tmpfs disk on a host that can do better"
    return vm, guest


def _require_ext4_disks(ns_backend: NamespaceBackend) -> None:
    if "memory" not in ns_backend.limits.parents:
        pytest.skip(f"no memory cgroup here ({ns_backend.limits.summary})")
    tools.require_ext4_disks(ns_backend.userns)


def _memory_limit(guest: NamespaceGuest) -> int:
    for d in guest.cgroup_dirs:
        for name in ("memory.limit_in_bytes", "memory.max"):
            if Path(d, name).exists():
                return int(Path(d, name).read_text())
    raise AssertionError("the guest has no memory cgroup")


def test_a_64_mib_guest_writes_200_mib_of_files_but_a_200_mib_process_is_oom_killed(
        make_vm: Callable[..., VM], ns_backend: NamespaceBackend) -> None:
    vm, guest = _disk_guest(make_vm, ns_backend, memory_mb=64, disk_mb=512)
    files = vm.exec("for i in 1 2 3 4; do dd if=/dev/zero of=/workspace/f$i bs=1M count=50 2>/dev/null || exit 1; "
                    "done; cat /workspace/f* | wc -c", timeout=120)
    assert files.exit_code == 0 and int(files.stdout) == 200 * MIB, files
    assert guest.oom_kills == 0, "writing files killed a process for memory"
    # The issue's own attack: a pipe whose reader holds 200 MiB in memory (tail keeps its last lines).
    hog = vm.exec("head -c 200m /dev/zero | tail | wc -c", timeout=120)
    assert hog.exit_code != 0 or hog.stdout.strip() != str(200 * MIB), hog
    assert "ran out of memory" in hog.stderr, hog
    assert guest.oom_kills >= 1
    assert vm.exec("cat /workspace/f1 | wc -c", timeout=60).stdout.strip() == str(50 * MIB)  # the guest goes on
    assert _memory_limit(guest) == 64 * MIB  # the processes' memory, and nothing for the disk


def test_writing_past_disk_mb_is_enospc_inside_the_guest(make_vm: Callable[..., VM],
                                                         ns_backend: NamespaceBackend,
                                                         security_env: Path) -> None:
    vm, guest = _disk_guest(make_vm, ns_backend, memory_mb=256, disk_mb=64)
    full = vm.exec("dd if=/dev/zero of=/workspace/big bs=1M count=200", timeout=120)
    assert full.exit_code != 0 and "No space left on device" in full.stderr, full
    assert guest.oom_kills == 0
    # What the host gave it is the disk's size, however much the guest wrote: one loop device of disk_mb
    ours = loop_devices(security_env)
    assert 64 * MIB in map(loop_device_bytes, ours), ours
    # The guest is not broken by it: freeing space lets it write again.
    again = vm.exec("rm /workspace/big && dd if=/dev/zero of=/workspace/small bs=1M count=8 2>&1 && echo ok",
                    timeout=60)
    assert again.exit_code == 0 and again.stdout.strip().endswith("ok"), again


def test_files_deleted_a_moment_ago_leave_their_inodes_to_the_next_ones(make_vm: Callable[..., VM],
                                                                       ns_backend: NamespaceBackend) -> None:
    """ext4 without a journal skips every inode freed in the last minutes when it allocates one,
    scanning past each per create: re-creating 10,000 files deleted a few seconds before took
    4-5 s against 0.2 s (benchmarks/disk_cost.py). Its visible sign is that no freed inode is
    reused; with the disk's journal they are. Timing-free: 50 files, a second apart (ext4 counts
    a deletion as recent only from the next second on)."""
    vm, _guest = _disk_guest(make_vm, ns_backend, memory_mb=256, disk_mb=64)
    listed = "for i in $(seq 50); do echo > /w/$i; done; ls -i /w | awk '{print $1}' | sort -n"
    r = vm.exec(f"mkdir /w && {listed} > /tmp/before && rm -rf /w && sleep 1.2 && mkdir /w && {listed} > /tmp/after "
                "&& comm -12 /tmp/before /tmp/after | wc -l", timeout=60)
    assert r.exit_code == 0 and int(r.stdout) == 50, r


def test_a_damaged_disk_template_fails_closed_and_leaves_nothing(
        make_vm: Callable[..., VM], ns_backend: NamespaceBackend, security_env: Path) -> None:
    size = 37  # a size no other test uses: its template is this test's alone
    _disk_guest(make_vm, ns_backend, memory_mb=64, disk_mb=size)  # makes the template
    template = disk.template(size)
    try:
        with open(template, "r+b") as f:  # the superblock (at 1 KiB) zeroed: no ext4 to mount
            f.seek(1024)
            f.write(bytes(1024))
        # The helper made one disk ahead, from the whole template: a guest may take it. The
        # next has to have a disk made.
        for _ in range(2):
            ns_backend._helper().request({"op": "ping"})  # answered once its work between guests is done
            before = sorted(p.name for p in (security_env / "scratch").iterdir())
            disks_before = loop_devices(security_env)  # the guests' own, and the pool's idle ones
            try:
                make_vm(memory_mb=64, disk_mb=size)
            except ProvisionError as exc:
                raised = exc
                break
        else:
            pytest.fail("a guest was made on a disk copied from a damaged template")
        assert "\n" not in str(raised) and "ext4" in str(raised), raised
        assert sorted(p.name for p in (security_env / "scratch").iterdir()) == before
        deadline = time.monotonic() + 3
        while loop_devices(security_env) != disks_before and time.monotonic() < deadline:
            time.sleep(0.05)
        assert loop_devices(security_env) == disks_before
    finally:
        template.unlink()  # the next run makes it again


def test_a_killed_pytest_leaves_no_disk_behind(pytester: pytest.Pytester, smol_state: Path, cli) -> None:  # type: ignore[no-untyped-def]
    """pytest and its helper SIGKILLed while a guest's ext4 disk is mounted and written: its loop
    device and image go with the guest's processes, the reaper clears the rest (smol_state checks
    loop devices and images too)."""
    tools.require_ext4_disks(os.geteuid() != 0)
    from tests.test_lifecycle import KILL_HELPER_AND_SELF

    pytester.makeconftest(KILL_HELPER_AND_SELF)
    pytester.makepyfile("""
        import pytest
        from conftest import kill_helper_and_self

        @pytest.mark.smol(memory_mb=64)
        def test_crash(smol_vm):
            assert smol_vm._guest.disk == "ext4"
            smol_vm.exec("dd if=/dev/zero of=/workspace/f bs=1M count=20; sleep 300 >/dev/null 2>&1 &", check=True)
            kill_helper_and_self()
    """)
    result = pytester.runpytest_subprocess()
    assert result.ret == -signal.SIGKILL
    deadline = time.monotonic() + 5
    while loop_devices(smol_state) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not loop_devices(smol_state), "a dead run's guest disk outlived its guest"
    assert cli("reap").returncode == 0


def test_a_guest_that_names_no_memory_gets_that_memory_alone_and_a_disk_of_its_own(
        ns_backend: NamespaceBackend) -> None:
    """The issue's rule for every guest, through the pool's one resolved spec (session/spec.py
    fills in the default memory): the default guest's processes get the default 2 GiB and its
    files an ext4 disk, as a guest that names 64 MiB gets 64 MiB. Before, a guest that took the
    default kept a tmpfs disk and a limit of memory + disk (4 GiB)."""
    from pytest_smolvm import Session
    from pytest_smolvm.limits import LIMITS

    _require_ext4_disks(ns_backend)
    with Session(backend="namespace") as session:
        named, default = session.create(memory_mb=64), session.create()
        guests = [vm._guest for vm in (named, default)]
        assert all(isinstance(guest, NamespaceGuest) and guest.disk == "ext4" for guest in guests)
        assert [_memory_limit(guest) for guest in guests] == [64 * MIB, LIMITS.memory_mb * MIB]  # type: ignore[arg-type]
