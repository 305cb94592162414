"""Issue 42: ``memory_mb`` bounds a guest's processes, ``disk_mb`` its files, neither takes from the other.

A namespace guest's files used to live in a tmpfs charged to its memory cgroup, whose limit was
therefore ``memory_mb`` + ``disk_mb``: a guest asking for 64 MiB ran a 200 MiB process to
completion while its disk was empty. Every guest now gets a btrfs subvolume of its own with a
quota of ``disk_mb``, on a filesystem its helper makes once (backends/namespace/disk.py): its page
cache is reclaimable, so files past ``memory_mb`` are written back while a process past it is
OOM-killed, and the quota is the disk's bound. A host that cannot do that keeps the tmpfs.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from pytest_smolvm.backends.base import VMSpec
from pytest_smolvm.backends.namespace import disk
from pytest_smolvm.backends.namespace.backend import NamespaceBackend
from pytest_smolvm.backends.namespace.guest import NamespaceGuest
from pytest_smolvm.baselines.baseline import Baseline
from pytest_smolvm.errors import ProvisionError
from pytest_smolvm.handle.vm import VM
from pytest_smolvm.limits import LIMITS
from tests import tools
from tests.leaks import loop_devices

MIB = 1 << 20


def _disk_guest(make_vm: Callable[..., VM], ns_backend: NamespaceBackend, **spec: object) -> tuple[VM, NamespaceGuest]:
    """A guest of ``spec``: it must have a btrfs disk where this host can give one."""
    _require_btrfs_disks(ns_backend)
    vm = make_vm(**spec)
    guest = vm._guest
    assert isinstance(guest, NamespaceGuest)
    assert guest.disk == "btrfs", "a guest got a tmpfs disk on a host that can do better"
    return vm, guest


def _require_btrfs_disks(ns_backend: NamespaceBackend) -> None:
    if "memory" not in ns_backend.limits.parents:
        pytest.skip(f"no memory cgroup here ({ns_backend.limits.summary})")
    tools.require("mkfs.btrfs", "a namespace guest's disk is a subvolume of its helper's btrfs filesystem")
    why = disk.unavailable(ns_backend.userns, disk.images_dir())
    if why:
        pytest.skip(f"no btrfs guest disks on this host: {why}")


def _memory_limit(guest: NamespaceGuest) -> int:
    for d in guest.cgroup_dirs:
        for name in ("memory.limit_in_bytes", "memory.max"):
            if Path(d, name).exists():
                return int(Path(d, name).read_text())
    raise AssertionError("the guest has no memory cgroup")


def _subvolumes(backend: NamespaceBackend) -> list[str]:
    """The guests' subvolumes, as the helper sees its filesystem (in its own mount namespace)."""
    helper = backend._helper()._proc.pid
    return sorted(p.name for p in Path(f"/proc/{helper}/root{disk.images_dir()}").iterdir())


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


def test_a_guest_that_names_no_memory_gets_the_default_for_its_processes_alone(
        make_vm: Callable[..., VM], ns_backend: NamespaceBackend) -> None:
    """The default guest is bounded as the named one is: its disk takes nothing from its memory."""
    _vm, guest = _disk_guest(make_vm, ns_backend, disk_mb=128)
    assert _memory_limit(guest) == LIMITS.memory_mb * MIB


def test_writing_past_disk_mb_is_a_quota_error_inside_the_guest(make_vm: Callable[..., VM],
                                                                ns_backend: NamespaceBackend) -> None:
    vm, guest = _disk_guest(make_vm, ns_backend, memory_mb=256, disk_mb=64)
    neighbour, _ = _disk_guest(make_vm, ns_backend, memory_mb=256, disk_mb=64)
    full = vm.exec("dd if=/dev/zero of=/workspace/big bs=1M count=200", timeout=120)
    assert full.exit_code != 0 and "quota exceeded" in full.stderr.lower(), full  # EDQUOT (musl: "Quota exceeded")
    assert guest.oom_kills == 0
    # The quota is this guest's: a guest beside it on the same filesystem writes its own 48 MiB.
    theirs = neighbour.exec("dd if=/dev/zero of=/workspace/f bs=1M count=48 2>&1 && echo ok", timeout=60)
    assert theirs.exit_code == 0 and theirs.stdout.strip().endswith("ok"), theirs
    # The guest is not broken by it: freeing space lets it write again.
    again = vm.exec("rm /workspace/big && sync && dd if=/dev/zero of=/workspace/small bs=1M count=8 2>&1 && echo ok",
                    timeout=60)
    assert again.exit_code == 0 and again.stdout.strip().endswith("ok"), again


def test_a_guest_cannot_find_its_neighbours_files_on_the_shared_filesystem(
        make_vm: Callable[..., VM], ns_backend: NamespaceBackend) -> None:
    """Both guests' subvolumes are on one filesystem: neither can reach the other's, nor its root."""
    writer, _ = _disk_guest(make_vm, ns_backend)
    writer.exec("echo canary > /workspace/smolvm-neighbour-canary", check=True)
    reader, _ = _disk_guest(make_vm, ns_backend)
    found = reader.exec("find / -xdev -name 'smolvm-neighbour-canary' 2>/dev/null; "
                        "find / -name 'guest-[0-9]*' -maxdepth 3 2>/dev/null; cat /proc/self/mountinfo", timeout=60)
    assert "smolvm-neighbour-canary" not in found.stdout and "guest-" not in found.stdout, found.stdout
    assert "btrfs" not in found.stdout, found.stdout  # the guest sees its overlay, never the filesystem under it


def test_a_destroyed_guests_subvolume_is_deleted(make_vm: Callable[..., VM], ns_backend: NamespaceBackend) -> None:
    _require_btrfs_disks(ns_backend)
    before = _subvolumes(ns_backend)
    vm, _ = _disk_guest(make_vm, ns_backend)
    vm.exec("dd if=/dev/zero of=/workspace/f bs=1M count=16 2>/dev/null", check=True)
    made = sorted(set(_subvolumes(ns_backend)) - set(before))
    assert len(made) == 1, (before, made)
    vm._guest.destroy()
    deadline = time.monotonic() + 5  # the helper reaps it within a second, then deletes its subvolume
    while made[0] in _subvolumes(ns_backend) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert made[0] not in _subvolumes(ns_backend), "a destroyed guest's files stayed on its helper's filesystem"


def test_a_host_without_btrfs_disks_keeps_the_tmpfs_and_the_limit_counts_it(
        ns_backend: NamespaceBackend, baseline: Baseline, security_env: Path) -> None:
    """The fallback (user-namespace mode, no btrfs, no loop devices, no mkfs.btrfs): a tmpfs disk,
    charged to the guest's cgroup, whose limit therefore adds the disk's size."""
    if "memory" not in ns_backend.limits.parents:
        pytest.skip(f"no memory cgroup here ({ns_backend.limits.summary})")
    backend = NamespaceBackend()
    backend.__dict__["_disks"] = (disk.images_dir(), "this test: a host that cannot")  # the cached answer
    try:
        guest = backend.create(VMSpec(name="sec-tmpfs-disk", baseline=baseline, disk_mb=128))
        try:
            assert guest.disk == "tmpfs"
            assert _memory_limit(guest) == (LIMITS.memory_mb + 128) * MIB
        finally:
            guest.destroy()
    finally:
        backend.close()


def test_a_helper_that_cannot_make_its_filesystem_fails_the_guest_closed_and_leaves_nothing(
        ns_backend: NamespaceBackend, baseline: Baseline, security_env: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    _require_btrfs_disks(ns_backend)
    monkeypatch.setattr(disk, "_mkfs", lambda: "/bin/false")  # a mkfs.btrfs that fails
    backend = NamespaceBackend()  # a fresh helper: the session's has its filesystem already
    before = sorted(p.name for p in (security_env / "scratch").iterdir())
    devices = loop_devices(security_env)
    try:
        with pytest.raises(ProvisionError) as raised:
            backend.create(VMSpec(name="sec-no-disk", baseline=baseline))
        assert "\n" not in str(raised.value) and "mkfs.btrfs failed" in str(raised.value), raised.value
        assert sorted(p.name for p in (security_env / "scratch").iterdir()) == before
        assert loop_devices(security_env) == devices
    finally:
        backend.close()


def test_a_killed_pytest_leaves_no_disk_behind(pytester: pytest.Pytester, smol_state: Path, cli) -> None:  # type: ignore[no-untyped-def]
    """pytest and its helper SIGKILLed while a guest's btrfs disk is mounted and written: the loop
    device and image go with the guest's processes, the reaper clears the rest (smol_state checks
    loop devices and images too)."""
    tools.require("mkfs.btrfs", "a namespace guest's disk is a subvolume of its helper's btrfs filesystem")
    why = disk.unavailable(os.geteuid() != 0, disk.images_dir())
    if why:
        pytest.skip(f"no btrfs guest disks on this host: {why}")
    from tests.test_lifecycle import KILL_HELPER_AND_SELF

    pytester.makeconftest(KILL_HELPER_AND_SELF)
    pytester.makepyfile("""
        import pytest
        from conftest import kill_helper_and_self

        @pytest.mark.smol(memory_mb=64)
        def test_crash(smol_vm):
            assert smol_vm._guest.disk == "btrfs"
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


def test_every_guest_of_a_session_gets_the_disk_whether_or_not_its_test_named_its_memory(
        ns_backend: NamespaceBackend) -> None:
    """Through the pool's one resolved spec (session/spec.py fills in the default memory): the
    guest whose test named ``memory_mb`` and the one that took the default are bounded alike."""
    from pytest_smolvm import Session

    _require_btrfs_disks(ns_backend)
    with Session(backend="namespace") as session:
        named, default = session.create(memory_mb=64), session.create()
        guests = [vm._guest for vm in (named, default)]
        assert [getattr(guest, "disk", None) for guest in guests] == ["btrfs", "btrfs"]
        assert [_memory_limit(guest) for guest in guests if isinstance(guest, NamespaceGuest)] == [
            64 * MIB, LIMITS.memory_mb * MIB]


def test_a_guest_reaches_no_btrfs_ioctl_of_its_disk(vm: VM, probe: Callable[..., dict[str, str]],
                                                    ns_backend: NamespaceBackend) -> None:
    """A subvolume of its own would be a way past its quota, a QGROUP_LIMIT a higher quota: the
    guest holds only overlay files (which pass no btrfs ioctl) and no CAP_SYS_ADMIN. The probe
    gets both through (prints "ok") as root on a bare btrfs directory on the host."""
    _require_btrfs_disks(ns_backend)
    assert getattr(vm._guest, "disk", None) == "btrfs"
    found = probe("btrfs_subvol_create", "btrfs_qgroup_limit")
    assert found["btrfs_subvol_create"] != "ok" and found["btrfs_qgroup_limit"] != "ok", found
