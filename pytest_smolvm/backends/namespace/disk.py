"""A namespace guest's disk: where its writable layer (the overlay upper) lives.

Two kinds. A **tmpfs** costs nothing to make, but its files are RAM charged to the guest's
memory cgroup, whose limit must then be ``memory_mb`` + ``disk_mb`` (else a guest filling its
disk is killed for memory instead of told ENOSPC), so a guest asking for 64 MiB could run a
200 MiB process while its disk was empty. An **ext4** disk is a file on the host's disk,
attached to a loop device and mounted in the guest's own mount namespace: its page cache is
reclaimable, so the cgroup's limit is ``memory_mb`` alone (a process past it is OOM-killed,
files past it are written back), and the disk's size is its own bound (ENOSPC).

Every guest gets an ext4 disk where the host can give one; user-namespace mode (which cannot
mount a block device) and hosts without loop devices or ``mkfs.ext4`` keep the tmpfs, and the
run's summary says so. A disk made for each guest cost ~3 ms a guest (docs/performance.md),
so the helper keeps the disks it makes and lends each to one guest at a time, cleaned between
guests (``helper/disk.py``). This side picks the kind and makes the template, one
``mkfs.ext4`` per host per size.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import shutil
import struct
import subprocess
from pathlib import Path
from typing import Any

from pytest_smolvm.errors import ProvisionError
from pytest_smolvm.host.paths import cache_dir, state_dir

# The template's format; its version is in the file's name, so a change makes a new one.
# A journal, though the disk dies with its guest (nothing to recover): without one, ext4 skips
# every inode deleted in the last minutes when it allocates (ialloc.c's recently_deleted), a
# scan per create, so re-creating 10,000 files just deleted took 4-5 s instead of 0.2 s in a
# guest (docs/performance.md). The journal is left unzeroed (lazy_journal_init), like the inode
# tables (lazy_itable_init, and never zeroed by the kernel later: ``noinit_itable``), so the
# template stays ~160 KiB of data at 2 GiB. No reserved blocks, no blocks kept for growing it
# (resize_inode: ~1 MiB of data per copy), an inode per 8 KiB (a guest's trees are many small files).
MKFS_OPTIONS = ("-q", "-F", "-b", "4096", "-m", "0", "-i", "8192", "-O", "^resize_inode",
                "-E", "lazy_itable_init=1,lazy_journal_init=1,nodiscard", "-L", "smolvm-disk")
TEMPLATE_VERSION = 3
INSTALL_HINT = "apt-get install -y e2fsprogs"
_RAM_FILESYSTEMS = {0x01021994: "tmpfs", 0x858458F6: "ramfs"}  # statfs f_type


def images_dir() -> Path:
    """Where the guests' unnamed images are made: the state dir, on the host's disk (the
    runtime dir is a tmpfs). The leak checks look for loop devices backed by files here."""
    return state_dir() / "disks"


def templates_dir() -> Path:
    return cache_dir() / "disks"


@functools.lru_cache(maxsize=4)
def unavailable(userns: bool, images: Path) -> str | None:
    """Why this host cannot give a guest an ext4 disk (None: it can). Read once per process."""
    if userns:
        return "user-namespace mode cannot mount a block device"
    # 5.8: LOOP_CONFIGURE (attached with AUTOCLEAR set, no window without); 5.10: a volatile overlay
    if _kernel_version() < (5, 10):
        return f"kernel {os.uname().release} is older than 5.10 (no LOOP_CONFIGURE or volatile overlay)"
    if not os.path.exists("/dev/loop-control"):
        return "no /dev/loop-control (no loop devices here)"
    if _mkfs() is None:
        return f"mkfs.ext4 not found ({INSTALL_HINT})"
    try:
        images.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        return f"cannot make {images}: {exc.strerror}"
    ram = _ram_filesystem(images)
    if ram:
        return f"{images} is on a {ram}: a disk image there would be RAM as well"
    return None


def kind(reason: str | None) -> str:
    """"ext4" where the host can give a guest a disk of its own (``reason`` is why it cannot)."""
    return "ext4" if reason is None else "tmpfs"


def template(disk_mb: int) -> Path:
    """The empty ext4 image of ``disk_mb`` MiB every such guest's disk is a copy of; made once
    per host (an unnamed file, linked into place when whole: a crash leaves nothing half made)."""
    folder = templates_dir()
    path = folder / f"ext4-{disk_mb}m-v{TEMPLATE_VERSION}.img"
    if path.exists():
        return path
    mkfs = _mkfs()
    if mkfs is None:
        raise ProvisionError(f"namespace guest disk: mkfs.ext4 not found ({INSTALL_HINT})")
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(folder, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
    try:
        os.ftruncate(fd, disk_mb << 20)
        made = subprocess.run([mkfs, *MKFS_OPTIONS, f"/proc/self/fd/{fd}"], pass_fds=(fd,),
                              capture_output=True, text=True, timeout=60, check=False)
        if made.returncode != 0:
            raise ProvisionError(f"namespace guest disk: mkfs.ext4 failed for a {disk_mb} MiB disk: "
                                 f"{(made.stderr or made.stdout).strip()[-300:]}")
        _link_unnamed(fd, path)
    finally:
        os.close(fd)
    return path


def request(disk_mb: int, images: Path) -> dict[str, Any]:
    """What the helper needs to make a guest's ext4 disk (``helper/disk.py``) in ``images``."""
    return {"template": str(template(disk_mb)), "dir": str(images), "bytes": disk_mb << 20}


def _link_unnamed(fd: int, path: Path) -> None:
    """Give the ``O_TMPFILE`` ``fd`` the name ``path``. ``os.link`` calls link(2), which does
    not follow /proc/self/fd's link: linkat(2) with ``AT_SYMLINK_FOLLOW`` does."""
    at_fdcwd, at_symlink_follow = -100, 0x400
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.linkat(at_fdcwd, f"/proc/self/fd/{fd}".encode(), at_fdcwd, str(path).encode(), at_symlink_follow):
        err = ctypes.get_errno()
        if err != errno.EEXIST:  # EEXIST: another process made the same one meanwhile (identical)
            raise ProvisionError(f"namespace guest disk: cannot save its template as {path}: {os.strerror(err)}")


def _kernel_version() -> tuple[int, int]:
    try:
        major, minor = os.uname().release.split(".")[:2]
        return int(major), int("".join(c for c in minor if c.isdigit()) or 0)
    except ValueError:
        return (0, 0)


def _mkfs() -> str | None:
    return shutil.which("mkfs.ext4") or shutil.which("mkfs.ext4", path="/usr/sbin:/sbin")


def _ram_filesystem(path: Path) -> str | None:
    buf = ctypes.create_string_buffer(256)  # struct statfs: f_type is its first word
    if ctypes.CDLL(None, use_errno=True).statfs(str(path).encode(), buf) != 0:
        return None
    return _RAM_FILESYSTEMS.get(struct.unpack_from("l", buf.raw)[0] & 0xFFFFFFFF)
