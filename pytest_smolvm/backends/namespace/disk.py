"""A namespace guest's disk: where its writable layer (the overlay upper) lives.

Two kinds. A **btrfs** disk is a subvolume of its own, with a quota of ``disk_mb``, on a btrfs
filesystem its helper makes once (an unnamed image on a loop device, mounted in the helper's
own mount namespace: ``helper/disk.py``). Its page cache is reclaimable, so the guest's cgroup
limit is ``memory_mb`` alone (a process past it is OOM-killed, files past it are written back),
and the quota is the disk's bound (EDQUOT). A subvolume, its quota and its removal cost ~0.1 ms;
an ext4 image per guest, the design before it, cost ~3.5 ms (docs/performance.md). A **tmpfs**
is the fallback where a host cannot do that (user-namespace mode cannot mount a block device;
no btrfs in the kernel, no loop devices or no ``mkfs.btrfs``): its files are RAM charged to the
guest's memory cgroup, whose limit must then be ``memory_mb`` + ``disk_mb``, else a guest filling
its disk would be killed for memory instead of told ENOSPC.

Nothing of a btrfs disk can outlive its helper and guests, whatever dies when: the image is an
unnamed ``O_TMPFILE`` (no path to leave behind), its loop device clears itself when its last user
goes (``LO_FLAGS_AUTOCLEAR``), and its users are the mount in the helper's mount namespace and the
guests' overlays, which go with their processes. This side picks the kind and says what the
helper needs; the helper makes the filesystem, a subvolume per guest, and removes each when its
guest is reaped.
"""

from __future__ import annotations

import ctypes
import functools
import os
import shutil
import struct
from pathlib import Path
from typing import Any

from pytest_smolvm.host.paths import state_dir

INSTALL_HINT = "apt-get install -y btrfs-progs"
# The helper's filesystem: a sparse image that only holds what its guests write (each bounded
# by its quota), so its size is a ceiling for all of them at once, not space taken.
IMAGE_BYTES = 1 << 40
_RAM_FILESYSTEMS = {0x01021994: "tmpfs", 0x858458F6: "ramfs"}  # statfs f_type
# Simple quotas (Linux 6.7+) account a subvolume's extents when they are written, without the
# backref walks of full qgroups at every commit; older kernels get full qgroups.
_SIMPLE_QUOTA = Path("/sys/fs/btrfs/features/simple_quota")


def images_dir() -> Path:
    """Where the helpers' unnamed images are made: the state dir, on the host's disk (the
    runtime dir is a tmpfs). The leak checks look for loop devices backed by files here."""
    return state_dir() / "disks"


@functools.lru_cache(maxsize=4)
def unavailable(userns: bool, images: Path) -> str | None:
    """Why this host cannot give a guest a btrfs disk (None: it can). Read once per process."""
    if userns:
        return "user-namespace mode cannot mount a block device"
    if _kernel_version() < (5, 10):  # overlayfs' volatile (5.10); LOOP_CONFIGURE (5.8)
        return f"kernel {os.uname().release} is older than 5.10"
    if not _kernel_has_btrfs():
        return "this kernel has no btrfs"
    if not os.path.exists("/dev/loop-control"):
        return "no /dev/loop-control (no loop devices here)"
    if _mkfs() is None:
        return f"mkfs.btrfs not found ({INSTALL_HINT})"
    try:
        images.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        return f"cannot make {images}: {exc.strerror}"
    ram = _ram_filesystem(images)
    if ram:
        return f"{images} is on a {ram}: a disk image there would be RAM as well"
    return None


def kind(reason: str | None) -> str:
    """"btrfs" where the host can give a guest a disk of its own, else "tmpfs"."""
    return "btrfs" if reason is None else "tmpfs"


def request(disk_mb: int, images: Path) -> dict[str, Any]:
    """What the helper needs to give a guest a btrfs disk of ``disk_mb`` (``helper/disk.py``)."""
    return {"dir": str(images), "bytes": disk_mb << 20, "image_bytes": IMAGE_BYTES, "mkfs": _mkfs(),
            "simple_quota": _SIMPLE_QUOTA.exists()}


def _kernel_version() -> tuple[int, int]:
    try:
        major, minor = os.uname().release.split(".")[:2]
        return int(major), int("".join(c for c in minor if c.isdigit()) or 0)
    except ValueError:
        return (0, 0)


def _kernel_has_btrfs() -> bool:
    """Built in or loaded (/proc/filesystems), or a module the first mount will load."""
    try:
        with open("/proc/filesystems") as f:
            if any(line.split()[-1:] == ["btrfs"] for line in f):
                return True
    except OSError:
        return False
    release = os.uname().release
    return any(Path(f"/lib/modules/{release}/kernel/fs/btrfs").glob("btrfs.ko*"))


def _mkfs() -> str | None:
    return shutil.which("mkfs.btrfs") or shutil.which("mkfs.btrfs", path="/usr/sbin:/sbin")


def _ram_filesystem(path: Path) -> str | None:
    buf = ctypes.create_string_buffer(256)  # struct statfs: f_type is its first word
    if ctypes.CDLL(None, use_errno=True).statfs(str(path).encode(), buf) != 0:
        return None
    return _RAM_FILESYSTEMS.get(struct.unpack_from("l", buf.raw)[0] & 0xFFFFFFFF)
