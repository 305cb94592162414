"""Host process facts: is this pid still the process we recorded, and waiting for one to go."""

from __future__ import annotations

import os
import select
import time


def process_start_time(pid: int) -> int | None:
    """The kernel's start time of ``pid`` (clock ticks since boot), or None if it is gone.

    A pid alone is not an identity: pids are reused. (pid, start time) is.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    # comm (field 2) may contain spaces and parentheses: split after its closing paren.
    fields = raw[raw.rfind(b")") + 2:].split()
    if fields[0] == b"Z":
        return None  # a zombie has already released everything we care about
    return int(fields[19])


def is_alive(pid: int, start_time: int | None) -> bool:
    return start_time is not None and process_start_time(pid) == start_time


def wait_gone(pid: int, timeout: float) -> bool:
    """Wait until ``pid`` has exited (it need not be our child)."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    except OSError:
        pidfd = -1
    try:
        if pidfd >= 0:
            poller = select.poll()
            poller.register(pidfd, select.POLLIN)
            return bool(poller.poll(int(timeout * 1000)))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if process_start_time(pid) is None:
                return True
            time.sleep(0.005)
        return False
    finally:
        if pidfd >= 0:
            os.close(pidfd)
