"""The host's content-addressed blob cache (manifests, configs, layers) and the tag memo.

A blob is written to a temporary file while its sha256 is computed, and renamed into place
only when digest and size match: a blob in the store is always whole and verified. One file
lock per blob makes concurrent first pulls (``-n``, several runs) download it once.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from filelock import FileLock

from pytest_smolvm.errors import DigestMismatch
from pytest_smolvm.host.paths import cache_dir

CHUNK = 1 << 20


def root() -> Path:
    return cache_dir() / "oci"


def blob_path(digest: str) -> Path:
    algorithm, _, hexdigest = digest.partition(":")
    if algorithm != "sha256" or len(hexdigest) != 64 or not all(c in "0123456789abcdef" for c in hexdigest):
        raise ValueError(f"unsupported digest {digest!r}")
    return root() / "blobs" / algorithm / hexdigest


def has(digest: str) -> bool:
    return blob_path(digest).is_file()


def read_verified(digest: str, limit: int) -> bytes | None:
    """A small cached blob's bytes if they still hash to ``digest``; None if it is not cached.
    A damaged one (a bad block, a truncated write) is removed, so the next pull fetches it again."""
    path = blob_path(digest)
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except FileNotFoundError:
        return None
    if len(data) <= limit and f"sha256:{hashlib.sha256(data).hexdigest()}" == digest:
        return data
    discard(digest)
    return None


def discard(digest: str) -> None:
    """Remove a cached blob found damaged: the cache must not hand it out again."""
    blob_path(digest).unlink(missing_ok=True)


def _remove_orphans(path: Path) -> None:
    """Partial downloads of ``path`` left by processes killed mid-pull. Called under its lock, so
    no live process is writing one; each would stay for good (the next is named by its own pid)."""
    for orphan in path.parent.glob(f".tmp-{path.name}-*"):
        orphan.unlink(missing_ok=True)


def put_bytes(digest: str, data: bytes) -> Path:
    """Store ``data`` (already checked against ``digest`` by the caller or here)."""
    if f"sha256:{hashlib.sha256(data).hexdigest()}" != digest:
        raise DigestMismatch(digest)
    path = blob_path(digest)
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".tmp-{path.name}-{os.getpid()}")
        tmp.write_bytes(data)
        os.replace(tmp, path)
    return path


def blob_lock(digest: str) -> FileLock:
    """The lock that makes a blob's download once per host: held while it is fetched and stored."""
    path = blob_path(digest)
    path.parent.mkdir(parents=True, exist_ok=True)
    return FileLock(str(path.with_name(f"{path.name}.lock")))


def fetch(digest: str, size: int | None, open_stream: Callable[[], IO[bytes]],
          on_bytes: Callable[[int], None] = lambda n: None) -> tuple[Path, bool]:
    """The blob, downloaded at most once per host: (its path, whether this call downloaded it)."""
    path = blob_path(digest)
    if path.is_file():
        return path, False
    with blob_lock(digest):
        if path.is_file():
            return path, False  # another process pulled it while we waited
        _remove_orphans(path)
        tmp = path.with_name(f".tmp-{path.name}-{os.getpid()}")
        try:
            h = hashlib.sha256()
            written = 0
            with open_stream() as stream, open(tmp, "wb") as out:
                for chunk in iter(lambda: stream.read(CHUNK), b""):
                    h.update(chunk)
                    out.write(chunk)
                    written += len(chunk)
                    on_bytes(len(chunk))
                    if size is not None and written > size:
                        break  # a registry sending more than the manifest says is not to be trusted
            if size is not None and written < size:  # a dropped connection, not a corrupt blob
                raise ConnectionError(f"the connection ended after {written} of its {size} bytes")
            if f"sha256:{h.hexdigest()}" != digest or (size is not None and written != size):
                raise DigestMismatch(f"{digest}: got {written} bytes hashing to sha256:{h.hexdigest()[:12]}")
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
    return path, True


class HashingReader:
    """Reads through to ``raw`` while hashing; ``verify()`` once the reader has drained it."""

    def __init__(self, raw: IO[bytes], on_bytes: Callable[[int], None] = lambda n: None) -> None:
        self._raw = raw
        self._hash = hashlib.sha256()
        self._on_bytes = on_bytes
        self.count = 0

    def read(self, n: int = -1) -> bytes:
        data = self._raw.read(n)
        self._hash.update(data)
        self.count += len(data)
        self._on_bytes(len(data))
        return data

    def readable(self) -> bool:
        return True

    def verify(self, digest: str) -> None:
        for chunk in iter(lambda: self.read(CHUNK), b""):  # what the tar reader left unread
            del chunk
        if f"sha256:{self._hash.hexdigest()}" != digest:
            raise DigestMismatch(digest)


# --------------------------------------------------------------------------- tag memo


def _tags_path() -> Path:
    return root() / "tags.json"


def tags() -> dict[str, Any]:
    try:
        data = json.loads(_tags_path().read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def tag_digest(canonical: str, *, run_id: str | None = None) -> str | None:
    """The digest ``canonical`` last resolved to here (only if ``run_id`` resolved it, when given)."""
    memo = tags().get(canonical)
    if not isinstance(memo, dict) or not isinstance(memo.get("digest"), str):
        return None
    if run_id is not None and memo.get("run") != run_id:
        return None
    return str(memo["digest"])


def tag_lock(canonical: str) -> FileLock:
    locks = root() / "tag-locks"
    locks.mkdir(parents=True, exist_ok=True)
    return FileLock(str(locks / f"{hashlib.sha256(canonical.encode()).hexdigest()[:32]}.lock"))


def remember_tag(canonical: str, digest: str, run_id: str | None) -> None:
    """``canonical`` (registry/repo:tag) named ``digest`` when this run resolved it."""
    path = _tags_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path.with_name("tags.lock"))):
        memo = tags()
        memo[canonical] = {"digest": digest, "run": run_id, "at": time.time()}
        tmp = path.with_name(f".tags.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(memo, indent=1, sort_keys=True))
        os.replace(tmp, path)
