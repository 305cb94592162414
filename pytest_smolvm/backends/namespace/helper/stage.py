"""``copy_in``'s stage: a tree for a directory that does not exist yet, made aside in the
guest's upper layer and moved in whole (requests.py ``_op_put_archive``).

Part of the namespace backend's helper (see ``__init__``): standard library only. It runs in a
put_archive request's child, inside the guest's confinement and as the request's user, like the
unpacker it feeds.
"""

from __future__ import annotations

import errno
import os
import stat
from typing import TypeGuard

from pytest_smolvm.backends.namespace.helper.writers import set_attrs

UPPER_FD = 4  # in a put_archive's child: the guest's upper layer, handed down by the init (init.py)
STAGE_PREFIX = ".smolvm-copy-"  # a staged tree's name at the top of the upper layer, until moved in
# A directory moved onto a directory there that is not empty, or onto a link to one.
MERGE_ERRORS = (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR)


def is_stage_name(name: object) -> TypeGuard[str]:
    """Whether ``name`` is one a stage may have: ours, at the top of the upper layer, nothing deeper."""
    return isinstance(name, str) and name.startswith(STAGE_PREFIX) and "/" not in name


def open_stage(dest: str, name: object) -> tuple[str, int] | None:
    """Where a tree copied to a ``dest`` that does not exist yet is unpacked first: a directory
    ``name`` made straight in the guest's upper layer, not through the overlay, and moved to
    ``dest`` through the overlay once whole. Returns its name and fd, or None where the tree
    is unpacked in place.

    Why: every file made through the overlay costs its kernel work twice over (the overlay's
    own lookup, credentials and create, then the upper filesystem's); made in the upper it
    costs the upper's alone: 10,000 small files, ~300 ms of system time on an ext4 disk against
    ~200 ms (docs/performance.md). The overlay's documentation leaves changes to a mounted
    upper undefined because of what the overlay has cached of it; of a name it has never looked
    up (a random one, made here) and a tree below it, it has cached nothing, so what it finds
    at the move is what an overlay mounted afresh would find. A guest that lists ``/`` and looks
    into the stage while it fills can confuse only its own view. And a copy into a new ``dest``
    that fails leaves nothing at ``dest``.

    In place instead when ``dest`` exists (the tree is merged into it), when its parent is not
    on the overlay (a tmpfs mount: the move would cross filesystems) or gives what is made in
    it a group or default ACL of its own (setgid, ``system.posix_acl_default``), or when the
    request's user may not write the upper's top (a user other than root).
    """
    if not is_stage_name(name):
        return None
    try:
        os.fstat(UPPER_FD)
    except OSError:
        return None  # the init had no upper to hand down
    try:
        os.lstat(dest)
        return None
    except FileNotFoundError:
        pass
    parent = os.path.dirname(dest.rstrip("/")) or "/"
    os.makedirs(parent, exist_ok=True)
    st = os.stat(parent)
    if st.st_dev != os.stat("/").st_dev or st.st_mode & stat.S_ISGID \
            or "system.posix_acl_default" in os.listxattr(parent):
        return None
    try:
        os.mkdir(name, 0o700, dir_fd=UPPER_FD)
    except PermissionError:
        return None
    fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=UPPER_FD)
    umask = os.umask(0)
    os.umask(umask)
    os.fchmod(fd, 0o777 & ~umask)  # as makedirs would have made dest; a "." member sets its own
    return name, fd


def merge(staged: str, dest: str, dest_attrs: tuple[int, int] | None) -> None:
    """Move a staged tree into ``dest``, a directory something made while the tree was staged
    (another copy_in to it, a guest process), by the unpacker's rules: a file or link replaces
    what is there, a directory is merged into one there (or into a link to one) and gives it
    its mode and mtime. By path, not by fd: only such a race takes this way, and a path too
    long for it is an error that names it."""
    pending, merged = [""], []
    while pending:
        rel = pending.pop()
        for entry in os.listdir(os.path.join(staged, rel)):
            inner = os.path.join(rel, entry)
            source, target = os.path.join(staged, inner), os.path.join(dest, inner)
            try:
                os.rename(source, target)
            except OSError as exc:
                st = os.lstat(source)
                if exc.errno not in MERGE_ERRORS or not stat.S_ISDIR(st.st_mode) or not os.path.isdir(target):
                    raise OSError(exc.errno, exc.strerror, target) from None
                pending.append(inner)
                merged.append((target, stat.S_IMODE(st.st_mode), st.st_mtime_ns))  # before its entries move
    for target, mode, mtime_ns in reversed(merged):  # deepest first: a mtime after the entries moved in
        set_attrs(target, mode, mtime_ns)
    if dest_attrs is not None:
        set_attrs(dest, *dest_attrs)
