"""``vm.branch`` on the namespace backend: a child whose files are its parent's, as they are now.

A namespace guest's files are its overlay's upper layer (a tmpfs in the guest's own mount
namespace) over the baseline. Its setup hands the host that upper as a directory fd (helper/
setup.py ``_send_upper``); to branch, the host

1. freezes the parent, so the copy is of one instant: its cgroup's ``cgroup.freeze`` on cgroup
   v2, else SIGSTOP to every process of its cgroup (again until none is left running, as a
   process may fork meanwhile), then SIGCONT to exactly those;
2. copies the upper into a layer dir of the first child (``<runtime>/layers/<name>``, 0700),
   walking by fds only: every name the guest wrote is opened relative to its parent's fd with
   ``O_NOFOLLOW``, links are copied as links (never followed), hard links stay linked, FIFOs and
   overlay whiteouts (0/0 character devices) are made anew, sockets and any other device are
   left out, directories' xattrs (overlay's opaque mark) are kept. A file's holes stay holes:
   only its data is copied (``SEEK_DATA``/``SEEK_HOLE``; ``copy_file_range`` alone writes a
   hole's zeros on tmpfs), so a ``truncate -s 1G`` file costs the host its data, not its size.
   Bounded: entries (counted as a directory is listed, never after), bytes (the data copied and
   the xattrs, against what the guest's disk holds) and depth; past a bound the branch fails,
   nothing is left;
3. thaws the parent, then hard-links that layer for each further child (the host's own tree);
4. makes each child with ``lowerdir=<layer>:<baseline>`` and a fresh upper of its own.

Processes are not carried (no checkpoint of memory): each child starts with only its init, and
says so in its log. A child cannot reach its parent's or a sibling's files: its layer is a copy,
read-only under its overlay, and its own writes go to its own upper.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import socket
import stat
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from pytest_smolvm.backends.namespace.channel import receive_fds
from pytest_smolvm.errors import GuestError, ProvisionError
from pytest_smolvm.host.procs import process_start_time
from pytest_smolvm.untrusted.walk import rmtree

if TYPE_CHECKING:
    from pytest_smolvm.backends.base import Guest, VMSpec
    from pytest_smolvm.backends.namespace.guest import NamespaceGuest

NOT_CARRIED = ("pytest-smolvm: branched from {parent}: its files as they were, not its processes "
               "(the namespace backend carries no process state)")
MAX_ENTRIES = 1_000_000  # files, dirs and links in one upper: the copy is linear, and bounded
MAX_GENERATIONS = 32  # a branch of a branch of ...: each level is one more overlay lower layer
MAX_DEPTH = 256  # nested dirs: two fds per level stay open while the walk is below it
FREEZE_SECONDS = 5.0
COPY_CHUNK = 1 << 30
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def receive_upper(ctl: socket.socket, name: str) -> int:
    """The upper-layer dir fd the guest's setup sent on its control socket."""
    data, fds = receive_fds(ctl, 1, f"namespace guest {name}: its upper layer never came")
    try:
        if len(fds) != 1 or json.loads(data) != {"upper": True}:
            raise ValueError(data)
    except ValueError:
        for fd in fds:
            os.close(fd)
        raise ProvisionError(f"namespace guest {name}: a malformed upper-layer message") from None
    return fds[0]


def branch(create: Callable[[VMSpec, list[Path]], NamespaceGuest], parent: NamespaceGuest,
           specs: Sequence[VMSpec], state: Path) -> list[Guest]:
    """One child per spec, all made or none (see the module's docstring).

    A child's layers are ``<runtime>/layers/<its name>/<k>``: 0 its parent's upper, then its
    parent's own layers (a branch of a branch), each hard-linked from the parent's: a child
    owns its layers, so destroying its parent first takes nothing from under it.
    """
    if parent.upper_fd < 0:
        raise GuestError(f"guest {parent.name} is gone or was made without its upper layer; cannot branch it")
    if len(parent.layers) + 1 > MAX_GENERATIONS:
        raise GuestError(f"guest {parent.name} is a branch {len(parent.layers)} levels deep; "
                         f"the namespace backend branches at most {MAX_GENERATIONS} deep")
    layers_dir = state / "layers"
    layers_dir.mkdir(mode=0o700, exist_ok=True)
    owned = [layers_dir / spec.name for spec in specs]
    children: list[NamespaceGuest] = []
    try:
        budget = _Budget(parent_bytes(specs))
        first = owned[0]
        os.mkdir(first, 0o700)
        with frozen(parent):
            _copy_into(parent.upper_fd, first / "0", budget, link=False)
        for index, ancestor in enumerate(parent.layers, 1):
            with _dir_fd(ancestor) as src:
                _copy_into(src, first / str(index), _Budget(budget.bytes_limit), link=True)
        stack = [first / str(index) for index in range(len(parent.layers) + 1)]
        for mine in owned[1:]:
            os.mkdir(mine, 0o700)
            for layer in stack:
                with _dir_fd(layer) as src:
                    _copy_into(src, mine / layer.name, _Budget(budget.bytes_limit), link=True)
        for spec, mine in zip(specs, owned, strict=True):
            child = create(spec, [mine / layer.name for layer in stack])
            child.layers = [mine / layer.name for layer in stack]
            child.note = NOT_CARRIED.format(parent=parent.name)
            children.append(child)
    except BaseException:
        for child in children:
            with contextlib.suppress(Exception):
                child.destroy()  # its layers go with it (guest.destroy_recorded)
        for mine in owned:
            if mine.is_dir():
                with contextlib.suppress(OSError):
                    rmtree(mine)
        raise
    return list(children)


def parent_bytes(specs: Sequence[VMSpec]) -> int:
    return max(spec.disk_mb for spec in specs) << 20  # a child's disk holds no more than its parent's


# ---------------------------------------------------------------------- freezing


def _members(guest: NamespaceGuest) -> list[int]:
    """Host pids of the guest's processes: its cgroup's members, else its init's descendants."""
    for path in guest.cgroup_dirs:
        try:
            with open(os.path.join(path, "cgroup.procs")) as f:
                return [int(line) for line in f if line.strip()]
        except OSError:
            continue
    found: list[int] = []
    queue = [guest.pid]
    while queue and len(found) < MAX_ENTRIES:
        pid = queue.pop()
        found.append(pid)
        with contextlib.suppress(OSError):
            for task in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{task}/children") as f:
                    queue += [int(p) for p in f.read().split()]
    return found


def _stopped(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] in (b"T", b"t", b"Z", b"X")
    except (OSError, IndexError):
        return True  # gone: nothing of it runs


@contextlib.contextmanager
def frozen(guest: NamespaceGuest) -> Iterator[None]:
    """Nothing of ``guest`` runs inside this block; it runs again after, as it was."""
    if process_start_time(guest.pid) != guest.pid_start:
        raise GuestError(f"guest {guest.name} is gone (its init exited); cannot branch it")
    v2 = [p for p in guest.cgroup_dirs if os.path.exists(os.path.join(p, "cgroup.freeze"))]
    if v2:
        with _cgroup_frozen(v2[0], guest.name):
            yield
        return
    stopped: set[int] = set()
    try:
        deadline = time.monotonic() + FREEZE_SECONDS
        while True:
            running = [pid for pid in _members(guest) if pid not in stopped or not _stopped(pid)]
            if not running:
                break
            if time.monotonic() > deadline:
                raise GuestError(f"guest {guest.name}: its processes did not all stop within {FREEZE_SECONDS:g}s")
            for pid in running:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGSTOP)
                    stopped.add(pid)
            time.sleep(0.001)
        yield
    finally:
        for pid in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


@contextlib.contextmanager
def _cgroup_frozen(path: str, name: str) -> Iterator[None]:
    with open(os.path.join(path, "cgroup.freeze"), "w") as f:
        f.write("1")
    try:
        deadline = time.monotonic() + FREEZE_SECONDS
        while "frozen 1" not in Path(path, "cgroup.events").read_text():
            if time.monotonic() > deadline:
                raise GuestError(f"guest {name}: its cgroup did not freeze within {FREEZE_SECONDS:g}s")
            time.sleep(0.001)
        yield
    finally:
        with open(os.path.join(path, "cgroup.freeze"), "w") as f:
            f.write("0")


# ---------------------------------------------------------------------- the copy


class _Budget:
    def __init__(self, bytes_limit: int) -> None:
        self.bytes_limit = bytes_limit
        self.bytes = 0
        self.entries = 0

    def entry(self) -> None:
        self.entries += 1
        if self.entries > MAX_ENTRIES:
            raise GuestError(f"branch: the guest's files hold more than {MAX_ENTRIES} entries")

    def take(self, size: int) -> None:
        """``size`` bytes about to be written: a file's data (never its holes) or an xattr."""
        self.bytes += size
        if self.bytes > self.bytes_limit:
            raise GuestError(f"branch: the guest's files hold more than {self.bytes_limit >> 20} MiB")


@contextlib.contextmanager
def _dir_fd(path: Path | str, at: int | None = None) -> Iterator[int]:
    fd = os.open(path, DIR_FLAGS, dir_fd=at)
    try:
        yield fd
    finally:
        os.close(fd)


def _copy_into(src_root: int, dest: Path, budget: _Budget, *, link: bool) -> None:
    """Copy the tree at ``src_root`` (a dir fd) into the new dir ``dest``; ``link``: hard-link
    regular files (``src_root`` is then a layer this host made, never a guest's own dir)."""
    os.mkdir(dest, 0o700)
    # Read through a fresh open of the root: on some filesystems (btrfs, Linux 6.5+) an open
    # directory lists only the entries it had when it was opened, and the guest's upper fd was
    # opened before the guest wrote any.
    with _dir_fd(".", src_root) as fresh, _dir_fd(dest) as dst_root:
        st = os.fstat(fresh)
        _attributes(fresh, dst_root, st, budget)
        _copy_dir(fresh, dst_root, dst_root, "", budget, link, {}, 0)


def _copy_dir(src: int, dst: int, dst_root: int, rel: str, budget: _Budget, link: bool,
              inodes: dict[tuple[int, int], str], depth: int) -> None:
    if depth > MAX_DEPTH:
        raise GuestError(f"branch: the guest's files nest deeper than {MAX_DEPTH} directories")
    names = []
    with os.scandir(src) as entries:
        for entry in entries:  # counted as it is read: a directory of ten million names stops at the bound
            budget.entry()
            names.append(entry.name)
    for name in names:
        st = os.stat(name, dir_fd=src, follow_symlinks=False)
        mode = st.st_mode
        path = f"{rel}/{name}" if rel else name
        if stat.S_ISDIR(mode):
            os.mkdir(name, 0o700, dir_fd=dst)
            with _dir_fd(name, src) as sub_src, _dir_fd(name, dst) as sub_dst:
                _copy_dir(sub_src, sub_dst, dst_root, path, budget, link, inodes, depth + 1)
                _attributes(sub_src, sub_dst, os.fstat(sub_src), budget)  # after its contents: its times stay
        elif stat.S_ISREG(mode):
            key = (st.st_dev, st.st_ino)
            if link or (st.st_nlink > 1 and key in inodes):
                source = inodes.get(key) if not link else None
                if source is not None:
                    os.link(source, name, src_dir_fd=dst_root, dst_dir_fd=dst, follow_symlinks=False)
                else:
                    os.link(name, name, src_dir_fd=src, dst_dir_fd=dst, follow_symlinks=False)
                continue
            _copy_file(src, dst, name, st, budget)
            if st.st_nlink > 1:
                inodes[key] = path
        elif stat.S_ISLNK(mode):
            os.symlink(os.readlink(name, dir_fd=src), name, dir_fd=dst)  # the text, never followed
            _owner(dst, name, st)
        elif stat.S_ISFIFO(mode):
            os.mkfifo(name, 0o600, dir_fd=dst)
            _owner(dst, name, st)
            os.chmod(name, stat.S_IMODE(mode), dir_fd=dst, follow_symlinks=False)
        elif stat.S_ISCHR(mode) and st.st_rdev == 0:  # an overlay whiteout: a deleted baseline file
            os.mknod(name, stat.S_IFCHR | 0o000, 0, dir_fd=dst)
        # sockets, and devices the guest could not have made: left out


def _copy_file(src: int, dst: int, name: str, st: os.stat_result, budget: _Budget) -> None:
    fd_in = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=src)
    try:
        if (os.fstat(fd_in).st_ino, os.fstat(fd_in).st_dev) != (st.st_ino, st.st_dev):
            raise GuestError(f"branch: {name!r} changed while the guest was frozen")
        fd_out = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                         dir_fd=dst)
        try:
            os.ftruncate(fd_out, st.st_size)  # its length, all hole: only its data is written below
            for start, end in _data_extents(fd_in, st.st_size):
                while start < end:
                    count = min(end - start, COPY_CHUNK)
                    budget.take(count)
                    moved = _copy_range(fd_in, fd_out, start, count)
                    budget.bytes -= count - moved
                    if moved == 0:
                        break  # shorter than it was: the frozen guest cannot shrink it, but never loop
                    start += moved
            _attributes(fd_in, fd_out, st, budget)
        finally:
            os.close(fd_out)
    finally:
        os.close(fd_in)


def _data_extents(fd: int, size: int) -> Iterator[tuple[int, int]]:
    """``(start, end)`` of each run of ``fd``'s data below ``size``, its holes skipped (``SEEK_DATA``
    and ``SEEK_HOLE``; a filesystem that knows neither is all data). Each run holds data, so the
    runs are as many as the pages the guest wrote at most: the walk is linear in its data."""
    pos = 0
    while pos < size:
        try:
            start = os.lseek(fd, pos, os.SEEK_DATA)
        except OSError as e:
            if e.errno == errno.ENXIO:
                return  # a hole to the end
            if pos == 0 and e.errno in (errno.EINVAL, errno.EOPNOTSUPP):
                yield 0, size
                return
            raise
        if start >= size:
            return
        end = min(os.lseek(fd, start, os.SEEK_HOLE), size)
        if end <= start:
            return  # never loop
        yield start, end
        pos = end


def _copy_range(fd_in: int, fd_out: int, offset: int, count: int) -> int:
    """Up to ``count`` bytes at ``offset`` from ``fd_in`` to the same offset of ``fd_out``."""
    try:
        return os.copy_file_range(fd_in, fd_out, count, offset, offset)
    except OSError:  # EXDEV (an ext4 upper to the tmpfs runtime dir on Linux 5.19+), and older kernels
        os.lseek(fd_out, offset, os.SEEK_SET)
        return os.sendfile(fd_out, fd_in, offset, count)


def _attributes(src_fd: int, dst_fd: int, st: os.stat_result, budget: _Budget) -> None:
    """Owner, mode, xattrs (overlay's opaque mark included; their bytes count) and times of
    ``src_fd`` onto ``dst_fd``."""
    if os.geteuid() == 0:
        os.fchown(dst_fd, st.st_uid, st.st_gid)
    os.fchmod(dst_fd, stat.S_IMODE(st.st_mode))  # after the chown, which drops set-id bits
    with contextlib.suppress(OSError):
        for key in os.listxattr(src_fd):
            with contextlib.suppress(OSError):
                value = os.getxattr(src_fd, key)
                budget.take(len(os.fsencode(key)) + len(value))
                os.setxattr(dst_fd, key, value)
    os.utime(dst_fd, ns=(st.st_atime_ns, st.st_mtime_ns))


def _owner(dst: int, name: str, st: os.stat_result) -> None:
    if os.geteuid() == 0:
        os.chown(name, st.st_uid, st.st_gid, dir_fd=dst, follow_symlinks=False)
