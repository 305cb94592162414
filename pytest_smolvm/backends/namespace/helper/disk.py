"""Guests' ext4 disks: one disk's making, clean and drop, and the guest side's mount of one.

Part of the namespace backend's helper (see ``__init__``): standard library only. Why an ext4
disk: ``backends/namespace/disk.py``. Making one per guest (a copy of the host's template on a
self-clearing loop device, then the ext4 mount) cost ~3 ms a guest, most of it the kernel's
attach, mount, unmount and detach. So the zygote keeps each disk it makes (its pool:
``diskpool``), as a mount that is in no namespace (``fsmount``), and lends it to one guest at a
time: the guest's setup mounts the same filesystem in the guest's own mount namespace and finds
its layers' empty dirs in a fresh ``guest`` directory on it, made by the zygote; when that
guest's init has been reaped (every process of the guest gone with it, and with them every
mount of its namespace), the zygote removes ``guest``, checks that nothing else is left, makes
the next ``guest`` and lends the disk again. A disk is dropped instead, never lent
half-cleaned, when anything of that fails or when the guest left more than a small tree or made
the image grow on the host's disk: that work is bounded (``REUSE_MAX_ENTRIES``,
``REUSE_MAX_GROWTH``), linear, and never follows a link.

Nothing of a disk can outlive the zygote and the guests it lent it to: the image is an unnamed
``O_TMPFILE``, its loop device clears itself when its last user goes (``LO_FLAGS_AUTOCLEAR``), and
its users are the zygote's fds and the guests' mounts, which all go with their processes.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import stat
import struct
from typing import Any

from pytest_smolvm.backends.namespace.helper.kernel import MS_NODEV, MS_NOSUID, _close_all_but, _libc, _mount

LOOP_CTL_GET_FREE = 0x4C82  # linux/loop.h
LOOP_CONFIGURE = 0x4C0A  # Linux 5.8+: attach and set flags in one call, no window without AUTOCLEAR
LO_FLAGS_AUTOCLEAR = 4  # the device detaches itself when its last user goes
LO_FLAGS_DIRECT_IO = 16  # the image is written without a second page cache on the host
# struct loop_config: fd, block_size, struct loop_info64 (5 u64, 4 u32, 64+64+32 bytes, 2 u64), 8 u64
_LOOP_INFO64 = "=QQQQQIIII64s64s32sQQ"
# The new mount API (Linux 5.2+; the same numbers on every architecture): a mount in no namespace.
SYS_FSOPEN, SYS_FSCONFIG, SYS_FSMOUNT = 430, 431, 432
FSOPEN_CLOEXEC = FSMOUNT_CLOEXEC = 1
FSCONFIG_SET_FLAG, FSCONFIG_SET_STRING, FSCONFIG_CMD_CREATE = 0, 1, 6
MOUNT_ATTR_NOSUID, MOUNT_ATTR_NODEV = 0x2, 0x4
EXT4_IOC_SHUTDOWN = 0x8004587D  # _IOR('X', 125, __u32), as FS_IOC_SHUTDOWN
EXT4_GOING_FLAGS_NOLOGFLUSH = 2  # stop now: flush neither the journal nor the data
# No barriers: a guest's fsync need not reach the host's disk (the disk dies with the zygote);
# inode tables the template left uninitialised stay so (no background zeroing per disk).
MOUNT_FLAGS = ("noinit_itable", "nobarrier")
MOUNT_STRINGS = (("errors", "remount-ro"),)
GUEST_DIR = "guest"  # a guest's layers on its disk (setup.py): the one thing a disk is cleaned of
LAYERS = ("upper", "work", "root")  # made in GUEST_DIR before the disk is lent: the overlay's dirs
# A disk goes back to the pool only if what its guest left is this small: removing an entry
# costs ~13 µs, a fresh disk ~4-6 ms to make and ~1-2 ms to drop, so past ~500 entries a new
# disk is cheaper than a clean one (and the zygote serves no create while it cleans).
REUSE_MAX_ENTRIES = 512
# ... and only while its image holds at most this much more of the host's disk than when it
# was made (freed blocks stay allocated in the image: no discard): the pool's idle disks hold
# at most (template + this) each of the host's disk.
REUSE_MAX_GROWTH = 64 << 20


class DiskError(RuntimeError):
    """A disk could not be made: the create that asked for it fails with this one line."""


class Disk:
    """One ext4 disk: its image, its loop device and a mount of it in no namespace (all fds)."""

    def __init__(self, key: tuple[str, int], image: int, loop: int, mount: int) -> None:
        self.key, self.image, self.loop, self.mount = key, image, loop, mount
        self.fresh_inodes = _inodes_used(mount)
        self.fresh_bytes = os.fstat(image).st_blocks * 512

    def make_layers(self) -> None:
        """Make the next guest's empty ``GUEST_DIR`` and its layers' dirs, off that guest's
        create: four ext4 mkdirs cost its setup ~0.1 ms (tmpfs ones half that)."""
        os.mkdir(GUEST_DIR, 0o755, dir_fd=self.mount)
        top = os.open(GUEST_DIR, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self.mount)
        try:
            for name in LAYERS:
                os.mkdir(name, 0o755, dir_fd=top)
        finally:
            os.close(top)

    def close(self) -> None:
        """Close our fds: the last of these closes (or a guest's mount, if one outlives us) frees it all."""
        for fd in (self.mount, self.loop, self.image):
            try:
                os.close(fd)
            except OSError:
                pass

    def drop(self) -> None:
        """Free it, off the zygote's loop. Unmounting an ext4 writes its dirty pages back to an
        image about to be freed (10,000 small files: ~155 ms) and evicts its inodes (~50 ms):
        so the filesystem is shut down first (no write reaches the image from then on) and the
        last fds are closed by a child of ours, which frees the rest while we serve creates."""
        with contextlib.suppress(OSError):
            root = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=self.mount)
            try:
                fcntl.ioctl(root, EXT4_IOC_SHUTDOWN, struct.pack("I", EXT4_GOING_FLAGS_NOLOGFLUSH))
            finally:
                os.close(root)
        try:
            ours_closed_r, ours_closed_w = os.pipe2(os.O_CLOEXEC)
        except OSError:  # no fds left: free it here, on the loop
            self.close()
            return
        try:
            pid = os.fork()
        except OSError:
            pid = -1
        if pid == 0:  # the child: wait until ours are closed, so that its exit is the last close
            try:
                _close_all_but({ours_closed_r, self.mount, self.loop, self.image})
                os.read(ours_closed_r, 1)
            finally:
                os._exit(0)
        os.close(ours_closed_r)
        self.close()
        os.close(ours_closed_w)  # the zygote's loop reaps the child like any other


def make(request: dict[str, Any], key: tuple[str, int]) -> Disk:
    try:
        return _made(request, key)
    except OSError as exc:
        raise DiskError(f"guest disk: cannot make one in {request['dir']}: {exc.strerror or exc}") from None


def _made(request: dict[str, Any], key: tuple[str, int]) -> Disk:
    src = os.open(request["template"], os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        size = os.fstat(src).st_size
        if size != key[1]:  # a damaged template: fail here, not as a corrupt guest disk
            raise DiskError(f"guest disk: the template image is {size} bytes, not {key[1]}: "
                            f"delete {request['template']} to have it made again")
        image = os.open(request["dir"], os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)  # no name to leak
    except BaseException:
        os.close(src)
        raise
    loop = mount = -1
    try:
        try:
            _copy_sparse(src, image, size)
        finally:
            os.close(src)
        loop = _attach(image)
        try:
            mount = _fsmount(loop)
        except OSError as exc:
            raise DiskError(f"guest disk: cannot mount its ext4 image: {os.strerror(exc.errno or 0)} (if the "
                            f"template {request['template']} is damaged, delete it to have it made again)") from None
        made = Disk(key, image, loop, mount)
        made.make_layers()
        return made
    except BaseException:
        for fd in (mount, loop, image):
            if fd >= 0:
                os.close(fd)
        raise


def _fsmount(loop: int) -> int:
    """The ext4 filesystem on the loop device ``loop``, as a mount fd in no namespace."""
    def call(number: int, *args: Any) -> int:
        result = int(_libc.syscall(ctypes.c_long(number), *args))
        if result < 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
        return result

    context = call(SYS_FSOPEN, b"ext4", ctypes.c_uint(FSOPEN_CLOEXEC))
    try:
        call(SYS_FSCONFIG, context, FSCONFIG_SET_STRING, b"source", f"/proc/self/fd/{loop}".encode(), 0)
        for flag in MOUNT_FLAGS:
            call(SYS_FSCONFIG, context, FSCONFIG_SET_FLAG, flag.encode(), None, 0)
        for name, value in MOUNT_STRINGS:
            call(SYS_FSCONFIG, context, FSCONFIG_SET_STRING, name.encode(), value.encode(), 0)
        call(SYS_FSCONFIG, context, FSCONFIG_CMD_CREATE, None, None, 0)
        return call(SYS_FSMOUNT, context, ctypes.c_uint(FSMOUNT_CLOEXEC),
                    ctypes.c_uint(MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV))
    finally:
        os.close(context)


def clean(disk: Disk) -> bool:
    """Remove what the last guest left (its ``guest`` dir); False if the disk must be dropped."""
    try:
        left = _inodes_used(disk.mount) - disk.fresh_inodes
        if left > REUSE_MAX_ENTRIES or os.fstat(disk.image).st_blocks * 512 - disk.fresh_bytes > REUSE_MAX_GROWTH:
            return False
        root = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=disk.mount)
        try:
            _remove_tree(root, GUEST_DIR, REUSE_MAX_ENTRIES)
        finally:
            os.close(root)
        # Nothing left anywhere, or drop it: an inode still held (the host closes its fd on the
        # guest's upper before it ends the guest) would be the guest's files outliving it.
        if _inodes_used(disk.mount) != disk.fresh_inodes:
            return False
        disk.make_layers()
        return True
    except (OSError, DiskError):
        return False


def _remove_tree(parent: int, name: str, budget: int) -> None:
    """Remove ``name`` in the directory fd ``parent`` and all below it, by fd: nothing is
    resolved by path and no link is followed (a link is an entry, removed). Each entry is
    listed once and the walk keeps its own stack, so depth costs no recursion; more than
    ``budget`` entries raise DiskError."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        top = os.open(name, flags, dir_fd=parent)
    except FileNotFoundError:
        return  # the guest's setup failed before it made its dir
    stack: list[tuple[int, str, list[str]]] = []  # (dir fd, its name in the one below, subdirs to do)

    def enter(fd: int, dirname: str) -> None:
        nonlocal budget
        subdirs: list[str] = []
        stack.append((fd, dirname, subdirs))
        with os.scandir(fd) as entries:
            for entry in entries:
                budget -= 1
                if budget < 0:
                    raise DiskError("guest disk: more left on it than a clean removes")
                if stat.S_ISDIR(entry.stat(follow_symlinks=False).st_mode):
                    subdirs.append(entry.name)
                else:
                    os.unlink(entry.name, dir_fd=fd)

    try:
        enter(top, name)
        while stack:
            fd, dirname, subdirs = stack[-1]
            if subdirs:
                child = subdirs.pop()
                enter(os.open(child, flags, dir_fd=fd), child)
                continue
            stack.pop()
            os.close(fd)
            os.rmdir(dirname, dir_fd=stack[-1][0] if stack else parent)
    finally:
        for fd, _, _ in stack:
            os.close(fd)


def _inodes_used(mount: int) -> int:
    found = os.fstatvfs(mount)
    return found.f_files - found.f_ffree


def mount_disk(loop: int, target: str) -> str:
    """Mount the ext4 filesystem on the loop device fd ``loop`` (the zygote's, lent to this
    guest) on ``target`` in the caller's mount namespace; return the dir that holds the guest's
    layers (``LAYERS``: the zygote made them when it made or cleaned the disk).

    The filesystem is mounted already (the zygote's mount in no namespace): this is a second
    mount of the same superblock, no attach, no journal replay, no options read. (A clone of the
    zygote's mount, ``open_tree``, costs more here: ~50 µs against ~30.)"""
    try:
        _mount(f"/proc/self/fd/{loop}", target, "ext4", MS_NOSUID | MS_NODEV, None)
    finally:
        os.close(loop)
    return os.path.join(target, GUEST_DIR)


def _copy_sparse(src: int, dst: int, size: int) -> None:
    """Copy ``src``'s data segments only (~160 KiB of a template): the holes stay holes."""
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
                raise DiskError("guest disk: the template image ended while being copied")
            start += done
        offset = end
    os.ftruncate(dst, size)


def _attach(image: int) -> int:
    """A free loop device configured on ``image``, as an fd. Another process may take the
    device ``LOOP_CTL_GET_FREE`` named before it is configured: then ask again."""
    control = os.open("/dev/loop-control", os.O_RDWR | os.O_CLOEXEC)
    try:
        for _ in range(64):
            number = fcntl.ioctl(control, LOOP_CTL_GET_FREE)
            fd = os.open(f"/dev/loop{number}", os.O_RDWR | os.O_CLOEXEC)
            info = struct.pack(_LOOP_INFO64, 0, 0, 0, 0, 0, 0, 0, 0,
                               LO_FLAGS_AUTOCLEAR | LO_FLAGS_DIRECT_IO, b"", b"", b"", 0, 0)
            config = struct.pack("=II", image, 0) + info + bytes(64)
            try:
                fcntl.ioctl(fd, LOOP_CONFIGURE, config)
                return fd
            except OSError as exc:
                os.close(fd)
                if exc.errno != errno.EBUSY:
                    raise DiskError(f"guest disk: cannot attach a loop device: {exc.strerror}") from None
        raise DiskError("guest disk: every free loop device was taken before it could be attached")
    finally:
        os.close(control)
