"""Unpacking a tar stream the guest controls onto the host, without trusting one byte of it.

Every tree that comes out of a guest (``copy_out``, a warm baseline's export) and every image
layer goes through :func:`extract`. :mod:`pytest_smolvm.untrusted.tarstream` only parses the stream.
``tarfile``'s extraction filters would not keep the host safe (on Pythons before 3.9.23 /
3.10.18 / 3.11.13 / 3.12.11 / 3.13.4 they let nested-symlink trees through: CVE-2025-4517,
CVE-2025-4330, CVE-2025-4138, CVE-2024-12718). The rules, checked by this module alone:

- Paths are walked one component at a time from a directory fd with ``O_NOFOLLOW``: a symlink
  the stream made is never resolved by the host (in an image layer, only a symlink whose target
  is an existing directory inside the tree is followed, resolved by this module, clamped to it).
- Only regular files, directories and symlinks are made; devices, FIFOs and sockets are refused
  (or skipped where a layer's own rules say so). Files are created ``O_EXCL | O_NOFOLLOW``;
  modes, owners and times are set through the new file's own fd, never through a path.
- A hard link may only name a regular file already in the tree, reached without a symlink.
- Bytes (read from the stream and written to disk: a sparse member counts at its full size)
  and members are capped while reading, and every read has a deadline.
"""

from __future__ import annotations

import errno
import os
import select
import stat
import time
from dataclasses import dataclass
from typing import IO

from pytest_smolvm.errors import GuestError
from pytest_smolvm.untrusted.tarstream import (
    BLOCKDEV,
    CHARDEV,
    DIRECTORY,
    FIFO,
    RECORD_SIZE,
    REGULAR,
    SYMLINK,
    Member,
    TarFormatError,
    TarReader,
)

DEFAULT_MAX_BYTES = 4 << 30  # what one copy_out may write to the host
DEFAULT_MAX_MEMBERS = 1_000_000
DEFAULT_TIMEOUT = 900.0  # seconds for one whole stream
HEADER_ALLOWANCE = 1536  # stream bytes per member beyond its data: header, long-name and PAX blocks
MAX_NAME = 4096
MAX_LINK_HOPS = 40
CHUNK = 1 << 20
HOLE_MIN = 1 << 16  # zero runs at least this long (one read's worth) are left as holes
ZEROS = bytes(CHUNK)
DIR_CACHE = 64  # parent dir fds kept open at once
FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class UnsafeArchive(GuestError):
    """A guest-made (or image) archive broke a rule; the message names the member."""


@dataclass(frozen=True)
class Caps:
    max_bytes: int = DEFAULT_MAX_BYTES
    max_members: int = DEFAULT_MAX_MEMBERS
    timeout: float = DEFAULT_TIMEOUT


class BoundedReader:
    """A stream with a byte cap and a deadline on every read.

    A pipe or socket is polled and read with ``os.read`` (one read returns what is there; a
    buffered ``read(n)`` would block until n bytes came): hand it a stream nothing has read yet.
    """

    def __init__(self, raw: IO[bytes], *, max_bytes: int, timeout: float, what: str) -> None:
        self._raw = raw
        self._left = max_bytes
        self._max = max_bytes
        self._timeout = timeout
        self._deadline = time.monotonic() + timeout
        self._what = what
        try:
            fd = raw.fileno()
            mode = os.fstat(fd).st_mode
            self._fd = fd if stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode) else -1
        except (AttributeError, OSError, ValueError):
            self._fd = -1

    @property
    def is_pipe(self) -> bool:
        return self._fd >= 0

    def read(self, size: int = -1) -> bytes:
        if size is None or size < 0:
            size = CHUNK
        remaining = self._deadline - time.monotonic()
        if remaining <= 0:
            raise self._late()
        size = min(size, self._left + 1)
        if self._fd >= 0:
            ready = select.poll()
            ready.register(self._fd, select.POLLIN)
            if not ready.poll(int(remaining * 1000) + 1):
                raise self._late()
            data = os.read(self._fd, size)
        else:
            data = self._raw.read(size)
        self._left -= len(data)
        if self._left < 0:
            raise UnsafeArchive(f"{self._what}: more than {self._max} bytes (the cap); refused")
        return data

    def _late(self) -> UnsafeArchive:
        return UnsafeArchive(f"{self._what}: the guest's stream took longer than {self._timeout:.0f}s; refused")


@dataclass
class Policy:
    """What a kind of stream may contain and how its members land."""

    what: str  # how errors name the operation
    # Every member must be this name or under it ("" for any), or be named relative to the
    # copied tree (".", "./sub"), which puts it under this name.
    prefix: str = ""
    layer: bool = False  # an image layer: whiteouts, owners, full modes, in-tree links followed
    squash_owner: bool = False
    # A layer a guest wrote (a warm export): normalised like a copy, bar owners and links (see _mode).
    guest_export: bool = False


class Extractor:
    """One stream unpacked under ``dest`` (an existing directory); see the module docstring."""

    def __init__(self, dest: str | os.PathLike[str], policy: Policy, caps: Caps) -> None:
        self.policy = policy
        self.caps = caps
        self.root_fd = os.open(dest, DIR_FLAGS)
        self.written = 0
        self.members = 0
        self.regular: set[str] = set()  # regular files this stream made, for hard links
        self.this_layer: set[str] = set()
        self.directories: list[tuple[str, int, float]] = []
        self.as_root = hasattr(os, "geteuid") and os.geteuid() == 0
        self.owners_used = policy.layer and self.as_root and not policy.squash_owner
        self.umask = _umask()
        self._dirs: dict[tuple[str, ...], int] = {}  # parent dirs walked, by their parts
        self._stale: list[int] = []
        self._last_head: str | None = None  # the last checked name's dir part, and its parts
        self._last_parts: list[str] = []
        self.symlinks: list[tuple[list[str], str]] = []  # copy_out's links, judged on the final tree

    def close(self) -> None:
        for fd in [*self._dirs.values(), *self._stale]:
            os.close(fd)
        os.close(self.root_fd)

    # ---------------------------------------------------------------- names and walking

    def _refuse(self, name: str, why: str) -> UnsafeArchive:
        return UnsafeArchive(f"{self.policy.what}: refused {name!r}: {why}")

    def _parts(self, raw_name: str) -> list[str]:
        """A member name as path components; anything that could leave the tree is refused."""
        head, _, base = raw_name.rpartition("/")
        if head == self._last_head and base not in ("", ".", "..") and len(raw_name) <= MAX_NAME \
                and "\0" not in base:
            # The same dir as the last name: every check below depends on the head alone.
            return [*self._last_parts, base]
        parts = self._check_parts(raw_name)
        if len(parts) >= 2 and parts[-1] == base:
            self._last_head, self._last_parts = head, parts[:-1]
        return parts

    def _check_parts(self, raw_name: str) -> list[str]:
        if len(raw_name) > MAX_NAME or "\0" in raw_name:
            raise self._refuse(raw_name[:200], "name too long or not a path")
        name = raw_name
        if self.policy.layer:
            name = name.lstrip("/")
        elif name.startswith("/"):
            raise self._refuse(raw_name, "absolute name")
        parts = [p for p in name.split("/") if p not in ("", ".")]
        if ".." in parts:
            if self.policy.layer:
                raise UnsafeArchive(f"archive member {raw_name!r} points outside the rootfs")
            raise self._refuse(raw_name, "'..' in its name")
        prefix = self.policy.prefix
        if prefix and (name == "." or name.startswith("./")):
            return [prefix, *parts]  # named relative to the copied tree (a guest's own tar)
        if prefix and (not parts or parts[0] != prefix):
            raise self._refuse(raw_name, "unexpected member")
        return parts

    def _open_dir(self, parts: list[str], name: str, *, create: bool, follow: bool | None = None) -> int:
        """An fd of the directory ``parts`` names, walked from the root without following links.

        In a layer, a symlink whose target (resolved here, within the tree) is an existing
        directory is followed: images have ``/lib -> usr/lib``. Nothing else is.
        """
        follow = self.policy.layer if follow is None else follow
        fd = os.dup(self.root_fd)
        stack: list[str] = []
        queue = list(parts)
        hops = 0
        try:
            while queue:
                comp = queue.pop(0)
                if comp in ("", "."):
                    continue
                if comp == "..":  # only from a link target, in a layer: clamped at the root
                    if stack:
                        stack.pop()
                    os.close(fd)
                    fd = self._reopen(stack)
                    continue
                try:
                    next_fd = os.open(comp, DIR_FLAGS, dir_fd=fd)
                except FileNotFoundError:
                    if not create or hops:
                        raise self._through_link(name) if hops else self._refuse(name, "no such directory") from None
                    os.mkdir(comp, 0o755, dir_fd=fd)
                    next_fd = os.open(comp, DIR_FLAGS, dir_fd=fd)
                except OSError as exc:
                    if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                        raise
                    st = os.stat(comp, dir_fd=fd, follow_symlinks=False)
                    if not stat.S_ISLNK(st.st_mode) or not follow:
                        what = "a symlink" if stat.S_ISLNK(st.st_mode) else "not a directory"
                        raise self._refuse(name, f"its parent {'/'.join([*stack, comp])!r} is {what}") from None
                    hops += 1
                    if hops > MAX_LINK_HOPS:
                        raise self._through_link(name) from None
                    target = os.readlink(comp, dir_fd=fd)
                    if target.startswith("/"):
                        stack = []
                        os.close(fd)
                        fd = os.dup(self.root_fd)
                    queue = [p for p in target.split("/") if p] + queue
                    continue
                os.close(fd)
                fd = next_fd
                stack.append(comp)
            return fd
        except BaseException:
            os.close(fd)
            raise

    def _reopen(self, stack: list[str]) -> int:
        fd = os.dup(self.root_fd)
        for comp in stack:
            try:
                next_fd = os.open(comp, DIR_FLAGS, dir_fd=fd)
            finally:
                os.close(fd)
            fd = next_fd
        return fd

    def _through_link(self, name: str) -> UnsafeArchive:
        return UnsafeArchive(f"archive member {name!r} would be written through a link to outside the rootfs")

    # ---------------------------------------------------------------- members

    def run(self, tar: TarReader) -> None:
        for member in tar:
            self.members += 1
            if self.members > self.caps.max_members:
                raise UnsafeArchive(f"{self.policy.what}: more than {self.caps.max_members} members (the cap)")
            try:
                self.member(tar, member)
            except (OSError, OverflowError, ValueError) as exc:  # e.g. ENOSPC, an absurd mtime or uid
                raise UnsafeArchive(f"{self.policy.what}: cannot unpack {member.name[:200]!r}: {exc}") from exc
        self.finish()

    def member(self, tar: TarReader, member: Member) -> None:
        parts = self._parts(member.name)
        if not parts:
            return  # the tree's own root ("." or "/")
        name = "/".join(parts)
        layer = self.policy.layer
        kind = member.kind
        if kind in (CHARDEV, BLOCKDEV, FIFO):
            if layer:
                return  # the guest gets its own /dev; overlay whiteouts in an export are char devices
            what = "a FIFO" if kind == FIFO else "a device"
            raise self._refuse(member.name, f"{what}; only regular files, directories and symlinks come out")
        parent_fd = self._parent(parts, member.name)
        base = parts[-1]
        try:
            if layer and base == ".wh..wh..opq":
                self._clear(parent_fd, "/".join(parts[:-1]))
                return
            if layer and base.startswith(".wh."):
                self._remove(parent_fd, base[len(".wh."):])
                return
            if kind == REGULAR:
                self._make_file(tar, parent_fd, base, name, member)
            elif kind == DIRECTORY:
                self._make_dir(parent_fd, base, name, member)
            elif kind == SYMLINK:
                self._make_symlink(parent_fd, base, name, member)
            else:
                self._make_hardlink(parent_fd, base, name, member)
            if layer:
                self.this_layer.add(name)
        finally:
            while self._stale:  # forgotten while this member still used its parent's fd
                os.close(self._stale.pop())

    def _parent(self, parts: list[str], name: str) -> int:
        """The fd of a member's parent dir, walked once and kept while nothing is removed.

        Tar streams list a directory's entries together, so most members reuse the last walk.
        An fd names the directory itself: only a removal (which empties this cache) can make
        a walked path mean another directory, and nothing else changes what a path resolves to.
        """
        key = tuple(parts[:-1])
        fd = self._dirs.get(key)
        if fd is None:
            if len(self._dirs) >= DIR_CACHE:
                self._forget()
            fd = self._dirs[key] = self._open_dir(parts[:-1], name, create=True)
        return fd

    def _forget(self) -> None:
        self._stale.extend(self._dirs.values())
        self._dirs.clear()

    def _mode(self, member: Member) -> int:
        mode = member.mode
        if self.policy.layer and not self.policy.guest_export:
            return mode & 0o7777  # an image's own modes (its setuid su included)
        directory = member.kind == DIRECTORY
        if self.policy.guest_export:
            # A warm root keeps its sticky /tmp and its owners' rights, but nothing a host user
            # could run as root (setuid/setgid) or write into (a world-writable non-sticky dir).
            mode &= 0o1777
            if directory and mode & 0o002 and not mode & 0o1000:
                mode &= ~0o022
        else:
            # Out of a guest: no setuid/setgid/sticky, no group/other write (tarfile's "data" rule).
            mode &= 0o755
        # The host must always be able to walk and remove what it unpacked (a 0000 dir would not).
        return mode | 0o700 if directory else mode

    def _owner(self, member: Member) -> tuple[int, int] | None:
        if not self.policy.layer or not self.as_root:
            return None  # copy_out: the host user owns what it copied
        return (0, 0) if self.policy.squash_owner else (member.uid, member.gid)

    def _clear_entry(self, parent_fd: int, base: str, *, keep_dir: bool) -> None:
        try:
            st = os.stat(base, dir_fd=parent_fd, follow_symlinks=False)
        except FileNotFoundError:
            return
        if stat.S_ISDIR(st.st_mode):
            if keep_dir:
                return
            self._forget()
            _rmtree_at(parent_fd, base)
        else:
            self._forget()
            os.unlink(base, dir_fd=parent_fd)

    def _make_dir(self, parent_fd: int, base: str, name: str, member: Member) -> None:
        try:
            os.mkdir(base, 0o700, dir_fd=parent_fd)
        except FileExistsError:
            self._clear_entry(parent_fd, base, keep_dir=True)
            try:
                os.mkdir(base, 0o700, dir_fd=parent_fd)
            except FileExistsError:
                pass  # a directory already: members may repeat one
        owner = self._owner(member)
        if owner is not None:
            os.chown(base, *owner, dir_fd=parent_fd, follow_symlinks=False)
        self.directories.append((name, self._mode(member), member.mtime))

    def _make_symlink(self, parent_fd: int, base: str, name: str, member: Member) -> None:
        if not self.policy.layer:
            if not _link_stays_inside(name, member.linkname, self.policy.prefix):
                raise self._refuse(member.name, f"its link {member.linkname!r} leaves the copied tree")
            self.symlinks.append((name.split("/"), member.name))
        try:
            os.symlink(member.linkname, base, dir_fd=parent_fd)
        except FileExistsError:
            self._clear_entry(parent_fd, base, keep_dir=False)
            os.symlink(member.linkname, base, dir_fd=parent_fd)
        owner = self._owner(member)
        if owner is not None:
            os.chown(base, *owner, dir_fd=parent_fd, follow_symlinks=False)

    def _make_hardlink(self, parent_fd: int, base: str, name: str, member: Member) -> None:
        target_parts = self._parts(member.linkname)
        target = "/".join(target_parts)
        if not target_parts or (not self.policy.layer and target not in self.regular):
            raise self._refuse(member.name, f"hard link to {member.linkname!r}, not a file this archive made")
        # The target's own parents must not be links either: no following, even in a layer.
        try:
            target_fd = self._open_dir(target_parts[:-1], member.name, create=False, follow=False)
        except UnsafeArchive:
            raise self._refuse(member.name, f"hard link to {member.linkname!r} goes through a link") from None
        try:
            try:
                st = os.stat(target_parts[-1], dir_fd=target_fd, follow_symlinks=False)
            except FileNotFoundError:
                raise self._refuse(member.name, f"hard link to missing {member.linkname!r}") from None
            if not stat.S_ISREG(st.st_mode):
                raise self._refuse(member.name, f"hard link to {member.linkname!r}, which is no regular file")
            if target == name:
                return
            self._clear_entry(parent_fd, base, keep_dir=False)
            os.link(target_parts[-1], base, src_dir_fd=target_fd, dst_dir_fd=parent_fd, follow_symlinks=False)
        finally:
            os.close(target_fd)
        self.regular.add(name)

    def _make_file(self, tar: TarReader, parent_fd: int, base: str, name: str, member: Member) -> None:
        mode = self._mode(member)
        try:
            fd = os.open(base, FILE_FLAGS, mode & 0o777, dir_fd=parent_fd)
        except FileExistsError:
            self._clear_entry(parent_fd, base, keep_dir=False)
            fd = os.open(base, FILE_FLAGS, mode & 0o777, dir_fd=parent_fd)
        try:
            # Counted at the size of its data, before a byte lands: a sparse file by its stored
            # segments (its holes stay holes here, as do long zero runs of any file).
            size = member.size
            if self.written + size > self.caps.max_bytes:
                raise UnsafeArchive(f"{self.policy.what}: more than {self.caps.max_bytes} bytes "
                                    f"(the cap) at {member.name!r}; refused")
            self.written += size
            if member.sparse is None:
                whole = tar.small()
                holes = False
                for view in (whole,) if whole is not None else tar.data():
                    if len(view) >= HOLE_MIN and ZEROS.startswith(view):
                        os.lseek(fd, len(view), os.SEEK_CUR)  # a guest's zeros cost the host no blocks
                        holes = True
                        continue
                    while view:
                        view = view[os.write(fd, view):]
                if holes:
                    os.ftruncate(fd, member.size)
            else:
                self._write_sparse(tar, fd, member)
            owner = self._owner(member) if self.policy.layer else None
            if owner is not None:
                os.fchown(fd, *owner)
            # open() gave the file mode & ~umask; chmod only what that left out (chown clears setuid).
            if owner is not None or mode & ~0o777 or mode & self.umask:
                os.fchmod(fd, mode)
            os.utime(fd, (member.mtime, member.mtime))
        finally:
            os.close(fd)
        self.regular.add(name)

    def _write_sparse(self, tar: TarReader, fd: int, member: Member) -> None:
        assert member.sparse is not None
        end = stored = 0
        for offset, length in member.sparse:
            if offset < end or length < 0 or offset + length > member.realsize:
                raise self._refuse(member.name, "a sparse map out of order or past the file's size")
            end = offset + length
            stored += length
        if stored != member.size:
            raise self._refuse(member.name, "a sparse map that does not match its data")
        data = tar.data()
        pending = memoryview(b"")
        for offset, length in member.sparse:
            os.lseek(fd, offset, os.SEEK_SET)
            while length:
                if not pending:
                    pending = next(data)
                piece, pending = pending[:length], pending[length:]
                length -= len(piece)
                while piece:
                    piece = piece[os.write(fd, piece):]
        for _ in data:
            pass  # the padding
        os.ftruncate(fd, member.realsize)

    def _remove(self, parent_fd: int, base: str) -> None:
        if base and base not in (".", ".."):
            self._clear_entry(parent_fd, base, keep_dir=False)

    def _clear(self, dir_fd: int, dir_name: str) -> None:
        self._forget()
        for entry in os.listdir(dir_fd):
            full = f"{dir_name}/{entry}" if dir_name else entry
            if full not in self.this_layer:
                self._clear_entry(dir_fd, entry, keep_dir=False)

    def finish(self) -> None:
        """Links judged, then directory modes and times last (deepest first): a 0555 dir must not
        block its own members."""
        for parts, raw in self.symlinks:
            if not self._resolves_inside(parts):
                raise self._refuse(raw, "its link resolves outside the copied tree (through other links)")
        for name, mode, mtime in reversed(self.directories):
            try:
                fd = self._open_dir(name.split("/"), name, create=False)
            except (UnsafeArchive, FileNotFoundError):
                continue  # replaced by a later member
            try:
                os.fchmod(fd, mode)
                os.utime(fd, (mtime, mtime))
            finally:
                os.close(fd)


    def _resolves_inside(self, parts: list[str]) -> bool:
        """Whether the link at ``parts`` stays in the copied tree, resolved as the kernel would.

        Spelling is not enough: with ``d/up -> ..``, ``d/up/d/up/../..`` climbs two levels for
        one ``d/up`` it names. So every component is looked up in the finished tree (links the
        stream made before or after this one included) and each link met is expanded in turn.
        A component that does not exist is taken lexically, which can only climb less than the
        kernel would let it (the kernel stops there).
        """
        top = 1 if self.policy.prefix else 0
        stack = parts[:-1]
        if len(stack) < top:
            return False
        fd = self._dirs_fd(stack)
        if fd < 0:
            return False
        try:
            queue = os.readlink(parts[-1], dir_fd=fd).split("/")
        except OSError:
            return True  # replaced by a later member that is no link
        finally:
            os.close(fd)
        hops = 0
        while queue:
            comp = queue.pop(0)
            if comp in ("", "."):
                continue
            if comp == "..":
                if len(stack) <= top:
                    return False
                stack.pop()
                continue
            fd = self._dirs_fd(stack)
            st = None
            if fd >= 0:
                try:
                    st = os.stat(comp, dir_fd=fd, follow_symlinks=False)
                    if stat.S_ISLNK(st.st_mode):
                        target = os.readlink(comp, dir_fd=fd)
                        hops += 1
                        if hops > MAX_LINK_HOPS or target.startswith("/"):
                            return False
                        queue = [*target.split("/"), *queue]
                        continue
                except FileNotFoundError:
                    pass
                finally:
                    os.close(fd)
            stack.append(comp)
        return True

    def _dirs_fd(self, stack: list[str]) -> int:
        """An fd of the real directory ``stack`` names, no link followed; -1 if there is none."""
        try:
            return self._open_dir(stack, "/".join(stack), create=False, follow=False)
        except (UnsafeArchive, OSError):
            return -1


def _rmtree_at(parent_fd: int, base: str) -> None:
    """Remove the directory ``base`` under ``parent_fd``: fds all the way down, no link followed."""
    fd = os.open(base, DIR_FLAGS, dir_fd=parent_fd)
    try:
        os.fchmod(fd, 0o700)  # a 0555 dir from the stream must not keep its entries
        for entry in os.listdir(fd):
            st = os.stat(entry, dir_fd=fd, follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                _rmtree_at(fd, entry)
            else:
                os.unlink(entry, dir_fd=fd)
    finally:
        os.close(fd)
    os.rmdir(base, dir_fd=parent_fd)


def _link_stays_inside(name: str, linkname: str, prefix: str) -> bool:
    """A symlink made by copy_out must point inside the copied tree itself, lexically."""
    if not linkname or linkname.startswith("/"):
        return False
    depth = name.split("/")[:-1]
    for part in linkname.split("/"):
        if part in ("", "."):
            continue
        if part == "..":
            if not depth:
                return False
            depth.pop()
        else:
            depth.append(part)
    return not prefix or (bool(depth) and depth[0] == prefix)


def extract(stream: IO[bytes], dest: str | os.PathLike[str], policy: Policy, caps: Caps | None = None) -> None:
    """Unpack the tar ``stream`` under the existing directory ``dest`` by ``policy``'s rules."""
    caps = caps or Caps()
    reader = BoundedReader(stream, max_bytes=caps.max_bytes + HEADER_ALLOWANCE * caps.max_members,
                           timeout=caps.timeout, what=policy.what)
    extractor = Extractor(dest, policy, caps)
    try:
        # Long-name, pax and sparse headers: at most a few per member.
        # Big reads from a pipe or socket (a guest's stream: fewer polls); a record at a time
        # from a file, so a layer's reader stops where the archive ends: the rest is for the
        # digest check that follows (a gzip trailer read here would fail as a bad member).
        extractor.run(TarReader(reader, max_meta_headers=3 * caps.max_members, owners=extractor.owners_used,
                                read_size=CHUNK if reader.is_pipe else RECORD_SIZE))
    except TarFormatError as exc:
        raise UnsafeArchive(f"{policy.what}: not a readable tar stream: {exc}") from exc
    finally:
        extractor.close()


def _umask() -> int:
    """This process's umask, read without setting it (os.umask would race other threads)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o777  # unknown: always chmod
