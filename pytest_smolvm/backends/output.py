"""Bounded capture of a guest's output, shared by every backend.

The guest is an attacker: whatever it prints, the host keeps at most ``limit`` bytes of it,
the head and the tail of the stream. What falls between is counted (``dropped``), never
replaced by text of ours: the bytes kept are bytes the guest wrote, and the result's
``truncated`` field says a stream was cut (docs/reference.md).
"""

from __future__ import annotations

from collections import deque


class BoundedBuffer:
    """Keeps the head and the tail of a stream; what falls between is counted, not kept.

    The tail is a queue of the chunks as they came, trimmed from the front: a chunk costs
    its own length whatever the limit (cutting a bytearray's front and growing its end
    again moved up to the whole tail, 8 MiB at the default limit, per 64 KiB read).
    """

    def __init__(self, limit: int) -> None:
        self.half = max(limit // 2, 1)
        self.head = bytearray()
        self._tail: deque[bytes] = deque()
        self._skip = 0  # bytes of the first tail chunk already cut
        self._tail_size = 0  # bytes kept in the tail
        self.dropped = 0

    def add(self, data: bytes) -> None:
        room = self.half - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        if not data:
            return
        self._tail.append(bytes(data))
        self._tail_size += len(data)
        excess = self._tail_size - self.half
        while excess > 0:
            whole = len(self._tail[0]) - self._skip
            cut = min(whole, excess)
            if cut == whole:
                self._tail.popleft()
                self._skip = 0
            else:
                self._skip += cut
            self._tail_size -= cut
            self.dropped += cut
            excess -= cut

    def value(self) -> bytes:
        """The bytes kept: the head, then the tail (nothing in between marks the cut)."""
        if not self._tail:
            return bytes(self.head)
        first = memoryview(self._tail[0])[self._skip:]
        return b"".join([self.head, first, *list(self._tail)[1:]])


def bounded(data: bytes, limit: int) -> bytes:
    """``data`` cut to ``limit`` bytes: its head and its tail."""
    buffer = BoundedBuffer(limit)
    buffer.add(data)
    return buffer.value()
