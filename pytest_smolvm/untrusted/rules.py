"""The limits and rules for every stream the host unpacks from a guest or an image.

:class:`Caps` bound a stream (bytes, members, time), :class:`BoundedReader` enforces them while
reading, :class:`Policy` says what one consumer accepts; :class:`UnsafeArchive` is the refusal.
"""

from __future__ import annotations

import os
import select
import stat
import time
from dataclasses import dataclass, field
from typing import IO

from pytest_smolvm import limits
from pytest_smolvm.errors import UnsafeArchive

HEADER_ALLOWANCE = 1536  # stream bytes per member beyond its data: header, long-name and PAX blocks
MAX_NAME = 4096
MAX_LINK_HOPS = 40
CHUNK = 1 << 20
HOLE_MIN = 1 << 16  # zero runs at least this long (counted across reads) are left as holes
ZEROS = bytes(CHUNK)
DIR_CACHE = 64  # parent dir fds kept open at once
FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass(frozen=True)
class Caps:
    # Read when a Caps is made, so a suite's own LIMITS (limits.py) applies.
    max_bytes: int = field(default_factory=lambda: limits.LIMITS.copy_out_bytes)
    max_members: int = field(default_factory=lambda: limits.LIMITS.copy_out_members)
    timeout: float = field(default_factory=lambda: limits.LIMITS.copy_out_timeout)
    max_link_steps: int = field(default_factory=lambda: limits.LIMITS.copy_out_link_steps)


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
