"""Walking a tree the guest wrote, by directory fd: no path resolved, no link followed.

The base of :class:`~pytest_smolvm.untrusted.hostfs.Extractor`: member names checked and turned
into components, directories opened one component at a time with ``O_NOFOLLOW`` from the
destination's own fd (links are judged by :mod:`~pytest_smolvm.untrusted.linkmap`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass, field

from pytest_smolvm.errors import UnsafeArchive
from pytest_smolvm.untrusted.rules import DIR_CACHE, DIR_FLAGS, MAX_LINK_HOPS, MAX_NAME, Policy


class TreeWalker:
    """Directory fds under one destination, walked without trusting any name in them."""

    def __init__(self, dest: str | os.PathLike[str], policy: Policy) -> None:
        self.policy = policy
        self.root_fd = os.open(dest, DIR_FLAGS)
        self._dirs: dict[tuple[str, ...], int] = {}  # parent dirs walked, by their parts
        self._resolved: dict[tuple[str, ...], list[str]] = {}  # what each resolved to (a layer's dir links)
        self._stale: list[int] = []
        self._last_head: str | None = None  # the last checked name's dir part, and its parts
        self._last_parts: list[str] = []

    def close(self) -> None:
        for fd in [*self._dirs.values(), *self._stale]:
            os.close(fd)
        os.close(self.root_fd)

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
        return self._walk(parts, name, create=create, follow=follow)[0]

    def _walk(self, parts: list[str], name: str, *, create: bool, follow: bool | None = None,
              start: tuple[int, list[str]] | None = None) -> tuple[int, list[str]]:
        """:meth:`_open_dir` from ``start`` (a walked dir's fd and its resolved components, which
        ``parts`` continue) or the root; also returns the components the fd resolved to."""
        follow = self.policy.layer if follow is None else follow
        fd = os.dup(start[0] if start is not None else self.root_fd)
        stack: list[str] = list(start[1]) if start is not None else []
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
            return fd, stack
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

    def _parent(self, parts: list[str], name: str) -> int:
        """The fd of a member's parent dir, walked once and kept while nothing is removed.

        Tar streams list a directory's entries together, so most members reuse the last walk.
        An fd names the directory itself: only a removal (which empties this cache) can make
        a walked path mean another directory, and nothing else changes what a path resolves to.
        """
        return self._dir(tuple(parts[:-1]), name, create=True)

    def _dir(self, key: tuple[str, ...], name: str, *, create: bool) -> int:
        """The cached fd of the directory ``key``, walked one step from its own parent's when
        that is cached (a stream lists a directory before its entries, so a chain of N nested
        directories costs N opens, not N²/2), else from the root."""
        fd = self._dirs.get(key)
        if fd is not None:
            return fd
        if len(self._dirs) >= DIR_CACHE:
            self._forget()
        above = self._dirs.get(key[:-1]) if key else None
        if above is not None:
            fd, resolved = self._walk(list(key[-1:]), name, create=create, start=(above, self._resolved[key[:-1]]))
        else:
            fd, resolved = self._walk(list(key), name, create=create)
        self._dirs[key], self._resolved[key] = fd, resolved
        return fd

    def _forget(self) -> None:
        self._stale.extend(self._dirs.values())
        self._dirs.clear()
        self._resolved.clear()


# Removal is a loop over a stack of directories, not a recursion: a stream's names can nest 2,000
# directories deep (4,096 characters of "a/a/..."), and one frame per level raised RecursionError,
# which is no OSError: the extractor let it out raw and ``ignore_errors=True`` did not stop it.
# At most OPEN_FDS of the stack's fds are held (the confined helper may open 256 in all); a level
# closed to keep that bound is opened again by name from its nearest open parent, O_NOFOLLOW.
OPEN_FDS = 32
# The directory a caller names (an --smol-artifacts dir may well be a link to a bigger disk):
# its path is the caller's, so it is resolved as one; nothing under it is.
CALLERS_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


@dataclass
class _Level:
    name: str  # under the level above (or the caller's dir fd)
    fd: int  # -1 while closed to keep the bound
    subdirs: list[str] = field(default_factory=list)  # still to remove


def _rmtree_at(parent_fd: int, base: str) -> None:
    """Remove ``base`` under ``parent_fd`` at any depth: fds all the way down, no link followed
    (a link is removed as the entry it is); a missing ``base`` is fine."""
    try:
        st = os.stat(base, dir_fd=parent_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(base, dir_fd=parent_fd)
        return

    def unlink(dir_fd: int, entry: os.DirEntry[str]) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(entry.name, dir_fd=dir_fd)

    _walk_down(parent_fd, base, unlink, lambda above_fd, name: os.rmdir(name, dir_fd=above_fd), writable=True)


def _walk_down(parent_fd: int, base: str, on_entry: Callable[[int, os.DirEntry[str]], None],
               on_dir_done: Callable[[int, str], None], *, writable: bool) -> None:
    """Every entry under the directory ``base`` at any depth, depth first, by fd: ``on_entry``
    for each non-directory (with its dir's fd), ``on_dir_done`` for each directory once its
    subdirs are done (with the fd of the dir above it). At most OPEN_FDS fds held at any depth."""
    levels = [_enter(parent_fd, base, on_entry, writable)]
    try:
        while levels:
            top = levels[-1]
            if top.subdirs:
                levels.append(_enter(_level_fd(levels, len(levels) - 1, parent_fd), top.subdirs.pop(), on_entry,
                                     writable))
                _bound(levels)
                continue
            levels.pop()
            if top.fd >= 0:
                os.close(top.fd)
                top.fd = -1
            on_dir_done(_level_fd(levels, len(levels) - 1, parent_fd) if levels else parent_fd, top.name)
    finally:
        for level in levels:
            if level.fd >= 0:
                os.close(level.fd)


def rmtree(path: str | os.PathLike[str]) -> None:
    """Remove the tree at ``path`` (a guest's copy, a staging dir) at any depth; missing is fine.
    Only ``path``'s parent is resolved as a path: it is the caller's, not the guest's."""
    parent, base = os.path.split(os.path.abspath(path))
    try:
        fd = os.open(parent, CALLERS_DIR)
    except FileNotFoundError:
        return
    try:
        _rmtree_at(fd, base)
    finally:
        os.close(fd)


def tree_bytes(path: str | os.PathLike[str]) -> int:
    """The size of everything under ``path`` (a copy the extractor made) as ``lstat`` gives it,
    at any depth, by fd (no link followed, no recursion); a missing ``path`` is 0."""
    try:
        st = os.lstat(path)  # ``path`` itself is the caller's
    except FileNotFoundError:
        return 0
    if not stat.S_ISDIR(st.st_mode):
        return st.st_size
    total = 0

    def count(dir_fd: int, entry: os.DirEntry[str]) -> None:
        nonlocal total
        total += entry.stat(follow_symlinks=False).st_size

    def count_dir(above_fd: int, name: str) -> None:
        nonlocal total
        total += os.stat(name, dir_fd=above_fd, follow_symlinks=False).st_size

    parent, base = os.path.split(os.path.abspath(path))
    fd = os.open(parent, CALLERS_DIR)
    try:
        _walk_down(fd, base, count, count_dir, writable=False)
    finally:
        os.close(fd)
    return total


def _enter(parent_fd: int, name: str, on_entry: Callable[[int, os.DirEntry[str]], None], writable: bool) -> _Level:
    """Open ``name``, hand every non-directory in it to ``on_entry``, list its subdirs; with
    ``writable``, make it writable (and openable) first."""
    try:
        fd = os.open(name, DIR_FLAGS, dir_fd=parent_fd)
    except PermissionError:  # a 0000 dir, as a user: ours to open up, through an O_PATH fd of it
        if not writable:
            raise
        path_fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=parent_fd)
        try:
            os.chmod(f"/proc/self/fd/{path_fd}", 0o700)
        finally:
            os.close(path_fd)
        fd = os.open(name, DIR_FLAGS, dir_fd=parent_fd)
    level = _Level(name, fd)
    try:
        if writable:
            os.fchmod(fd, 0o700)  # a 0555 dir from the stream must not keep its entries
        with os.scandir(fd) as entries:
            for entry in entries:
                if entry.is_dir(follow_symlinks=False):
                    level.subdirs.append(entry.name)
                else:
                    on_entry(fd, entry)
    except BaseException:
        os.close(fd)
        raise
    return level


def _level_fd(levels: list[_Level], index: int, parent_fd: int) -> int:
    """The open fd of ``levels[index]``. If it was closed, the chain down to it is opened again
    from its nearest open parent, and its last OPEN_FDS levels stay open for the way back up
    (a 2,000-deep tree costs ~depth²/OPEN_FDS opens, not one walk per level)."""
    if levels[index].fd >= 0:
        return levels[index].fd
    start = index
    while start >= 0 and levels[start].fd < 0:
        start -= 1
    fd = levels[start].fd if start >= 0 else parent_fd
    for i in range(start + 1, index + 1):
        next_fd = os.open(levels[i].name, DIR_FLAGS, dir_fd=fd)
        if i - 1 > start:
            if i - 1 <= index - OPEN_FDS:
                os.close(fd)  # a level the way up will not reach before the next walk
            else:
                levels[i - 1].fd = fd
        fd = next_fd
    levels[index].fd = fd
    return fd


def _bound(levels: list[_Level]) -> None:
    """Close the outermost fds past OPEN_FDS (they are opened again on the way back up)."""
    open_levels = [level for level in levels if level.fd >= 0]
    for level in open_levels[:max(0, len(open_levels) - OPEN_FDS)]:
        os.close(level.fd)
        level.fd = -1
