"""A guest's btrfs disk: a subvolume with a quota of its own on its helper's btrfs filesystem.

Part of the namespace backend's helper (see ``__init__``): standard library only. The zygote
makes the filesystem at its first guest that asks for a disk (``Volumes.ensure``): an unnamed
image on a self-clearing loop device, mounted in a mount namespace of the zygote's own, so no
host process sees it and it goes with the zygote and its guests, whatever dies when. Each
guest's setup process makes its subvolume there, sets its quota and binds it where the guest's
upper layer goes (``mount_volume``); the zygote deletes it when it reaps the guest. Why a btrfs
disk and when: ``backends/namespace/disk.py``.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import signal
import struct
import time
from typing import Any

from pytest_smolvm.backends.namespace.helper.kernel import (
    CLONE_NEWNS,
    MS_BIND,
    MS_NODEV,
    MS_NOSUID,
    MS_REC,
    _libc,
    _mount,
    _unshare,
)

LOOP_CTL_GET_FREE = 0x4C82  # linux/loop.h
LOOP_CONFIGURE = 0x4C0A  # Linux 5.8+: attach and set flags in one call, no window without AUTOCLEAR
LO_FLAGS_AUTOCLEAR = 4  # the device detaches itself when its last user (the mount) goes
LO_FLAGS_DIRECT_IO = 16  # the image is written without a second page cache on the host
# struct loop_config: fd, block_size, struct loop_info64 (5 u64, 4 u32, 64+64+32 bytes, 2 u64), 8 u64
_LOOP_INFO64 = "=QQQQQIIII64s64s32sQQ"
MS_SLAVE, MS_NOATIME = 0x80000, 0x400
BTRFS_SUPER_MAGIC = 0x9123683E


def _ioc(direction: int, number: int, size: int) -> int:
    return (direction << 30) | (size << 16) | (0x94 << 8) | number  # linux/btrfs.h, BTRFS_IOCTL_MAGIC


SUBVOL_CREATE, SNAP_DESTROY = _ioc(1, 14, 4096), _ioc(1, 15, 4096)  # struct btrfs_ioctl_vol_args
QUOTA_CTL = _ioc(3, 40, 16)  # struct btrfs_ioctl_quota_ctl_args: cmd, status
QGROUP_LIMIT = _ioc(2, 43, 48)  # struct btrfs_ioctl_qgroup_limit_args: qgroupid, struct btrfs_qgroup_limit
QUOTA_ENABLE, QUOTA_ENABLE_SIMPLE = 1, 4
LIMIT_MAX_RFER, LIMIT_MAX_EXCL = 1, 2
# Metadata once, not twice (the default's DUP: the disk dies with its guests, nothing to recover),
# no discard of a sparse image that is all holes already.
MKFS_OPTIONS = ("-q", "-f", "-m", "single", "-d", "single", "-K", "-L", "smolvm-disks")
# No barriers: a guest's fsync need not reach the host's disk (the disk dies with the guest).
MOUNT_OPTIONS = "nobarrier"
# Deleting a subvolume that cannot be deleted yet is tried again at each reap, this many times;
# after that it goes with the filesystem, when the zygote exits.
DELETE_TRIES = 100


class Volumes:
    """The zygote's btrfs filesystem and the subvolume of each guest it is setting up or running."""

    def __init__(self) -> None:
        self.root: int | None = None  # the filesystem's top directory
        self.by_pid: dict[int, str] = {}  # a guest's setup process (its init) -> its subvolume
        self.doomed: dict[str, int] = {}  # subvolume -> tries left to delete it
        self._made = 0

    def ensure(self, disk: dict[str, Any]) -> None:
        """The filesystem, made at the first guest that asks for a disk; an error fails that guest."""
        if self.root is None:
            self.root = _make_filesystem(disk)

    def claim(self, disk: dict[str, Any]) -> str:
        """A name for the next guest's subvolume, unique for this zygote's life."""
        self.ensure(disk)
        self._made += 1
        return f"guest-{self._made}"

    def started(self, pid: int, name: str) -> None:
        self.by_pid[pid] = name

    def reaped(self, pid: int) -> None:
        """``pid`` is gone: so is every process of its guest (it was their pid namespace's init)."""
        name = self.by_pid.pop(pid, None)
        if name is not None:
            self.doomed[name] = DELETE_TRIES
        for name, tries in list(self.doomed.items()):
            try:
                assert self.root is not None
                fcntl.ioctl(self.root, SNAP_DESTROY, _vol_args(name))
            except OSError as exc:
                if exc.errno != errno.ENOENT and tries > 1:  # ENOENT: its setup failed before making it
                    self.doomed[name] = tries - 1
                    continue
            del self.doomed[name]


def _vol_args(name: str) -> bytearray:
    # struct btrfs_ioctl_vol_args: an fd (unused here), then the name. A mutable buffer: fcntl.ioctl
    # copies an immutable one into a 1 KiB buffer, and this struct is 4 KiB.
    return bytearray(struct.pack("=q4088s", 0, name.encode()))


def _make_filesystem(disk: dict[str, Any]) -> int:
    image = os.open(disk["dir"], os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)  # no name to leak
    try:
        os.ftruncate(image, int(disk["image_bytes"]))  # sparse: only what guests write takes space
        _mkfs(str(disk["mkfs"]), image)
        loop_fd, device = _attach(image)
    finally:
        os.close(image)  # the loop device holds it now
    try:
        # A mount namespace of our own, where the filesystem covers the (host's, empty) images dir:
        # no host process sees it, and our guests' namespaces are copies of ours. Slave, so host
        # mounts made later still reach us.
        _unshare(CLONE_NEWNS)
        _mount(None, "/", None, MS_REC | MS_SLAVE, None)
        try:
            _mount(device, disk["dir"], "btrfs", MS_NOSUID | MS_NODEV | MS_NOATIME, MOUNT_OPTIONS)
        except OSError as exc:
            reason = os.strerror(exc.errno or 0)
            raise RuntimeError(f"guest disk: cannot mount its btrfs filesystem: {reason}") from None
    finally:
        os.close(loop_fd)  # the mount is its only user now: it detaches when the mount goes
    root = os.open(disk["dir"], os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        command = QUOTA_ENABLE_SIMPLE if disk.get("simple_quota") else QUOTA_ENABLE
        fcntl.ioctl(root, QUOTA_CTL, struct.pack("=QQ", command, 0))
    except OSError as exc:
        os.close(root)
        raise RuntimeError(f"guest disk: cannot turn on btrfs quotas: {exc.strerror}") from None
    return root


def _mkfs(mkfs: str, image: int, timeout: float = 60.0) -> None:
    """Run ``mkfs.btrfs`` on the unnamed ``image``. posix_spawn, not subprocess: subprocess
    imports threading, whose at-fork hook would then run at every guest's fork."""
    given = os.dup(image)
    os.set_inheritable(given, True)
    said_r, said_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        try:
            pid = os.posix_spawn(mkfs, [mkfs, *MKFS_OPTIONS, f"/proc/self/fd/{given}"], dict(os.environ),
                                 file_actions=[(os.POSIX_SPAWN_OPEN, 0, "/dev/null", os.O_RDONLY, 0),
                                               (os.POSIX_SPAWN_DUP2, said_w, 1), (os.POSIX_SPAWN_DUP2, said_w, 2)])
        except OSError as exc:
            raise RuntimeError(f"guest disk: mkfs.btrfs did not run: {exc.strerror}") from None
        finally:
            os.close(said_w)
            os.close(given)
        said, status, deadline = b"", None, time.monotonic() + timeout
        while status is None:
            try:
                said = (said + os.read(said_r, 1 << 16))[-4096:]
            except BlockingIOError:
                pass
            done, code = os.waitpid(pid, os.WNOHANG)
            if done:
                status = os.waitstatus_to_exitcode(code)
            elif time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                raise RuntimeError(f"guest disk: mkfs.btrfs took more than {timeout:.0f} s")
            else:
                time.sleep(0.005)
        try:  # what it wrote after our last read (it has exited: the pipe holds all there is)
            said = (said + os.read(said_r, 1 << 16))[-4096:]
        except BlockingIOError:
            pass
    finally:
        os.close(said_r)
    if status != 0:
        lines = said.decode(errors="replace").strip().splitlines()
        raise RuntimeError(f"guest disk: mkfs.btrfs failed: {lines[-1] if lines else f'exit status {status}'}")


def mount_volume(disk: dict[str, Any], target: str) -> None:
    """Make the guest's subvolume ``disk["volume"]``, bound it by ``disk["bytes"]`` and bind it on
    ``target``, in the caller's mount namespace (a copy of the zygote's, where the filesystem is)."""
    root = os.open(disk["dir"], os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        if _filesystem_type(root) != BTRFS_SUPER_MAGIC:  # fail closed: never the host's own directory
            raise RuntimeError("guest disk: the helper's btrfs filesystem is not mounted")
        name = str(disk["volume"])
        try:
            fcntl.ioctl(root, SUBVOL_CREATE, _vol_args(name))
            volume = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=root)
        except OSError as exc:
            raise RuntimeError(f"guest disk: cannot make its btrfs subvolume: {exc.strerror}") from None
        try:
            size = int(disk["bytes"])
            limit = struct.pack("=6Q", 0, LIMIT_MAX_RFER | LIMIT_MAX_EXCL, size, size, 0, 0)
            try:  # qgroup id 0: the subvolume the fd is in
                fcntl.ioctl(volume, QGROUP_LIMIT, limit)
            except OSError as exc:
                raise RuntimeError(f"guest disk: cannot set its quota: {exc.strerror}") from None
            _mount(f"/proc/self/fd/{volume}", target, None, MS_BIND, None)
        finally:
            os.close(volume)
    finally:
        os.close(root)


def _filesystem_type(fd: int) -> int:
    buf = ctypes.create_string_buffer(256)  # struct statfs: f_type is its first word
    if _libc.fstatfs(ctypes.c_int(fd), buf) != 0:
        return 0
    return int(struct.unpack_from("l", buf.raw)[0]) & 0xFFFFFFFF


def _attach(image: int) -> tuple[int, str]:
    """A free loop device configured on ``image``; its fd and path. Another process may take
    the device ``LOOP_CTL_GET_FREE`` named before it is configured: then ask again."""
    control = os.open("/dev/loop-control", os.O_RDWR | os.O_CLOEXEC)
    try:
        for _ in range(64):
            number = fcntl.ioctl(control, LOOP_CTL_GET_FREE)
            device = f"/dev/loop{number}"
            fd = os.open(device, os.O_RDWR | os.O_CLOEXEC)
            info = struct.pack(_LOOP_INFO64, 0, 0, 0, 0, 0, 0, 0, 0,
                               LO_FLAGS_AUTOCLEAR | LO_FLAGS_DIRECT_IO, b"", b"", b"", 0, 0)
            config = struct.pack("=II", image, 0) + info + bytes(64)
            try:
                fcntl.ioctl(fd, LOOP_CONFIGURE, config)
                return fd, device
            except OSError as exc:
                os.close(fd)
                if exc.errno != errno.EBUSY:
                    raise OSError(exc.errno, f"guest disk: cannot attach a loop device: {exc.strerror}") from None
        raise OSError(errno.EBUSY, "guest disk: every free loop device was taken before it could be attached")
    finally:
        os.close(control)
