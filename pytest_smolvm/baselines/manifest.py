"""What an unpacked baseline held when it was made: a manifest, checked cheaply, verified fully.

A cached tree damaged after its unpack (a truncated ``/bin/busybox``, flipped bytes, a deleted
file: a full disk, a bad block, a stray ``rm``) was used as is: every guest of every later run
failed with ``Exec format error`` and no word about the cache. So each tree is recorded at
unpack time, before it is renamed into place: every regular file's size, digest and stat
stamps (mtime, ctime, inode) and every symlink's target, in ``manifest.json`` beside
``image.json``.

:func:`check` is the cheap test a process makes the first time it uses a tree: one ``lstat``
per entry. A size, type or link that differs, or a missing entry, is damage. A file whose
stamps differ (a write, even one that put its mtime back, changes the ctime; so does a restored
copy of the cache) is hashed again; its digest decides. :func:`verify` hashes every file
(``pytest-smolvm doctor``). Damage that leaves every stamp alone (a bad block under an untouched
file) is only found by :func:`verify`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"
VERSION = 1
HASH_CHUNK = 1 << 20


def _entries(rootfs: Path) -> Iterator[tuple[str, os.stat_result]]:
    """Every regular file and symlink under ``rootfs``: its path relative to it, and its lstat.
    A stack, not recursion: a warm baseline is a guest's tree, up to 1,024 levels deep."""
    pending = [""]
    while pending:
        rel = pending.pop()
        with os.scandir(rootfs / rel if rel else rootfs) as listing:
            for entry in sorted(listing, key=lambda e: e.name):
                path = f"{rel}/{entry.name}" if rel else entry.name
                st = entry.stat(follow_symlinks=False)
                if stat.S_ISDIR(st.st_mode):
                    pending.append(path)
                elif stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode):
                    yield path, st


def _digest(path: Path) -> str:
    """sha256 of the file at ``path``, opened without following a link."""
    digest = hashlib.sha256()
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _stamps(st: os.stat_result) -> list[int]:
    return [st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def _record(rootfs: Path, rel: str, st: os.stat_result) -> dict[str, Any]:
    if stat.S_ISLNK(st.st_mode):
        return {"p": rel, "l": os.readlink(rootfs / rel)}
    try:
        digest: str | None = _digest(rootfs / rel)
    except PermissionError:  # a 0000 file unpacked by a user: its size and stamps still say much
        digest = None
    return {"p": rel, "s": st.st_size, "h": digest, "t": _stamps(st)}


def write(tree: Path) -> None:
    """Record ``tree/rootfs`` in ``tree/manifest.json`` (a staging tree, before its rename)."""
    rootfs = tree / "rootfs"
    entries = [_record(rootfs, rel, st) for rel, st in _entries(rootfs)]
    _save(tree, entries)


def _save(tree: Path, entries: list[dict[str, Any]]) -> None:
    temp = tree / f".{MANIFEST}.{os.getpid()}"
    temp.write_text(json.dumps({"version": VERSION, "entries": entries}, separators=(",", ":")))
    os.replace(temp, tree / MANIFEST)


def load(tree: Path) -> list[dict[str, Any]] | None:
    """The manifest's entries; None where there is none (a tree from before manifests) or it
    does not read (damage too: the caller treats that as a damaged tree)."""
    try:
        data = json.loads((tree / MANIFEST).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return []
    if not isinstance(data, dict) or data.get("version") != VERSION or not isinstance(data.get("entries"), list):
        return []
    return list(data["entries"])


def _damage(rootfs: Path, entry: dict[str, Any], *, full: bool) -> tuple[str | None, bool]:
    """(what is wrong with ``entry``'s file, or None; whether it was hashed to know it)."""
    rel = str(entry.get("p"))
    try:
        st = os.lstat(rootfs / rel)
    except FileNotFoundError:
        return f"/{rel} is missing", False
    except OSError as exc:
        return f"/{rel}: {exc.strerror or exc}", False
    if "l" in entry:
        if not stat.S_ISLNK(st.st_mode):
            return f"/{rel} is no longer a symlink", False
        with contextlib.suppress(OSError):
            if os.readlink(rootfs / rel) == entry["l"]:
                return None, False
        return f"/{rel} points elsewhere", False
    if not stat.S_ISREG(st.st_mode):
        return f"/{rel} is no longer a regular file", False
    if st.st_size != entry.get("s"):
        return f"/{rel} is {st.st_size} bytes, not {entry.get('s')}", False
    if (not full and _stamps(st) == entry.get("t")) or entry.get("h") is None:
        return None, False
    try:
        same = _digest(rootfs / rel) == entry.get("h")
    except OSError as exc:
        return f"/{rel}: {exc.strerror or exc}", True
    if not same:
        return f"/{rel} does not have the bytes it was unpacked with", True
    entry["t"] = _stamps(st)  # the same bytes with new stamps (a restored cache): cheap next time
    return None, True


def check(tree: Path) -> str | None:
    """The first damage found in ``tree`` by the cheap test (see the module docstring), or None.
    A tree without a manifest is recorded as it is now (trusted on first use)."""
    entries = load(tree)
    if entries is None:
        with contextlib.suppress(OSError):
            write(tree)
        return None
    if not entries:
        return f"its {MANIFEST} does not read"
    rootfs = tree / "rootfs"
    rehashed = False
    for entry in entries:
        damage, hashed = _damage(rootfs, entry, full=False)
        if damage is not None:
            return damage
        rehashed |= hashed
    if rehashed:
        with contextlib.suppress(OSError):
            _save(tree, entries)
    return None


def verify(tree: Path) -> list[str]:
    """Every damage in ``tree``, every file hashed (``pytest-smolvm doctor``)."""
    entries = load(tree)
    if entries is None:
        return [f"no {MANIFEST} (unpacked by an older pytest-smolvm): nothing to verify against"]
    if not entries:
        return [f"its {MANIFEST} does not read"]
    rootfs = tree / "rootfs"
    return [damage for entry in entries if (damage := _damage(rootfs, entry, full=True)[0]) is not None]
