"""A guest's ext4 disk is lent to the next guest only clean (backends/namespace/helper/disk.py).

The helper keeps the disks it makes and lends each to one guest at a time: what a guest leaves
on its disk is removed once its init has been reaped, by an fd walk that follows no link and
stops at a budget, or the disk is dropped. The guest is the attacker: it may leave links to host
paths, deep trees, many files. Each test gives its guests a disk size no other test uses, so the
disks it watches are its own; the helper also makes one disk of a size ahead, in a quiet moment,
so a test names the disk of each guest (``_disk_of``) rather than count them.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from pytest_smolvm.backends.namespace.backend import NamespaceBackend
from pytest_smolvm.backends.namespace.helper import disk as pool
from pytest_smolvm.backends.namespace.helper import diskpool
from pytest_smolvm.handle.vm import VM
from tests import tools
from tests.leaks import loop_device_bytes, loop_devices

MIB = 1 << 20


@pytest.fixture(autouse=True)
def _ext4_disks(ns_backend: NamespaceBackend) -> None:
    tools.require_ext4_disks(ns_backend.userns)


def _disks_of(state: Path, size_mb: int) -> list[str]:
    """The loop devices of the guest disks of ``size_mb`` (``name: backing file``)."""
    return [line for line in loop_devices(state) if loop_device_bytes(line) == size_mb * MIB]


def _disk_of(vm: VM) -> str:
    """The ``_disks_of`` line of the disk lent to ``vm``: the loop device its upper layer is on."""
    upper = vm._guest.upper_fd  # type: ignore[attr-defined]
    assert upper >= 0, "the guest has no upper layer fd to tell its disk by"
    device = os.fstat(upper).st_dev
    (line,) = [line for line in loop_devices(Path(os.environ["PYTEST_SMOLVM_STATE_DIR"]))
               if Path("/sys/block", line.split(":")[0], "dev").read_text().strip()
               == f"{os.major(device)}:{os.minor(device)}"]
    return line


def _lifetime_writes_kib(line: str) -> int:
    """What the ext4 on that loop device has written since it was made: a disk made afresh starts near 0."""
    return int(Path("/sys/fs/ext4", line.split(":")[0], "lifetime_write_kbytes").read_text())


def _settled(backend: NamespaceBackend, state: Path, size_mb: int) -> list[str]:
    """The disks of ``size_mb`` once the helper has done its work between guests (a destroyed
    guest's disk cleaned or dropped, a disk made ahead): its ping answers after that work."""
    backend._helper().request({"op": "ping"})
    return _disks_of(state, size_mb)


def _dropped(backend: NamespaceBackend, state: Path, size_mb: int, disk: str) -> bool:
    """Whether ``disk`` was dropped: a drop's last close is a child of the helper's, so its
    loop device goes a moment after the helper's work is done."""
    deadline = time.monotonic() + 5
    while disk in _settled(backend, state, size_mb):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_a_disk_is_lent_again_with_nothing_of_the_guest_before(
        make_vm: Callable[..., VM], ns_backend: NamespaceBackend, security_env: Path, tmp_path: Path) -> None:
    size = 43
    canary = tmp_path / "canary"
    canary.mkdir()
    (canary / "keep").write_text("host file")
    first = make_vm(disk_mb=size)
    # Files, a changed baseline file, a 300-deep tree, a fifo, an xattr, links to a host dir, to
    # the disk's own root and outside it: the clean must remove each as an entry, following none.
    r = first.exec(
        "set -e; head -c 4m /dev/urandom > /workspace/secret; echo guest-a >> /etc/hostname; "
        "d=/workspace/deep; for i in $(seq 300); do d=$d/d; done; mkdir -p $d; echo bottom > $d/f; "
        "mkfifo /tmp/fifo; touch /tmp/x; setfattr -n user.a -v 1 /tmp/x 2>/dev/null || true; "
        f"ln -s {canary} /workspace/to-host; ln -s {canary}/keep /workspace/to-host-file; "
        "ln -s ../../.. /workspace/up; ln -s / /workspace/root; sync", timeout=60)
    assert r.exit_code == 0, r
    held = _disk_of(first)
    first._guest.destroy()
    assert held in _settled(ns_backend, security_env, size), "the disk was not kept for the next guest"
    # The next two guests get the one made ahead and the first guest's, in some order.
    after = [make_vm(disk_mb=size), make_vm(disk_mb=size)]
    assert held in map(_disk_of, after), "neither of the next guests got the first one's disk"
    assert _lifetime_writes_kib(held) >= 4096, "the first guest's disk was not the one it wrote"
    fresh = make_vm(disk_mb=size + 1).exec("df -i / | tail -1 | awk '{print $3}'", timeout=30)
    for vm in after:
        seen = vm.exec("ls -A /workspace; ls -A /tmp; grep -c guest-a /etc/hostname || true; "
                       "df -i / | tail -1 | awk '{print $3}'", timeout=30)
        assert seen.exit_code == 0, seen
        lines = seen.stdout.split()
        assert lines[:-1] == ["0"], f"the next guest saw the last one's files: {seen.stdout!r}"
        assert lines[-1] == fresh.stdout.strip(), "the lent disk has more inodes in use than a fresh one"
    assert (canary / "keep").read_text() == "host file"


def test_a_guest_that_leaves_more_than_a_clean_removes_gets_its_disk_dropped(
        make_vm: Callable[..., VM], ns_backend: NamespaceBackend, security_env: Path) -> None:
    size = 47
    first = make_vm(disk_mb=size)
    r = first.exec(f"mkdir /workspace/many && cd /workspace/many && seq {pool.REUSE_MAX_ENTRIES + 100} | "
                   "xargs touch", timeout=60)
    assert r.exit_code == 0, r
    held = _disk_of(first)
    first._guest.destroy()
    assert _dropped(ns_backend, security_env, size, held), "a disk past the clean's budget was kept"
    for vm in (make_vm(disk_mb=size), make_vm(disk_mb=size)):  # the one made ahead, and a new one
        assert vm.exec("ls -A /workspace", timeout=30).stdout == ""
        assert _lifetime_writes_kib(_disk_of(vm)) < 1024, "a next guest got the dropped disk"


def test_a_disk_whose_image_grew_on_the_host_is_dropped(
        make_vm: Callable[..., VM], ns_backend: NamespaceBackend, security_env: Path) -> None:
    """Freed blocks stay allocated in the image (no discard): a disk the guest filled and emptied
    would keep that much of the host's disk while it waits for the next guest."""
    size = 2 * (pool.REUSE_MAX_GROWTH >> 20) + 16
    first = make_vm(disk_mb=size)
    r = first.exec(f"dd if=/dev/zero of=/workspace/big bs=1M count={(pool.REUSE_MAX_GROWTH >> 20) + 8} "
                   "2>/dev/null && sync && rm /workspace/big", timeout=120)
    assert r.exit_code == 0, r
    held = _disk_of(first)
    first._guest.destroy()
    assert _dropped(ns_backend, security_env, size, held), "a disk that grew past its bound was kept"


def test_the_clean_follows_no_link_and_stops_at_its_budget(tmp_path: Path) -> None:
    """The walk itself, on a host tree: links to a host dir and file are removed as entries, a
    chain as deep as the budget allows is removed, and more entries than the budget raise."""
    canary = tmp_path / "canary"
    canary.mkdir()
    (canary / "keep").write_text("host file")
    top = tmp_path / "disk" / pool.GUEST_DIR
    top.joinpath(*["d"] * (pool.REUSE_MAX_ENTRIES - 10)).mkdir(parents=True)
    fd = os.open(tmp_path / "disk", os.O_RDONLY | os.O_DIRECTORY)
    try:
        (top / "to-host").symlink_to(canary)
        (top / "to-file").symlink_to(canary / "keep")
        (top / "d" / "up").symlink_to("../../..")
        pool._remove_tree(fd, pool.GUEST_DIR, pool.REUSE_MAX_ENTRIES)
        assert not top.exists() and (canary / "keep").read_text() == "host file"
        for i in range(50):
            (tmp_path / "disk" / pool.GUEST_DIR / str(i)).mkdir(parents=True)
        with pytest.raises(pool.DiskError):
            pool._remove_tree(fd, pool.GUEST_DIR, 40)
    finally:
        os.close(fd)


def test_as_many_disks_wait_for_the_next_guests_as_were_lent_at_once(
        make_vm: Callable[..., VM], ns_backend: NamespaceBackend, security_env: Path) -> None:
    """More guests at once than the pool's floor (IDLE_MIN) get their disks back as well; the
    idle disks of other sizes (earlier tests') go first. Beyond the floor they were dropped, and
    every later guest past it paid for a new disk."""
    size, count = 53, diskpool.IDLE_MIN + 2
    first = [make_vm(disk_mb=size) for _ in range(count)]
    lent = {_disk_of(vm) for vm in first}
    assert len(lent) == count
    for vm in first:
        vm._guest.destroy()
    kept = set(_settled(ns_backend, security_env, size))
    assert lent <= kept, f"disks lent at once were dropped: {sorted(lent - kept)}"
    again = [make_vm(disk_mb=size) for _ in range(count)]
    assert {_disk_of(vm) for vm in again} <= kept, "a later guest paid for a new disk"
    assert all(vm.exec("ls -A /workspace").stdout == "" for vm in again)


def test_the_helper_outlives_a_disk_it_cannot_drop_properly(
        make_vm: Callable[..., VM], ns_backend: NamespaceBackend, security_env: Path) -> None:
    """A disk is dropped by a child of the helper, through a pipe: with no fd left to make one
    (RLIMIT_NOFILE lowered under the helper's fds), the helper frees the disk itself, and goes
    on making guests. It used to die there, and every guest of its pytest process with it."""
    import resource

    size = 59
    vm = make_vm(disk_mb=size)
    r = vm.exec(f"cd /workspace && seq {pool.REUSE_MAX_ENTRIES + 50} | xargs touch", timeout=60)  # dropped, not cleaned
    assert r.exit_code == 0, r
    helper = ns_backend._helper()._proc.pid
    held = _disk_of(vm)
    limit = resource.prlimit(helper, resource.RLIMIT_NOFILE)
    resource.prlimit(helper, resource.RLIMIT_NOFILE, (3, limit[1]))  # its fds stay; it can open none
    try:
        vm._guest.destroy()
        assert _dropped(ns_backend, security_env, size, held)
    finally:
        resource.prlimit(helper, resource.RLIMIT_NOFILE, limit)
    assert make_vm(disk_mb=size).exec("true").exit_code == 0
    assert ns_backend._helper()._proc.pid == helper, "the helper died (a new one was started)"


def test_the_next_guest_of_a_size_takes_a_clean_disk_made_ahead(
        make_vm: Callable[..., VM], ns_backend: NamespaceBackend, security_env: Path) -> None:
    """While a guest runs, the helper makes a disk of its size ahead; the next guest takes that
    one, not its predecessor's, which waits for a quiet moment to be cleaned: no create in a
    serial run waits on a clean."""
    size = 61
    first = make_vm(disk_mb=size)
    held = _disk_of(first)
    ahead = [line for line in _settled(ns_backend, security_env, size) if line != held]
    assert len(ahead) == 1, f"not one disk was made ahead of the next guest: {ahead}"
    first._guest.destroy()
    second = make_vm(disk_mb=size)
    assert _disk_of(second) == ahead[0]
    assert held in _settled(ns_backend, security_env, size), "the first guest's disk was not kept"
