"""``--smol-max-vms``: a host-wide cap on live guests, shared by every pytest process.

Each live guest holds one of N lock files in the state dir. The locks are fcntl locks, so a
process that dies releases its slots with it: a crash can never leak capacity.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from pytest_smolvm.host.paths import state_dir

if TYPE_CHECKING:
    from filelock import FileLock

POLL_SECONDS = 0.02


class Slot:
    def __init__(self, lock: FileLock) -> None:
        self._lock = lock

    def release(self) -> None:
        self._lock.release(force=True)


def acquire(max_vms: int) -> Slot:
    """Wait (as long as it takes: the wait shows in the test's duration) for a free slot."""
    from filelock import FileLock, Timeout  # only runs with a cap pay its import

    directory = state_dir() / "slots"
    directory.mkdir(parents=True, exist_ok=True)
    locks = [FileLock(str(directory / f"slot-{i}.lock"), thread_local=False) for i in range(max_vms)]
    while True:
        for lock in locks:
            try:
                lock.acquire(timeout=0)
            except Timeout:
                continue
            return Slot(lock)
        time.sleep(POLL_SECONDS)
