"""A guest's ext4 disk: an unnamed copy of the host's template on a self-clearing loop device.

Part of the namespace backend's helper (see ``__init__``): standard library only. Runs in the
guest's setup process, as root, after it has joined the guest's cgroups and made its mount
namespace, so the mount is the guest's alone and the copy's page cache is charged to the guest.
Why an ext4 disk and when: ``backends/namespace/disk.py``.
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct
from typing import Any

from pytest_smolvm.backends.namespace.helper.kernel import MS_NODEV, MS_NOSUID, _mount

LOOP_CTL_GET_FREE = 0x4C82  # linux/loop.h
LOOP_CONFIGURE = 0x4C0A  # Linux 5.8+: attach and set flags in one call, no window without AUTOCLEAR
LO_FLAGS_AUTOCLEAR = 4  # the device detaches itself when its last user (the mount) goes
LO_FLAGS_DIRECT_IO = 16  # the image is written without a second page cache on the host
# struct loop_config: fd, block_size, struct loop_info64 (5 u64, 4 u32, 64+64+32 bytes, 2 u64), 8 u64
_LOOP_INFO64 = "=QQQQQIIII64s64s32sQQ"
# No barriers: a guest's fsync need not reach the host's disk (the disk dies with the guest);
# inode tables the template left uninitialised stay so (no background zeroing per guest).
MOUNT_OPTIONS = "noinit_itable,nobarrier,errors=remount-ro"


def mount_disk(disk: dict[str, Any], target: str) -> None:
    """Mount a fresh copy of ``disk["template"]`` on ``target`` (in the caller's mount namespace)."""
    src = os.open(disk["template"], os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        size = os.fstat(src).st_size
        if size != int(disk["bytes"]):  # a damaged template: fail here, not as a corrupt guest disk
            raise RuntimeError(f"guest disk: the template image is {size} bytes, not {disk['bytes']}: "
                               f"delete {disk['template']} to have it made again")
        image = os.open(disk["dir"], os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)  # no name to leak
        try:
            _copy_sparse(src, image, size)
            loop_fd, device = _attach(image)
        finally:
            os.close(image)  # the loop device holds it now
    finally:
        os.close(src)
    try:
        _mount(device, target, "ext4", MS_NOSUID | MS_NODEV, MOUNT_OPTIONS)
    except OSError as exc:
        raise RuntimeError(f"guest disk: cannot mount its ext4 image: {os.strerror(exc.errno or 0)} (if the "
                           f"template {disk['template']} is damaged, delete it to have it made again)") from None
    finally:
        os.close(loop_fd)  # the mount is its only user now: it detaches when the mount goes


def _copy_sparse(src: int, dst: int, size: int) -> None:
    """Copy ``src``'s data segments only (~1 MiB of a template): the holes stay holes."""
    offset = 0
    while offset < size:
        try:
            start = os.lseek(src, offset, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno != errno.ENXIO:
                raise
            break  # nothing but a hole to the end
        end = os.lseek(src, start, os.SEEK_HOLE)
        while start < end:
            try:
                done = os.copy_file_range(src, dst, end - start, start, start)
            except OSError as exc:
                if exc.errno not in (errno.EXDEV, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOSYS):
                    raise
                done = os.pwrite(dst, os.pread(src, min(end - start, 1 << 20), start), start)
            if done <= 0:
                raise RuntimeError("guest disk: the template image ended while being copied")
            start += done
        offset = end
    os.ftruncate(dst, size)


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
