"""The cost of keeping a chatty command's output: BoundedBuffer against a raw floor, same run.

    python benchmarks/output_buffer.py [--limit BYTES] [--mib MIB]

Feeds MIB mebibytes in 64 KiB chunks (what the namespace channel reads at a time) into a
BoundedBuffer at the given output limit (default: LIMITS.output_bytes, 16 MiB), and into the
floor: appending the same chunks to a list and dropping the oldest ones past the limit (the
least any keeper of a head and a tail must do). Prints both throughputs and their ratio.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

from pytest_smolvm import limits
from pytest_smolvm.backends.output import BoundedBuffer

CHUNK = b"y" * (64 << 10)


def _floor(limit: int, chunks: int) -> float:
    started = time.perf_counter()
    kept: collections.deque[bytes] = collections.deque()
    size = 0
    for _ in range(chunks):
        kept.append(CHUNK)
        size += len(CHUNK)
        while size > limit:
            size -= len(kept.popleft())
    return time.perf_counter() - started


def _buffer(limit: int, chunks: int) -> float:
    started = time.perf_counter()
    buffer = BoundedBuffer(limit)
    for _ in range(chunks):
        buffer.add(CHUNK)
    buffer.value()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=limits.LIMITS.output_bytes)
    parser.add_argument("--mib", type=int, default=1024)
    args = parser.parse_args()
    chunks = (args.mib << 20) // len(CHUNK)
    floor = statistics.median(_floor(args.limit, chunks) for _ in range(5))
    kept = statistics.median(_buffer(args.limit, chunks) for _ in range(5))
    mib = chunks * len(CHUNK) / (1 << 20)
    print(f"{mib:.0f} MiB in 64 KiB chunks, output limit {args.limit} bytes")
    print(f"  raw floor (deque of chunks):  {mib / floor:10.0f} MiB/s")
    print(f"  BoundedBuffer:                {mib / kept:10.0f} MiB/s")
    print(f"  ratio BoundedBuffer / floor:  {floor / kept:10.2f}")


if __name__ == "__main__":
    main()
