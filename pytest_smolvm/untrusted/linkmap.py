"""A map of the tree a copy writes, to judge its symlinks in time linear in the stream.

A copy's links are judged by resolving them as the kernel would through the finished tree,
never by their spelling (``d/up -> ..`` makes ``d/up/d/up/../..`` climb two levels for one it
names). Looking each component up on disk, walked from the tree's root, made that quadratic in
the tree's depth: 2,000 nested directories and 60 links down them kept the unpacker busy for
~9 minutes. So the extractor records each directory and link here as it writes it (a file, or
anything else, only removes what was at its name: for resolving, a file and a missing name are
alike), and each link is resolved once, against this map, its result kept for every link that
goes through it. The resolution is bounded twice, each bound ending in one ``UnsafeArchive``
(a ``GuestError``) that names it: ``max_steps`` components looked at for all links together
(``LIMITS.copy_out_link_steps``), and ``MAX_LINK_HOPS`` links followed for one link, as the
kernel's own limit (a loop is refused by it too).

A component that does not exist (or is no directory) is taken lexically, as the old walk did:
a later ``..`` can only climb as far as the kernel would let it, never farther.
"""

from __future__ import annotations

from pytest_smolvm.errors import UnsafeArchive
from pytest_smolvm.untrusted.rules import MAX_LINK_HOPS


class _Node:
    """A directory (``children``) or a symlink (``target``) of the written tree."""

    __slots__ = ("children", "memo", "name", "parent", "target")

    def __init__(self, parent: _Node | None, name: str, target: str | None = None) -> None:
        self.parent, self.name, self.target = parent, name, target
        self.children: dict[str, _Node] | None = {} if target is None else None
        # A link's resolution: (the node it ends at, names past it taken lexically, links
        # followed); _BUSY while it is being resolved (met again: a loop).
        self.memo: tuple[_Node, int, int] | None = None


_BUSY = (_Node(None, ""), 0, 0)


class _Refused(Exception):
    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


class LinkMap:
    """The directories and symlinks of one copy, as written; :meth:`judge` the links."""

    def __init__(self, prefix: str, max_steps: int, what: str) -> None:
        self.root = _Node(None, "")
        self.prefix, self.max_steps, self.what = prefix, max_steps, what
        self.steps = 0
        self._last: tuple[tuple[str, ...], _Node] | None = None  # the last member's parent

    def _parent(self, parts: list[str]) -> _Node:
        """The directory node above ``parts``, made where missing (the extractor made it on
        disk; a link or file there would have been refused before this). A stream lists a
        directory before its entries, so this is mostly the last member's parent or one step
        below it: a chain of N nested directories costs N steps, not N²/2."""
        key = tuple(parts[:-1])
        node, rest = self.root, key
        if self._last is not None:
            last_key, last_node = self._last
            if last_key == key:
                return last_node
            if key[:-1] == last_key:
                node, rest = last_node, key[-1:]
        for comp in rest:
            assert node.children is not None
            child = node.children.get(comp)
            if child is None or child.children is None:
                child = node.children[comp] = _Node(node, comp)
            node = child
        self._last = (key, node)
        return node

    def directory(self, parts: list[str]) -> None:
        parent = self._parent(parts)
        assert parent.children is not None
        existing = parent.children.get(parts[-1])
        if existing is None or existing.children is None:
            parent.children[parts[-1]] = _Node(parent, parts[-1])
        self._forget_last(parts)

    def symlink(self, parts: list[str], target: str) -> None:
        parent = self._parent(parts)
        assert parent.children is not None
        parent.children[parts[-1]] = _Node(parent, parts[-1], target)
        self._forget_last(parts)

    def other(self, parts: list[str]) -> None:
        """A file (or hard link) at ``parts``: whatever was there is gone."""
        parent = self._parent(parts)
        assert parent.children is not None
        parent.children.pop(parts[-1], None)
        self._forget_last(parts)

    def _forget_last(self, parts: list[str]) -> None:
        # The cached parent stays valid unless this member replaced it or one above it.
        if self._last is not None and tuple(parts) == self._last[0][:len(parts)]:
            self._last = None

    def judge(self) -> None:
        """Every link still in the tree resolved (each once); the first that ends above the
        copied tree, or breaks a bound, refuses the copy."""
        top = self.root.children.get(self.prefix) if self.prefix and self.root.children else self.root
        if top is not None and top.target is not None:
            # The copy is this link: its target is taken from the copy's parent (beside dest
            # once it is moved there), never from inside the copy. Refused when it is written
            # too (hostfs); here so that the judge never passes a tree it did not resolve.
            raise UnsafeArchive(f"{self.what}: refused {self._name(top)!r}: its link {top.target!r} leaves the "
                                "copied tree (the copy is the link itself)")
        if top is None or top.children is None:
            return  # no tree: a single file, or nothing
        stack = [top]
        while stack:  # every node once, no recursion: a tree can nest 2,000 deep
            node = stack.pop()
            for child in (node.children or {}).values():
                if child.target is None:
                    stack.append(child)
                    continue
                try:
                    self._resolve(child, top, 0)
                except _Refused as exc:
                    raise UnsafeArchive(f"{self.what}: refused {self._name(child)!r}: {exc.why}") from None

    def _name(self, node: _Node) -> str:
        names = []
        walk: _Node | None = node
        while walk is not None and walk.parent is not None:
            names.append(walk.name)
            walk = walk.parent
        return "/".join(reversed(names))

    def _resolve(self, link: _Node, top: _Node, depth: int) -> tuple[_Node, int, int]:
        """Where ``link`` ends: (node, names past it, links followed). Recursion only into the
        links it meets, each at most once in all (their results are kept), and never deeper
        than MAX_LINK_HOPS: the kernel follows no more."""
        if link.memo is _BUSY or depth > MAX_LINK_HOPS:
            raise _Refused(f"its link goes through more than {MAX_LINK_HOPS} links (a loop, or past the limit "
                           "the kernel follows)")
        if link.memo is not None:
            return link.memo
        assert link.target is not None and link.parent is not None
        if link.target.startswith("/"):
            raise _Refused(f"its link {link.target!r} leaves the copied tree")
        link.memo = _BUSY
        node, extra, hops = link.parent, 0, 1
        for comp in link.target.split("/"):
            self.steps += 1
            if self.steps > self.max_steps:
                raise UnsafeArchive(f"{self.what}: judging its links took more than {self.max_steps} steps "
                                    "(the limit, LIMITS.copy_out_link_steps); refused")
            if comp in ("", "."):
                continue
            if comp == "..":
                if extra:
                    extra -= 1
                elif node is top or node.parent is None:
                    raise _Refused("its link resolves outside the copied tree (through other links)")
                else:
                    node = node.parent
                continue
            child = None if extra or node.children is None else node.children.get(comp)
            if child is None:
                extra += 1  # missing, or under a file: lexically, as far as the kernel could get
            elif child.target is not None:
                node, extra, followed = self._resolve(child, top, depth + 1)
                hops += followed
                if hops - 1 > MAX_LINK_HOPS:
                    raise _Refused(f"its link goes through more than {MAX_LINK_HOPS} links (a loop, or past "
                                   "the limit the kernel follows)")
            else:
                node = child
        link.memo = (node, extra, hops)
        return link.memo
