"""Bounded capture of a guest's output, shared by every backend.

The guest is an attacker: whatever it prints, the host keeps at most ``limit`` bytes of it.
"""

from __future__ import annotations


class BoundedBuffer:
    """Keeps the head and the tail of a stream; what falls between is counted, not kept."""

    def __init__(self, limit: int) -> None:
        self.half = max(limit // 2, 1)
        self.head = bytearray()
        self.tail = bytearray()
        self.dropped = 0

    def add(self, data: bytes) -> None:
        room = self.half - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        if data:
            self.tail += data
            excess = len(self.tail) - self.half
            if excess > 0:
                del self.tail[:excess]
                self.dropped += excess

    def value(self) -> bytes:
        if not self.dropped:
            return bytes(self.head + self.tail)
        marker = f"\n[pytest-smolvm: {self.dropped} bytes of output truncated]\n".encode()
        return bytes(self.head) + marker + bytes(self.tail)


def bounded(data: bytes, limit: int, dropped: int = 0) -> bytes:
    """``data`` cut to ``limit`` bytes (head and tail), counting ``dropped`` bytes already lost."""
    buffer = BoundedBuffer(limit)
    buffer.add(data)
    buffer.dropped += dropped
    return buffer.value()
