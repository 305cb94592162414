"""Walking a tree the guest wrote, by directory fd: no path resolved, no link followed.

The base of :class:`~pytest_smolvm.untrusted.hostfs.Extractor`: member names checked and turned
into components, directories opened one component at a time with ``O_NOFOLLOW`` from the
destination's own fd, and links judged by resolving them in the finished tree, never by spelling.
"""

from __future__ import annotations

import errno
import os
import stat

from pytest_smolvm.errors import UnsafeArchive
from pytest_smolvm.untrusted.rules import DIR_CACHE, DIR_FLAGS, MAX_LINK_HOPS, MAX_NAME, Policy


class TreeWalker:
    """Directory fds under one destination, walked without trusting any name in them."""

    def __init__(self, dest: str | os.PathLike[str], policy: Policy) -> None:
        self.policy = policy
        self.root_fd = os.open(dest, DIR_FLAGS)
        self._dirs: dict[tuple[str, ...], int] = {}  # parent dirs walked, by their parts
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

