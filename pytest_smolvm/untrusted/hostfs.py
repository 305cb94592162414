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

import os
import stat
from typing import IO

from pytest_smolvm.errors import TarFormatError, UnsafeArchive
from pytest_smolvm.untrusted.linkmap import LinkMap
from pytest_smolvm.untrusted.rules import (
    CHUNK,
    FILE_FLAGS,
    HEADER_ALLOWANCE,
    HOLE_MIN,
    ZEROS,
    BoundedReader,
    Caps,
    Policy,
)
from pytest_smolvm.untrusted.tarstream import (
    BLOCKDEV,
    CHARDEV,
    DIRECTORY,
    FIFO,
    RECORD_SIZE,
    REGULAR,
    SYMLINK,
    Member,
    TarReader,
)
from pytest_smolvm.untrusted.walk import TreeWalker, _rmtree_at


class Extractor(TreeWalker):
    """One stream unpacked under ``dest`` (an existing directory); see the module docstring."""

    def __init__(self, dest: str | os.PathLike[str], policy: Policy, caps: Caps) -> None:
        super().__init__(dest, policy)
        self.caps = caps
        self.written = 0
        self.members = 0
        self.regular: set[str] = set()  # regular files this stream made, for hard links
        self.this_layer: set[str] = set()
        self.directories: list[tuple[str, int, float]] = []
        self.as_root = hasattr(os, "geteuid") and os.geteuid() == 0
        self.owners_used = policy.layer and self.as_root and not policy.squash_owner
        self.umask = _umask()
        # copy_out's directories and links as written: its links are judged on the final tree.
        self.links = None if policy.layer else LinkMap(policy.prefix, caps.max_link_steps, policy.what)

    def run(self, tar: TarReader) -> None:
        for member in tar:
            self.members += 1
            if self.members > self.caps.max_members:
                raise UnsafeArchive(f"{self.policy.what}: more than {self.caps.max_members} members (the cap)")
            try:
                self.member(tar, member)
            except (OSError, OverflowError, ValueError) as exc:  # e.g. ENOSPC, an absurd mtime or uid
                raise UnsafeArchive(f"{self.policy.what}: cannot unpack {member.name[:200]!r}: {exc}") from exc
        try:
            self.finish()
        except (OSError, OverflowError, ValueError) as exc:  # a directory's absurd mtime, say
            raise UnsafeArchive(f"{self.policy.what}: cannot finish unpacking: {exc}") from exc

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
            elif self.links is not None:
                if kind == DIRECTORY:
                    self.links.directory(parts)
                elif kind == SYMLINK:
                    self.links.symlink(parts, member.linkname)
                else:
                    self.links.other(parts)
        finally:
            while self._stale:  # forgotten while this member still used its parent's fd
                os.close(self._stale.pop())

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
        if not self.policy.layer and not _link_stays_inside(name, member.linkname, self.policy.prefix):
            why = f"its link {member.linkname!r} leaves the copied tree"
            if self.policy.prefix and name == self.policy.prefix:
                why += " (the copy is the link itself: any target resolves beside the destination, outside the copy)"
            raise self._refuse(member.name, why)
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
                zeros = 0  # a run of zeros not written yet, counted across reads of any size
                holes = False
                for view in (whole,) if whole is not None else tar.data():
                    if ZEROS.startswith(view):
                        zeros += len(view)
                        continue
                    holes |= _zeros_out(fd, zeros)
                    zeros = 0
                    while view:
                        view = view[os.write(fd, view):]
                if _zeros_out(fd, zeros) or holes:
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
        if self.links is not None:
            self.links.judge()
        # In stream order, each directory is one step from its parent's cached fd. Deepest first
        # only where a mode would take away our own search right before its subdirs are done.
        searchable = all(mode & 0o100 for _, mode, _ in self.directories)
        for name, mode, mtime in self.directories if searchable else reversed(self.directories):
            parts = name.split("/")
            above = tuple(parts[:-1])
            try:
                parent = self._dir(above, name, create=False)
                fd = self._walk(parts[-1:], name, create=False, start=(parent, self._resolved[above]))[0]
            except (UnsafeArchive, FileNotFoundError):
                continue  # replaced by a later member
            try:
                os.fchmod(fd, mode)
                os.utime(fd, (mtime, mtime))
            finally:
                os.close(fd)
                while self._stale:  # forgotten by the cache while its fd was in use above
                    os.close(self._stale.pop())


def _link_stays_inside(name: str, linkname: str, prefix: str) -> bool:
    """A symlink made by copy_out must resolve inside the copied tree itself, judged lexically
    here (at write time) and by resolution once the tree is complete (``LinkMap.judge``).

    ``name`` is the member's path in the stream: under ``prefix`` (the staging name the copy is
    written under) when there is one. The target is taken from the link's own directory *within
    the copied tree*, whose top is ``prefix``: a ``..`` past that top leaves the copy, whatever
    follows it (the staging name is never compared with the target: after the move to ``dest``
    the copy has another name, and ``payload/...`` would name a sibling of ``dest``). A link that
    is the copy's top itself has no directory inside the copy: every target resolves against
    ``dest``'s parent, so it is refused.
    """
    if not linkname or linkname.startswith("/"):
        return False
    parts = name.split("/")
    if prefix:
        if parts[0] != prefix:
            return False  # not under the copy (the member walk refuses these before)
        parts = parts[1:]
    if not parts:
        return False  # the top of the copy is this link
    depth = parts[:-1]  # the link's directory, from the copy's top
    for part in linkname.split("/"):
        if part in ("", "."):
            continue
        if part == "..":
            if not depth:
                return False
            depth.pop()
        else:
            depth.append(part)
    return True



def _zeros_out(fd: int, count: int) -> bool:
    """``count`` zeros at ``fd``'s offset: a hole when the run is long (a guest's zeros cost the
    host no blocks), written otherwise. Whether it left a hole."""
    if count >= HOLE_MIN:
        os.lseek(fd, count, os.SEEK_CUR)
        return True
    while count:
        count -= os.write(fd, ZEROS[:count])
    return False


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

